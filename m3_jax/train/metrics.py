"""Where training measurements go: stdout (a progress bar on a terminal), WORKDIR/metrics.jsonl, TensorBoard."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Mapping

import jax
import numpy as np

# Peak dense bf16 FLOP/s per device for the MFU estimate (vendor figures; CPU has no meaningful peak).
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "TPU v5p": 459e12,
    "TPU v4": 275e12,
}


def log(msg: str) -> None:
  """A line on stdout from process 0 only (every process runs the same program)."""
  if jax.process_index() == 0:
    print(msg, flush=True)


def peak_flops(device) -> float | None:
  kind = getattr(device, "device_kind", "")
  for name, f in PEAK_FLOPS.items():
    if name.lower() in kind.lower():
      return f
  return None


def to_python(x: Any) -> Any:
  if isinstance(x, Mapping):
    return {k: to_python(v) for k, v in x.items()}
  arr = np.asarray(x)
  if arr.ndim == 0:
    v = arr.item()
    return None if isinstance(v, float) and not math.isfinite(v) else v
  return arr.tolist()


class MetricsWriteError(OSError):
  """metrics.jsonl or the TensorBoard events could not be written (disk full, no permission); the message names the
  file."""


class _TensorBoard:
  """Scalar events written in the caller's thread (tensorboardX's SummaryWriter writes from a worker thread, where a
  full disk became a traceback and, later, a hang of its queue). `purge_step`: TensorBoard hides the events that
  earlier runs logged at that step or later (a resumed run logs them again)."""

  def __init__(self, logdir: str, purge_step: int | None):
    from tensorboardX.event_file_writer import EventsWriter  # noqa: PLC0415
    from tensorboardX.proto.event_pb2 import Event, SessionLog  # noqa: PLC0415
    from tensorboardX.proto.summary_pb2 import Summary  # noqa: PLC0415
    self._event, self._summary = Event, Summary
    os.makedirs(logdir, exist_ok=True)
    # the pid keeps two runs started in the same second from writing (and truncating) one file
    self._file = EventsWriter(os.path.join(logdir, "events"), f".{os.getpid()}")
    if purge_step is not None:
      self._file.write_event(Event(wall_time=time.time(), step=purge_step,
                                   session_log=SessionLog(status=SessionLog.START)))
      self._file.flush()

  def scalars(self, step: int, values: Mapping[str, float]) -> None:
    if not values:
      return
    summary = self._summary(value=[self._summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()])
    self._file.write_event(self._event(wall_time=time.time(), step=int(step), summary=summary))
    self._file.flush()

  def close(self) -> None:
    self._file.close()


class MetricWriter:
  """One JSON object per logged step in metrics.jsonl, and TensorBoard scalars in tb/.

  resume_step: the step the run starts from. Rows after it are dropped from metrics.jsonl (an interrupted run
  logged them; they are logged again), so each step appears once; TensorBoard is told to hide its events from
  resume_step + 1 on. None appends to whatever is there."""

  def __init__(self, workdir: str, *, tensorboard: bool = True, process_index: int = 0,
               resume_step: int | None = None):
    self.active = process_index == 0
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.tb_dir = os.path.join(workdir, "tb")
    self._tb = None
    if not self.active:
      return
    try:
      os.makedirs(workdir, exist_ok=True)
      if resume_step is not None:
        self._rewind(resume_step)
    except OSError as e:
      raise MetricsWriteError(f"cannot write {self.path}: {e}") from None
    if tensorboard:
      try:
        self._tb = _TensorBoard(self.tb_dir, None if resume_step is None else
                                (resume_step + 1 if resume_step > 0 else 0))
      except ImportError:
        print("tensorboardX is not installed: TensorBoard events are off", file=sys.stderr)
      except OSError as e:
        raise MetricsWriteError(f"cannot write TensorBoard events in {self.tb_dir}: {e}") from None

  def _rewind(self, step: int) -> None:
    """Keeps the rows up to `step` (none for a fresh start: step 0 is evaluated again)."""
    if not os.path.exists(self.path):
      return
    rows = _read_rows(self.path)
    keep = [r for r in rows if 0 < r.get("step", 0) <= step]
    if len(keep) == len(rows):
      return
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in keep)
    os.replace(tmp, self.path)
    print(f"metrics.jsonl: dropped {len(rows) - len(keep)} rows logged after step {step} by an interrupted run "
          "(those steps run again)", flush=True)

  def write(self, step: int, metrics: Mapping[str, Any]) -> None:
    if not self.active:
      return
    row = {"step": int(step), **{k: to_python(v) for k, v in metrics.items()}}
    try:
      with open(self.path, "a") as f:
        f.write(json.dumps(row) + "\n")
    except OSError as e:
      raise MetricsWriteError(f"cannot write {self.path}: {e}") from None
    if self._tb is not None:
      try:
        self._tb.scalars(step, {k: v for k, v in row.items()
                                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)})
      except OSError as e:
        raise MetricsWriteError(f"cannot write TensorBoard events in {self.tb_dir}: {e}") from None

  def close(self) -> None:
    if self._tb is not None:
      try:
        self._tb.close()
      except OSError:
        pass  # the error of its last write was already raised
      self._tb = None


def _read_rows(path: str) -> list[dict]:
  """The rows of a metrics.jsonl; a last line cut short by a kill is ignored."""
  with open(path) as f:
    lines = [line for line in f if line.strip()]
  rows = []
  for i, line in enumerate(lines):
    try:
      rows.append(json.loads(line))
    except ValueError:
      if i < len(lines) - 1:
        raise ValueError(f"{path}, line {i + 1}: not JSON: {line[:80]!r}") from None
  return rows


def read_metrics(workdir: str) -> list[dict]:
  """The rows of WORKDIR/metrics.jsonl, each step once: files written before resumes rewound them can hold a step
  twice (logged before a kill and again after the resume); the last row of each (step, kind) is kept, a kind being
  the train row or the eval row of that step."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  last: dict[tuple[int, bool], int] = {}
  rows = _read_rows(path)
  for i, r in enumerate(rows):
    last[(r.get("step"), all(k.startswith("eval/") for k in r if k != "step"))] = i
  keep = sorted(last.values())
  return [rows[i] for i in sorted(keep, key=lambda i: (rows[i].get("step", 0), i))]


class Progress:
  """A one-line progress bar on a terminal; plain periodic lines otherwise (CI logs, files)."""

  def __init__(self, total: int, start: int = 0, *, stream=None, quiet: bool = False):
    self.total, self.start, self.quiet = total, start, quiet
    self.stream = stream or sys.stdout
    self.tty = self.stream.isatty()
    self.t0 = time.time()

  def update(self, step: int, text: str) -> None:
    if self.quiet:
      return
    done = step - self.start
    left = self.total - step
    rate = done / max(time.time() - self.t0, 1e-9)
    eta = left / rate if rate > 0 else float("inf")
    eta_s = f"{eta:5.0f}s" if math.isfinite(eta) else "    ?"
    if self.tty:
      width = 24
      filled = int(width * step / max(self.total, 1))
      bar = "#" * filled + "." * (width - filled)
      self.stream.write(f"\r[{bar}] {step}/{self.total} eta {eta_s} | {text}\033[K")
    else:
      self.stream.write(f"step {step}/{self.total} eta {eta_s} | {text}\n")
    self.stream.flush()

  def message(self, text: str) -> None:
    if self.quiet:
      return
    if self.tty:
      self.stream.write("\r\033[K")
    self.stream.write(text + "\n")
    self.stream.flush()

  def close(self) -> None:
    if self.tty and not self.quiet:
      self.stream.write("\n")
      self.stream.flush()
