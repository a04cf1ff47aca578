"""Nothing lost, nothing silently wrong (issue 22): damaged checkpoints are moved aside and the newest intact step
is restored, divergence stops the run before anything of it is saved, one trainer per workdir, a failed save stops
the run, each step once in metrics.jsonl after kills, and inputs that are not what they claim are refused by name.

The trainer runs share one small config and a JAX compilation cache (module-scoped; the subprocess trainers read it
too), so each run after the first costs ~2 s on 2 CPU cores."""

import errno
import glob
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from m3_jax.data import inputs
from m3_jax.train import checkpoint as ckpt_lib
from m3_jax.train import loop, trainer
from m3_jax.train.metrics import MetricWriter, MetricsWriteError, read_metrics
from tests.train_utils import REPO, small_config

CONFIG = os.path.join(REPO, "tests", "small_config.py")
STEPS = 10  # the reference run: checkpoints every 2 steps, the newest 4 kept (4, 6, 8, 10)


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("jax_cache"))
  old = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  yield path
  from jax.experimental.compilation_cache import compilation_cache  # noqa: PLC0415
  jax.config.update("jax_compilation_cache_dir", old[0])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", old[1])
  compilation_cache.reset_cache()  # the rest of the session compiles as it would without this module


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("data"))
  inputs.prepare(small_config(d), vision=False)
  return d


def config(data_dir, **overrides):
  return small_config(data_dir, **{"train.steps": STEPS, "checkpoint.keep": 4, **overrides})


@pytest.fixture(scope="module")
def reference(data_dir, compile_cache, tmp_path_factory):
  """(workdir, {step: loss}) of an uninterrupted run."""
  work = str(tmp_path_factory.mktemp("reference"))
  trainer.train_and_evaluate(config(data_dir), work)
  return work, losses(work)


def losses(workdir) -> dict[int, float]:
  return {r["step"]: r["loss"] for r in read_metrics(workdir) if "loss" in r}


