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


class MetricWriter:
  """One JSON object per logged step in metrics.jsonl (append-only: a resumed run continues the file)."""

  def __init__(self, workdir: str, *, tensorboard: bool = True, process_index: int = 0):
    self.active = process_index == 0
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._tb = None
    if self.active:
      os.makedirs(workdir, exist_ok=True)
      if tensorboard:
        try:
          from tensorboardX import SummaryWriter  # noqa: PLC0415
          self._tb = SummaryWriter(os.path.join(workdir, "tb"))
        except ImportError:
          print("tensorboardX is not installed: TensorBoard events are off", file=sys.stderr)

  def write(self, step: int, metrics: Mapping[str, Any]) -> None:
    if not self.active:
      return
    row = {"step": int(step), **{k: to_python(v) for k, v in metrics.items()}}
    with open(self.path, "a") as f:
      f.write(json.dumps(row) + "\n")
    if self._tb is not None:
      for k, v in row.items():
        if k != "step" and isinstance(v, (int, float)) and v is not None:
          self._tb.add_scalar(k, v, step)
      self._tb.flush()

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()


def read_metrics(workdir: str) -> list[dict]:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


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
