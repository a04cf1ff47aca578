"""Orbax checkpoints: the train state, the grain iterator state and the run config saved together; restore onto
any mesh (the abstract target carries the shardings of the mesh restored onto); params-only export.

What makes a step trustworthy (README "Reliability"): a step becomes "last good" only once its save has finished
and a digest of every file in it (`SHA256SUMS`, sha256sum's format) has been written; restoring checks the digest
and the state's finiteness first. A step that fails (a flipped bit, a truncated or missing file, non-finite values)
is renamed `<step>.corrupt-<n>` (never deleted) and the newest intact step is restored instead, with a warning.
The trainer holds `WorkdirLock` for the whole run, so no second trainer writes the same checkpoints."""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import sys
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

try:
  import grain
  _GRAIN_SAVE, _GRAIN_RESTORE = grain.checkpoint.CheckpointSave, grain.checkpoint.CheckpointRestore
except (ImportError, AttributeError):  # the export/eval path needs no grain
  _GRAIN_SAVE = _GRAIN_RESTORE = None

DIGEST = "SHA256SUMS"
_TMP_MARK = ".orbax-checkpoint-tmp"


class CheckpointError(RuntimeError):
  """A checkpoint could not be written or restored; the message names the step, the file and what to do."""


class WorkdirLocked(RuntimeError):
  """Another live trainer holds the workdir; the message names it (host, pid, since when)."""


def _log(msg: str) -> None:
  if jax.process_index() == 0:
    print(msg, flush=True)


def _first_line(e: BaseException) -> str:
  """The root cause's first line: orbax wraps a tensorstore error (which names the file and byte range) in
  exceptions that print a page of spec each."""
  while e.__cause__ is not None:
    e = e.__cause__
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def _agree(value: int) -> int:
  """Process 0's `value` on every process (it alone reads and renames files; the others follow its verdict)."""
  if jax.process_count() == 1:
    return value
  from jax.experimental import multihost_utils  # noqa: PLC0415
  return int(multihost_utils.broadcast_one_to_all(np.int64(value)))


def _everywhere(ok: bool) -> bool:
  """`ok` on every process (a restore can fail on one process only, e.g. for its own data-iterator file)."""
  if jax.process_count() == 1:
    return ok
  from jax.experimental import multihost_utils  # noqa: PLC0415
  return bool(np.min(multihost_utils.process_allgather(np.int32(ok))))


def _sync(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # noqa: PLC0415
    multihost_utils.sync_global_devices(name)


@contextlib.contextmanager
def _quiet_library_logs():
  """A restore that fails is reported in one line by us; orbax (absl) and asyncio would log a traceback per array
  read (thousands of lines for one truncated file)."""
  loggers = [logging.getLogger(name) for name in ("absl", "asyncio")]
  levels = [lg.level for lg in loggers]
  for lg in loggers:
    lg.setLevel(logging.CRITICAL)
  try:
    yield
  finally:
    for lg, level in zip(loggers, levels):
      lg.setLevel(level)


class _NoLibraryTracebacks(logging.Filter):
  """orbax logs the traceback of a failed background write once per thread involved (hundreds of lines for one
  full disk); the CheckpointError we raise names the root cause, so its records keep their one line."""

  def filter(self, record: logging.LogRecord) -> bool:
    if record.exc_info and f"{os.sep}orbax{os.sep}" in record.pathname:
      record.exc_info, record.exc_text = None, None
    return True


@contextlib.contextmanager
def short_library_errors():
  """For the length of a run: orbax's log records without tracebacks (M3_JAX_TRACEBACK=1 keeps them)."""
  if os.environ.get("M3_JAX_TRACEBACK"):
    yield
    return
  logger, quiet = logging.getLogger("absl"), _NoLibraryTracebacks()
  logger.addFilter(quiet)
  try:
    yield
  finally:
    logger.removeFilter(quiet)


# ---- digests ---------------------------------------------------------------------------------------------------

def _files(step_dir: str) -> list[str]:
  out = []
  for root, _, names in os.walk(step_dir):
    out += [os.path.relpath(os.path.join(root, n), step_dir) for n in names]
  return sorted(f for f in out if f != DIGEST)


def _sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def _hash_all(step_dir: str, names: list[str]) -> list[str]:
  # hashlib releases the GIL: a big checkpoint's files hash in parallel
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    return list(pool.map(lambda n: _sha256(os.path.join(step_dir, n)), names))


def write_digest(step_dir: str) -> None:
  """STEP_DIR/SHA256SUMS over every file of the finished step (`sha256sum -c SHA256SUMS` checks it by hand)."""
  names = _files(step_dir)
  lines = "".join(f"{h}  {n}\n" for h, n in zip(_hash_all(step_dir, names), names))
  tmp = os.path.join(step_dir, f".{DIGEST}.tmp")
  with open(tmp, "w") as f:
    f.write(lines)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, os.path.join(step_dir, DIGEST))  # a digest is either complete or absent