def logged_steps(workdir) -> list[int]:
  """The steps of metrics.jsonl's train rows as written (read_metrics would hide duplicates)."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [r["step"] for r in map(json.loads, f) if "loss" in r]


def step_dirs(workdir) -> list[str]:
  return sorted(os.listdir(os.path.join(workdir, "checkpoints")))


def biggest_file(step_dir: str) -> str:
  files = [f for f in glob.glob(os.path.join(step_dir, "state", "**", "*"), recursive=True) if os.path.isfile(f)]
  return max(files, key=os.path.getsize)


def run_main(args, cache_dir, **kw):
  env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=cache_dir,
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  return subprocess.Popen([sys.executable, "-m", "m3_jax.main", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, **kw)


# ---- damaged checkpoints --------------------------------------------------------------------------------------

def _flip_bits(step_dir):
  path = biggest_file(step_dir)
  with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) // 2)
    block = bytearray(f.read(64))
    f.seek(-len(block), os.SEEK_CUR)
    f.write(bytes(b ^ 0xFF for b in block))
  return os.path.relpath(path, step_dir)


def _truncate(step_dir):
  path = biggest_file(step_dir)
  os.truncate(path, os.path.getsize(path) // 2)
  return os.path.relpath(path, step_dir)


def _remove(rel):
  def damage(step_dir):
    os.remove(os.path.join(step_dir, rel))
    return rel
  return damage


def _truncate_undigested(step_dir):
  os.remove(os.path.join(step_dir, ckpt_lib.DIGEST))  # a step killed between its save and its digest, or older code
  _truncate(step_dir)
  return "OUT_OF_RANGE"  # orbax's own error names the array and byte range


DAMAGE = {
    "bit_flip": (_flip_bits, "does not match its SHA-256"),
    "truncated": (_truncate, "does not match its SHA-256"),
    "missing_metadata": (_remove("state/_METADATA"), "is missing"),
    "missing_iterator_state": (_remove("data/process_0-of-1.json"), "is missing"),
    "truncated_without_digest": (_truncate_undigested, "orbax cannot restore it"),
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_newest_step_is_moved_aside_and_the_run_resumes_from_the_newest_intact_one(
    kind, reference, data_dir, tmp_path, capsys):
  ref_dir, ref_losses = reference
  work = str(tmp_path / "w")
  shutil.copytree(ref_dir, work)
  newest = os.path.join(work, "checkpoints", str(STEPS))
  damage, problem = DAMAGE[kind]
  named = damage(newest)
  capsys.readouterr()
  trainer.train_and_evaluate(config(data_dir), work)
  out, err = capsys.readouterr()
  # one line names the step, the file (or orbax's cause) and where the step went
  line = next(x for x in out.splitlines() if f"checkpoint step {STEPS} is corrupt" in x)
  assert named in line and problem in line and f"{STEPS}.corrupt-1" in line
  assert f"restoring step {STEPS - 2}, not the newest step {STEPS}" in out
  assert f"resumed from step {STEPS - 2}" in out
  assert "Traceback" not in out + err
  # moved aside, not deleted; a fresh step 10 was written and verifies
  assert os.path.isdir(os.path.join(work, "checkpoints", f"{STEPS}.corrupt-1", "state"))
  assert ckpt_lib.digest_problem(newest) is None and os.path.exists(os.path.join(newest, ckpt_lib.DIGEST))
  # the steps after the restored one were trained again exactly as the uninterrupted run trained them, and each
  # step is logged once
  assert logged_steps(work) == list(range(1, STEPS + 1))
  assert losses(work) == ref_losses


def test_a_state_that_does_not_fit_any_step_is_an_error_and_nothing_is_moved(reference, tmp_path):
  """Restore failures on every step mean the run changed, not that the checkpoints are damaged."""
  import optax  # noqa: PLC0415
  from m3_jax.core import sharding  # noqa: PLC0415
  from m3_jax.train import config_lib, state as state_lib  # noqa: PLC0415
  work = str(tmp_path / "w")
  shutil.copytree(reference[0], work)
  before = step_dirs(work)
  cfg = config(reference[0])
  mesh = sharding.make_mesh(dict(cfg.mesh))
  _, other, _ = state_lib.abstract_state(config_lib.model_config(cfg), optax.sgd(0.1, momentum=0.9), mesh)
  ckpt = ckpt_lib.make_checkpointer(cfg, work, writer=True)
  with pytest.raises(ckpt_lib.CheckpointError, match=f"step {STEPS} .*does not restore.*nothing was moved"):
    ckpt.restore_latest(other)
  ckpt.close()
  assert step_dirs(work) == before


# ---- divergence ---------------------------------------------------------------------------------------------------

def test_divergence_stops_before_saving_and_the_kept_step_resumes_with_a_sane_lr(reference, data_dir, tmp_path):
  work = str(tmp_path / "w")
  every_step = {"checkpoint.every": 1, "checkpoint.keep": 10}
  # warmup: step 1 has lr 0, step 2 lr 5e34: the update of step 2 overflows the parameters
  with pytest.raises(loop.Diverged, match=r"at step 2 or in the state it produced \(non-finite update_norm=inf.*"
                                          r"last good checkpoint is step 1 .*learning_rate \(now 1e\+35\)"):
    trainer.train_and_evaluate(config(data_dir, **every_step, **{"optim.learning_rate": 1e35}), work)
  assert step_dirs(work) == ["0", "1"]  # nothing of step 2 reached the disk
  ckpt = ckpt_lib.make_checkpointer(config(data_dir), work)
  assert ckpt.latest_intact_step() == 1
  restored = ckpt.manager.restore(1, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
  ckpt.close()
  params = [np.asarray(x) for x in jax.tree.leaves(restored["params"])]
  assert all(np.isfinite(p).all() for p in params) and max(np.abs(p).max() for p in params) < 10.0
  # the same workdir with the sane learning rate continues from step 1 exactly as the uninterrupted run did
  trainer.train_and_evaluate(config(data_dir, **every_step), work)
  assert logged_steps(work) == list(range(1, STEPS + 1))
  assert losses(work) == reference[1]


def test_loss_spike_threshold():
  m = {"loss": 2.77e9, "grad_norm": 3.0, "update_norm": 1.0, "param_norm": 40.0}
  assert loop.divergence(m) is None  # finite: off by default
  assert "train.loss_spike=10" in loop.divergence(m, loss_spike=10.0, lowest_loss=6.2)
  assert loop.divergence({**m, "loss": 7.0}, loss_spike=10.0, lowest_loss=6.2) is None
  assert "param_norm=inf" in loop.divergence({**m, "param_norm": float("inf")})


# ---- one trainer per workdir, kills --------------------------------------------------------------------------------

def test_second_trainer_is_refused_and_a_killed_runs_lock_is_taken_over(data_dir, compile_cache, tmp_path, capsys):
  work = str(tmp_path / "w")
  flags = [f"--config={CONFIG}:{data_dir}", f"--workdir={work}", "--config.train.steps=100000",
           "--config.checkpoint.every=4", "--config.optim.schedule=constant"]
  first = run_main(flags, compile_cache)
  metrics = os.path.join(work, "metrics.jsonl")
  t0 = time.time()
  while first.poll() is None and time.time() - t0 < 300:
    if os.path.exists(metrics) and len(open(metrics).readlines()) >= 7:
      break
    time.sleep(0.05)
  try:
    assert first.poll() is None, first.communicate()[0]
    second = run_main(flags, compile_cache)
    out, _ = second.communicate(timeout=300)
    assert second.returncode == 1, out
    assert (f"is in use by another trainer: pid {first.pid} on host {socket.gethostname()} (since " in out), out
    assert "Traceback" not in out and len(out.splitlines()) < 10, out  # one short message
  finally:
    first.send_signal(signal.SIGKILL)
    first.communicate()
  assert json.load(open(os.path.join(work, "run.lock")))["pid"] == first.pid  # left behind by the kill
  killed_at = max(logged_steps(work))
  saved = max(int(s) for s in step_dirs(work) if s.isdigit())
  capsys.readouterr()
  trainer.train_and_evaluate(small_config(data_dir, **{"train.steps": saved + 3, "checkpoint.every": 4,
                                                       "optim.schedule": "constant"}), work)
  out = capsys.readouterr().out
  assert f"taking over the stale lock {work}/run.lock of pid {first.pid}" in out and "no longer running" in out
  assert f"resumed from step {saved}" in out
  assert not os.path.exists(os.path.join(work, "run.lock"))
  # rows the killed run logged after its last checkpoint were replaced, not duplicated
  assert killed_at >= saved
  assert logged_steps(work) == list(range(1, saved + 4))
  assert not glob.glob(os.path.join(work, "checkpoints", "*orbax-checkpoint-tmp*"))


# ---- a save that fails ------------------------------------------------------------------------------------------------

def test_failed_save_stops_the_run_and_the_next_start_removes_its_temporaries(
    reference, data_dir, compile_cache, tmp_path, monkeypatch, capsys):
  """A full disk while the real orbax writes the run config of step 4 (steps 0 and 2 save fine), asynchronously."""
  from orbax.checkpoint._src.handlers import json_checkpoint_handler  # noqa: PLC0415
  write = json_checkpoint_handler.JsonCheckpointHandler._save_fn
  calls = []

  async def disk_full_from_the_third_save(self, x, directory):
    calls.append(directory)
    if len(calls) >= 3:
      raise OSError(errno.ENOSPC, "No space left on device", str(directory))
    return await write(self, x, directory)

  monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn", disk_full_from_the_third_save)
  work = str(tmp_path / "w")
  threads = set(threading.enumerate())
  with pytest.raises(ckpt_lib.CheckpointError, match=r"saving checkpoint step 4 .*No space left on device.*"
                                                     r"last good checkpoint is step 2"):
    trainer.train_and_evaluate(config(data_dir, **{"checkpoint.async_save": True}), work)
  out, err = capsys.readouterr()
  assert "Traceback" not in out + err
  # stopped within one save interval: the failure surfaces at the next step, or at the next save at the latest
  assert max(logged_steps(work)) <= 6
  stale = glob.glob(os.path.join(work, "checkpoints", "4.orbax-checkpoint-tmp*"))
  assert stale and step_dirs(work)[:2] == ["0", "2"]
  assert ckpt_lib.digest_problem(os.path.join(work, "checkpoints", "2")) is None
  monkeypatch.undo()
  for t in set(threading.enumerate()) - threads:  # a new process would not share the failed run's writers
    t.join(timeout=60)

  trainer.train_and_evaluate(config(data_dir, **{"checkpoint.async_save": True}), work)
  out = capsys.readouterr().out
  assert f"removed {stale[0]}" in out and "resumed from step 2" in out
  assert not glob.glob(os.path.join(work, "checkpoints", "*orbax-checkpoint-tmp*"))
  assert logged_steps(work) == list(range(1, STEPS + 1))
  assert losses(work) == reference[1]


# ---- metrics ----------------------------------------------------------------------------------------------------

def _tb_events(logdir):
  from tensorboardX.proto.event_pb2 import Event  # noqa: PLC0415
  events = []
  for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
    data, i = open(path, "rb").read(), 0
    while i < len(data):  # TFRecord: length, its crc, the event, its crc
      (n,) = struct.unpack("<Q", data[i:i + 8])
      events.append(Event.FromString(data[i + 12:i + 12 + n]))
      i += 16 + n
  return events


def test_metrics_rewind_on_resume_old_duplicates_read_once_and_write_errors_name_the_file(tmp_path):
  work = str(tmp_path)
  w = MetricWriter(work)
  for s in (1, 2, 3, 4):
    w.write(s, {"loss": float(s)})
  w.write(4, {"eval/text/loss": 9.0})
  for s in (3, 4):  # an old file: a run resumed from step 2 appended steps 3 and 4 again
    w.write(s, {"loss": 10.0 + s})
  w.close()
  rows = read_metrics(work)
  assert [(r["step"], r.get("loss", r.get("eval/text/loss"))) for r in rows] == [
      (1, 1.0), (2, 2.0), (3, 13.0), (4, 9.0), (4, 14.0)]
  with open(os.path.join(work, "metrics.jsonl"), "a") as f:
    f.write('{"step": 5, "lo')  # cut short by a kill
  # resuming from step 2 keeps steps 1 and 2 only; TensorBoard is told to hide its events from step 3 on
  w = MetricWriter(work, resume_step=2)
  w.write(3, {"loss": 3.5})
  w.close()
  assert [(r["step"], r["loss"]) for r in read_metrics(work)] == [(1, 1.0), (2, 2.0), (3, 3.5)]
  assert logged_steps(work) == [1, 2, 3]
  purges = [e.step for e in _tb_events(os.path.join(work, "tb")) if e.HasField("session_log")]
  assert purges == [3]
  os.remove(os.path.join(work, "metrics.jsonl"))
  os.mkdir(os.path.join(work, "metrics.jsonl"))  # any write error: a clear one naming the file
  w = MetricWriter(work, tensorboard=False)
  with pytest.raises(MetricsWriteError, match=r"cannot write .*metrics.jsonl: \[Errno 21\] Is a directory"):
    w.write(1, {"loss": 1.0})


# ---- inputs ---------------------------------------------------------------------------------------------------

def test_generate_validates_max_new_tokens_before_loading_anything(tmp_path):
  export = tmp_path / "export"  # not loadable: loading it would fail, so these answers come before any load
  (export / "params").mkdir(parents=True)
  (export / "model_config.json").write_text("{}")

  def generate(n):
    return subprocess.run([sys.executable, "-m", "m3_jax.generate", f"--checkpoint={export}", "--prompt=To be",
                           f"--max_new_tokens={n}"], cwd=REPO, capture_output=True, text=True, timeout=120)

  zero = generate(0)
  assert zero.returncode == 0 and zero.stdout == "To be\n", zero.stderr
  negative = generate(-3)
  assert negative.returncode == 1 and negative.stdout == ""
  assert negative.stderr.strip() == "error: --max_new_tokens=-3 must be >= 0 (0 prints the prompt only)"


def test_inputs_that_are_not_what_they_claim_are_named(tmp_path, capsys):
  from m3_jax.data.text_sources import read_text_file  # noqa: PLC0415
  from m3_jax.interop import hf, safetensors_io  # noqa: PLC0415
  junk = tmp_path / "junk.txt"
  junk.write_bytes(np.random.default_rng(0).integers(0, 256, 300_000, dtype=np.uint8).tobytes())
  cfg = small_config(str(tmp_path / "d"), **{"data.text_files": f"junk={junk}"})
  with pytest.raises(ValueError, match=f"{junk} does not look like text"):
    inputs.prepare(cfg, vision=False)
  latin = tmp_path / "latin.txt"
  latin.write_bytes("The caf\u00e9 served cr\u00e8me br\u00fbl\u00e9e to everyone in the square. ".encode("latin-1") * 20)
  assert read_text_file(str(latin))
  assert f"warning: {latin}" in capsys.readouterr().out
  # data.dir: created inside an existing directory (with a word), refused where a typo would put it
  for bad in (str(tmp_path / "no" / "such" / "dir"), "/m3_jax_data_typo"):
    with pytest.raises(ValueError, match=f"data.dir='{bad}' does not exist"):
      inputs.check_data_dir(bad)
    assert not os.path.exists(bad)
  inputs.check_data_dir(str(tmp_path / "fresh"))
  assert "creating it" in capsys.readouterr().out
  # a truncated safetensors header and an invalid config.json name their file
  st = tmp_path / "model.safetensors"
  st.write_bytes(struct.pack("<Q", 4096) + b'{"w": {"dtype": "F32", ')
  with pytest.raises(ValueError, match=f"{st}: its header claims 4,096 bytes"):
    safetensors_io.SafetensorsFile(str(st))
  cj = tmp_path / "config.json"
  cj.write_text('{"hidden_size": 32,')
  with pytest.raises(ValueError, match=f"{cj}: not valid JSON"):
    hf.read_config(str(tmp_path))