def digest_problem(step_dir: str) -> str | None:
  """None when every file listed in STEP_DIR/SHA256SUMS is there with its digest; else what is wrong, naming the
  first bad file. A step without SHA256SUMS (written by older code, or killed between its save and its digest) is
  checked by restoring it instead: None here."""
  path = os.path.join(step_dir, DIGEST)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    expected = [line.rstrip("\n").split("  ", 1) for line in f if line.strip()]
  if not expected or any(len(e) != 2 for e in expected):
    return f"{DIGEST} itself is damaged"
  missing = [n for _, n in expected if not os.path.isfile(os.path.join(step_dir, n))]
  if missing:
    return f"{missing[0]} is missing" + (f" (and {len(missing) - 1} more files)" if len(missing) > 1 else "")
  names = [n for _, n in expected]
  for (want, name), got in zip(expected, _hash_all(step_dir, names)):
    if want != got:
      size = os.path.getsize(os.path.join(step_dir, name))
      return f"{name} does not match its SHA-256 in {DIGEST} (damaged or truncated; {size:,} bytes now)"
  return None


def all_finite(tree: Any) -> bool:
  """Every floating-point leaf of `tree` (jax arrays, possibly sharded) is finite."""
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  if not leaves:
    return True
  return bool(jax.jit(lambda xs: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs])))(leaves))


# ---- the workdir lock ------------------------------------------------------------------------------------------

def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # alive, another user's
    return True
  return True


def _describe(holder: dict) -> str:
  return (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} (since {holder.get('since', '?')}"
          + (f", {holder['command']}" if holder.get("command") else "") + ")")


class WorkdirLock:
  """WORKDIR/run.lock for the length of a training run. The lock is an flock, which the kernel drops when its
  process dies, so a lock left by a killed run is stale and is taken over; the file says who holds it (host, pid,
  since when) for the message a second trainer gets. On several processes only process 0 locks, and every process
  learns its verdict. Where the filesystem has no flock, the file itself is the lock and a holder whose pid is no
  longer alive on this host is stale."""

  NAME = "run.lock"

  def __init__(self, workdir: str):
    self.workdir = os.path.abspath(workdir)
    self.path = os.path.join(self.workdir, self.NAME)
    self._fd: int | None = None

  def __enter__(self) -> "WorkdirLock":
    self.acquire()
    return self

  def __exit__(self, *exc) -> None:
    self.release()

  def acquire(self) -> None:
    refusal = ""
    if jax.process_index() == 0:
      try:
        self._acquire()
      except WorkdirLocked as e:
        refusal = str(e)
    if not _agree(0 if refusal else 1):
      raise WorkdirLocked(refusal or f"process 0 could not lock {self.workdir} (its output says who holds it)")

  def _me(self) -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))[:200]}

  def _refuse(self, holder: dict, extra: str = "") -> WorkdirLocked:
    return WorkdirLocked(f"{self.workdir} is in use by another trainer: {_describe(holder)}. Wait for it to end, "
                         f"stop it, or use another --workdir{extra}")

  def _acquire(self) -> None:
    os.makedirs(self.workdir, exist_ok=True)
    for _ in range(20):
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        holder = _read_holder(fd)
        os.close(fd)
        orphan = ("; that pid is no longer running, but a process it forked (a data worker?) still holds the lock: "
                  "stop it" if self._dead_here(holder) else "")
        raise self._refuse(holder, orphan) from None
      except OSError as e:
        os.close(fd)
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
          return self._acquire_without_flock()
        raise
      try:
        same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
      except FileNotFoundError:
        same = False
      if not same:  # its holder released (removed) it between our open and flock: lock the new file
        os.close(fd)
        continue
      old = _read_holder(fd)
      if old:
        gone = "no longer running" if self._dead_here(old) else "its lock is no longer held"
        _log(f"note: taking over the stale lock {self.path} of {_describe(old)}: that run is {gone}")
      self._write(fd)
      return
    raise WorkdirLocked(f"could not lock {self.path}: it keeps being replaced by another process")

  def _acquire_without_flock(self) -> None:
    for _ in range(2):
      try:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
      except FileExistsError:
        with open(self.path, "rb") as f:
          holder = _parse_holder(f.read())
        if self._dead_here(holder):
          _log(f"note: taking over the stale lock {self.path} of {_describe(holder)}: that run is no longer running")
          os.remove(self.path)
          continue
        raise self._refuse(holder, f" (if that run is gone, remove {self.path})") from None
      self._write(fd)
      return
    raise WorkdirLocked(f"could not lock {self.path}")

  @staticmethod
  def _dead_here(holder: dict) -> bool:
    """The holder ran on this host and its pid is gone (another host's pid cannot be checked from here)."""
    pid = int(holder.get("pid", 0) or 0)
    return holder.get("host") == socket.gethostname() and pid > 0 and not _pid_alive(pid)

  def _write(self, fd: int) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(self._me()).encode(), 0)
    self._fd = fd

  def release(self) -> None:
    if self._fd is None:
      return
    try:
      if os.fstat(self._fd).st_ino == os.stat(self.path).st_ino:
        os.remove(self.path)
    except FileNotFoundError:
      pass
    finally:
      os.close(self._fd)  # drops the flock
      self._fd = None


def _read_holder(fd: int) -> dict:
  return _parse_holder(os.pread(fd, 4096, 0))


def _parse_holder(raw: bytes) -> dict:
  try:
    d = json.loads(raw.decode() or "{}")
    return d if isinstance(d, dict) else {}
  except ValueError:
    return {}


# ---- periodic checkpoints ----------------------------------------------------------------------------------------

class Checkpointer:
  """Periodic saves with keep-N under WORKDIR/checkpoints, digested and verified.

  writer=True is the trainer's (it holds the workdir lock): interrupted saves' temporaries are removed at start and
  broken steps are moved aside. Readers (eval, export) skip broken steps and leave the directory as it is."""

  def __init__(self, directory: str, *, every: int, keep: int, async_save: bool = True, writer: bool = False):
    self.directory = os.path.abspath(directory)
    self.every = every
    self.writer = writer
    self.async_save = async_save
    if writer and jax.process_index() == 0:
      self._remove_temporaries()
    _sync("m3_jax:checkpoint_temporaries")
    options = ocp.CheckpointManagerOptions(
        save_decision_policy=policies.FixedIntervalPolicy(max(every, 1)),
        preservation_policy=policies.LatestN(max(keep, 1)),
        enable_async_checkpointing=async_save,
        create=True,
    )
    self.manager = ocp.CheckpointManager(self.directory, options=options)
    self._newest = self.manager.latest_step()  # before anything is moved aside: named if an older step is restored
    self.last_good: int | None = None  # the newest step known finished, digested and finite
    self._pending: int | None = None  # a save that has started but is not confirmed yet
    self._checked: dict[int, str | None] = {}  # step -> digest_problem, each step hashed once
    self._asides = 0

  def _remove_temporaries(self) -> None:
    if not os.path.isdir(self.directory):
      return
    for name in sorted(os.listdir(self.directory)):
      if _TMP_MARK in name:
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        _log(f"removed {os.path.join(self.directory, name)}: the temporary directory of a save that never finished")

  def latest_step(self) -> int | None:
    """The newest step orbax lists (unverified; `latest_intact_step` is the one to restore)."""
    return self.manager.latest_step()

  def step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def _intact_steps(self) -> Iterator[int]:
    """Steps newest first whose files match their digest; on the way each broken one is reported in one line and
    moved aside (writer) or skipped (reader)."""
    for step in sorted(self.manager.all_steps(), reverse=True):
      if step not in self._checked:
        problem = digest_problem(self.step_dir(step)) if jax.process_index() == 0 else None
        intact = _agree(1 if problem is None else 0)
        self._checked[step] = None if intact else (problem or "its files do not match their digest")
      problem = self._checked[step]
      if problem is None:
        yield step
      else:
        self._set_aside(step, problem)

  def latest_intact_step(self) -> int | None:
    return next(self._intact_steps(), None)

  def _set_aside(self, step: int, problem: str) -> None:
    src = self.step_dir(step)
    if not self.writer:
      _log(f"warning: checkpoint step {step} in {self.directory} is corrupt: {problem}; skipping it")
      return
    if jax.process_index() == 0:
      n = 1
      while os.path.exists(f"{src}.corrupt-{n}"):
        n += 1
      os.rename(src, f"{src}.corrupt-{n}")
      _log(f"warning: checkpoint step {step} is corrupt: {problem}; moved it to {src}.corrupt-{n} (not deleted) and "
           "falling back to an older step")
    self._asides += 1
    _sync(f"m3_jax:set_aside_{self._asides}")
    self.manager.reload()
    self._checked.pop(step, None)

  def saved_config(self, step: int | None = None) -> dict | None:
    step = self.latest_step() if step is None else step
    if step is None:
      return None
    path = os.path.join(self.directory, str(step), "config", "metadata")
    if os.path.exists(path):
      with open(path) as f:
        try:
          return json.load(f)
        except ValueError:  # damaged: restore_latest judges the step; the compatibility check has nothing to read
          return None
    restored = self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
    return restored["config"]

  # ---- saving ----

  def save(self, step: int, state: Any, data_iter: Any, config: dict, *, force: bool = False) -> bool:
    """Starts saving `step` (asynchronously when configured); a failure of the previous save is raised here as a
    CheckpointError. The caller guarantees `state` is finite (the divergence check runs before every save)."""
    if self._pending is not None:  # orbax waits for it anyway before starting another save
      self._confirm()
    items = {"state": ocp.args.StandardSave(state), "config": ocp.args.JsonSave(config)}
    if data_iter is not None and _GRAIN_SAVE is not None:
      items["data"] = _GRAIN_SAVE(data_iter)
    try:
      saved = self.manager.save(step, args=ocp.args.Composite(**items), force=force)
    except Exception as e:  # noqa: BLE001  (a write error of this save, or of the previous async one)
      raise CheckpointError(self._failed(self._pending if self._pending is not None else step, e)) from None
    if saved:
      self._pending = step
      if not self.async_save:
        self._confirm()
    return saved

  def poll(self) -> None:
    """Without waiting: once the pending save has finished, its error is raised (CheckpointError) or its digest is
    written and it becomes `last_good`. On several processes each would see its save finish at a different step and
    confirming takes all of them: there the pending save is confirmed at the next save (or the end) instead."""
    if self._pending is not None and jax.process_count() == 1 and not self.manager.is_saving_in_progress():
      self._confirm()

  def wait(self) -> None:
    """Waits for the pending save and confirms it (raises CheckpointError if it failed)."""
    if self._pending is not None:
      self._confirm()

  def _confirm(self) -> None:
    step, self._pending = self._pending, None
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001
      raise CheckpointError(self._failed(step, e)) from None
    problem = None
    if jax.process_index() == 0:  # the primary process finalised the step (renamed its directory) and digests it
      if not os.path.isdir(self.step_dir(step)):
        problem = OSError("its directory was never finalised (an item failed to write)")
      else:
        try:
          write_digest(self.step_dir(step))
        except OSError as e:
          problem = e
    if not _agree(1 if problem is None else 0):
      raise CheckpointError(self._failed(step, problem or OSError("process 0 could not finalise it")))
    self._checked[step] = None
    self.last_good = step

  def _failed(self, step: int | None, e: BaseException) -> str:
    good = (f"The last good checkpoint is step {self.last_good}: free space (or fix the directory) and rerun the "
            "same command to resume from it" if self.last_good is not None else
            "No checkpoint was kept: free space (or fix the directory) and rerun")
    return (f"saving checkpoint step {step} to {self.directory} failed ({_first_line(e)}); training stopped. "
            f"{good}; the partial save is removed then")

  # ---- restoring ----

  def restore(self, step: int, abstract_state: Any, data_iter: Any = None) -> Any:
    """abstract_state: a pytree of jax.ShapeDtypeStruct with the target (possibly different) mesh's shardings.
    data_iter: a grain iterator whose position is restored in place."""
    items = {"state": ocp.args.StandardRestore(abstract_state)}
    if data_iter is not None and _GRAIN_RESTORE is not None:
      items["data"] = _GRAIN_RESTORE(data_iter)
    restored = self.manager.restore(step, args=ocp.args.Composite(**items))
    return restored["state"]

  def restore_latest(self, abstract_state: Any, data_iter: Any = None) -> tuple[Any, int | None]:
    """(state, step) of the newest step that is intact, restores and is finite; (None, None) when there is none.

    A step whose files fail their digest, or whose state is not finite, is moved aside (writer) at once. A step
    orbax cannot restore is moved aside only once an older step restores (a config that no longer fits every
    step is an error to fix, not damage: then nothing is moved and the first error is raised)."""
    unreadable: list[tuple[int, str]] = []
    for step in self._intact_steps():
      why = None
      try:
        with _quiet_library_logs():
          state = self.restore(step, abstract_state, data_iter)
      except Exception as e:  # noqa: BLE001
        why = _first_line(e)
      if not _everywhere(why is None):
        unreadable.append((step, why or "it failed to restore on another process"))
        continue
      if not all_finite(state):
        self._set_aside(step, "its state holds non-finite values (saved by a diverged run)")
        continue
      for bad, why in unreadable:
        self._set_aside(bad, f"orbax cannot restore it ({why}) while step {step} restores")
      if self.writer and jax.process_index() == 0 and not os.path.exists(os.path.join(self.step_dir(step), DIGEST)):
        write_digest(self.step_dir(step))  # it restored completely and is finite: digest it from now on
      _sync(f"m3_jax:restored_{step}")
      if self._newest is not None and step != self._newest:
        _log(f"warning: restoring step {step}, not the newest step {self._newest} (see the warnings above)")
      self.last_good = step
      return state, step
    if unreadable:
      step, why = unreadable[0]
      raise CheckpointError(f"checkpoint step {step} in {self.directory} does not restore into this run's state "
                            f"({why}); no older step does either, so nothing was moved. Did the code or the optimizer "
                            "change since it was saved? Use the version that wrote it, or a fresh --workdir")
    return None, None

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self.manager.close()


def make_checkpointer(config, workdir: str, *, writer: bool = False) -> Checkpointer:
  """The experiment config's `checkpoint` section -> the Checkpointer of WORKDIR/checkpoints (writer: the trainer's,
  which holds the workdir lock)."""
  c = config.checkpoint
  return Checkpointer(os.path.join(workdir, "checkpoints"), every=int(c.every), keep=int(c.keep),
                      async_save=bool(c.get("async_save", True)), writer=writer)


def abstract_like(tree: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


# ---- params-only export ---------------------------------------------------------------------------------------

def export_params(path: str, params: Any, model_config: dict, *, dtype: str | None = None) -> str:
  """Writes PATH/params (orbax) + PATH/model_config.json; loadable without the optimizer."""
  path = os.path.abspath(path)
  if dtype is not None:
    target = jnp.dtype(dtype)
    params = jax.tree.map(lambda x: x.astype(target) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(os.path.join(path, "params"), params, force=True)
  ckptr.wait_until_finished()
  if jax.process_index() == 0:
    with open(os.path.join(path, "model_config.json"), "w") as f:
      json.dump(model_config, f, indent=2, sort_keys=True)
  return path


def is_export(path: str) -> bool:
  return os.path.exists(os.path.join(path, "model_config.json")) and os.path.isdir(os.path.join(path, "params"))


def load_export_config(path: str) -> dict:
  file = os.path.join(path, "model_config.json")
  with open(file) as f:
    try:
      return json.load(f)
    except ValueError as e:
      raise ValueError(f"{file}: not valid JSON ({e}); the export is damaged") from None


def restore_params(path: str, abstract_params: Any) -> Any:
  """Restores exported params onto `abstract_params`' shardings, casting to its dtypes (an export may be bf16)."""
  path = os.path.abspath(path)  # orbax refuses relative paths
  ckptr = ocp.StandardCheckpointer()
  meta = ckptr.metadata(os.path.join(path, "params"))
  stored = getattr(meta, "item_metadata", meta)
  # Restore in the stored dtype, then cast: orbax would otherwise refuse or silently reinterpret.
  try:
    stored_tree = jax.tree.map(lambda m: m.dtype, stored.tree if hasattr(stored, "tree") else stored)
    target = jax.tree.map(lambda a, dt: jax.ShapeDtypeStruct(a.shape, dt, sharding=a.sharding), abstract_params,
                          stored_tree)
  except Exception:  # structure mismatch: let orbax name the missing/unexpected keys
    target = abstract_params
  params = ckptr.restore(os.path.join(path, "params"), target)
  return jax.tree.map(lambda x, a: x.astype(a.dtype), params, abstract_params)
