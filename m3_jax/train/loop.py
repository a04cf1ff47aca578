"""The train loop's per-step decisions, named so the trainer reads in sections: the NaN guard, when to log (loss,
lr, tokens/s, MFU, the text stream), save and evaluate; SIGTERM as a clean stop; and the ahead-of-time compile
that prints the step's per-device memory before step 1."""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Callable

import jax
import ml_collections
import numpy as np

from m3_jax.data import inputs
from m3_jax.models.config import VLConfig
from m3_jax.models.flops import train_flops_per_token, vision_flops
from m3_jax.train import checkpoint as ckpt_lib
from m3_jax.train import config_lib
from m3_jax.train.metrics import MetricWriter, Progress, log, peak_flops
from m3_jax.train.state import ModelConfig, TrainState


def compile_step(fn, *args):
  """fn (a jax.jit) lowered and compiled for `args`, with its per-device memory logged before it ever runs."""
  t0 = time.time()
  compiled = fn.lower(*args).compile()
  mem = compiled.memory_analysis()
  if mem is not None:
    gib = lambda b: b / 2**30  # noqa: E731
    log(f"compiled in {time.time() - t0:.1f}s; per-device memory: args {gib(mem.argument_size_in_bytes):.3f} GiB, "
        f"outputs {gib(mem.output_size_in_bytes):.3f} GiB, temps {gib(mem.temp_size_in_bytes):.3f} GiB")
  return compiled


def train_flops_per_step(cfg: ModelConfig, config: ml_collections.ConfigDict, batch: dict | None) -> float:
  """Model FLOPs of one train step (fwd + bwd = 3x fwd), the MFU numerator: the text tower over batch x seq_len
  tokens, plus for VL the vision tower + projector on every item slot of the global batch (padding items too:
  they are computed)."""
  b, t = inputs.train_rows(config), int(config.train.seq_len)
  flops = train_flops_per_token(config_lib.text_config(cfg), t) * b * t
  if isinstance(cfg, VLConfig) and batch is not None:
    for key in ("images", "videos"):
      if key in batch:
        _, n, f, h, w, _ = batch[key].shape  # [B, items, frames, H, W, C]
        flops += 3.0 * b * n * vision_flops(cfg, f, h, w)
  return flops


class _StopOnSigterm:
  """Turns SIGTERM into a clean stop between steps (the checkpoint is saved, nothing is lost)."""

  def __init__(self):
    self.requested = False
    try:
      signal.signal(signal.SIGTERM, self._handler)
    except ValueError:  # not the main thread
      pass

  def _handler(self, *_):
    self.requested = True


def _loss_line(step: int, ev: dict) -> str:
  return f"step {step}: " + ", ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in ev.items()
                                      if k.endswith("/loss") and k.count("/") == 2)


class Loop:
  """What happens around each step: metrics.jsonl / TensorBoard / the progress line every `train.log_every`
  steps (and the first and last), checkpoints every `checkpoint.every`, held-out evals every `train.eval_every`,
  the NaN guard whenever metrics are fetched. Keeps the first and last eval and the last saved step."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str, *, ckpt: ckpt_lib.Checkpointer, data_iter,
               run_config: dict, evaluate: Callable[[TrainState], dict], start: int, last_saved: int | None,
               flops_per_step: float):
    t = config.train
    self.ckpt, self.data_iter, self.run_config, self._evaluate = ckpt, data_iter, run_config, evaluate
    self.start, self.steps, self.log_every, self.eval_every = start, int(t.steps), int(t.log_every), int(t.eval_every)
    self.tokens_per_step = float(inputs.train_rows(config)) * float(t.seq_len)
    self.flops_per_step, self.peak = flops_per_step, peak_flops(jax.devices()[0])
    self.writer = MetricWriter(workdir, process_index=jax.process_index())
    self.progress = Progress(self.steps, start, quiet=jax.process_index() != 0)
    self.stopper = _StopOnSigterm()
    self.first_eval: dict = {}
    self.final_eval: dict = {}
    self.last_saved = last_saved
    self.t_last, self.tok_last = time.time(), 0.0
    self.profile = config_lib.profile_steps(config)
    self.profile_dir = os.path.join(workdir, "profile")
    self._tracing = False

  @property
  def stop_requested(self) -> bool:
    return self.stopper.requested

  def message(self, text: str) -> None:
    self.progress.message(text)

  def save(self, step: int, state: TrainState, force: bool = False) -> None:
    if self.ckpt.save(step, state, self.data_iter, self.run_config, force=force):
      self.last_saved = step

  def evaluate(self, step: int, state: TrainState) -> dict:
    """Held-out metrics at `step`, written and summarised on one line; the throughput clock restarts after."""
    ev = self._evaluate(state)
    self.writer.write(step, ev)
    self.progress.message(_loss_line(step, ev))
    self.t_last = time.time()
    return ev

  def before_step(self, step: int) -> None:
    """`step` (1-based) is about to run: start the profiler trace at the first profiled step."""
    if self.profile and step == self.profile[0] and jax.process_index() == 0:
      jax.profiler.start_trace(self.profile_dir, create_perfetto_trace=True)
      self._tracing = True

  def _stop_trace(self, metrics) -> None:
    jax.block_until_ready(metrics)  # the trace must hold the last profiled step's device work
    jax.profiler.stop_trace()
    self._tracing = False
    self.progress.message(f"profile of steps {self.profile[0]}..{self.profile[1]} in {self.profile_dir} "
                          "(their tokens/s include the tracing overhead)")

  def after_step(self, step: int, state: TrainState, metrics: dict[str, Any]) -> None:
    """`step` has just been taken: log, save and evaluate as due (metrics stay on device otherwise)."""
    if self._tracing and (step == self.profile[1] or step == self.steps):
      self._stop_trace(metrics)
    self.tok_last += self.tokens_per_step
    is_log = step % self.log_every == 0 or step == self.steps or step == self.start + 1
    saving = self.ckpt.every > 0 and step % self.ckpt.every == 0
    if is_log or saving:
      m = jax.device_get(metrics)
      if not np.isfinite(m["loss"]) or not np.isfinite(m["grad_norm"]):
        raise FloatingPointError(
            f"non-finite loss/grad at step {step} (loss={m['loss']}, grad_norm={m['grad_norm']}); stopping "
            f"without saving this state: the last good checkpoint is step {self.last_saved} in {self.ckpt.directory}")
      if is_log:
        self._log(step, m)
    if saving:
      self.save(step, state)
    if self.eval_every > 0 and (step % self.eval_every == 0 or step == self.steps):
      self.final_eval = self.evaluate(step, state)

  def _log(self, step: int, m: dict[str, Any]) -> None:
    tps = self.tok_last / max(time.time() - self.t_last, 1e-9)
    m = {k: v for k, v in m.items() if k != "tokens"}
    m["tokens_per_sec"] = tps
    m["mfu"] = (tps * self.flops_per_step / self.tokens_per_step / (self.peak * jax.device_count())
                if self.peak else None)
    stats = jax.local_devices()[0].memory_stats() or {}  # None on the CPU backend
    if "peak_bytes_in_use" in stats:
      m["peak_memory_gib"] = stats["peak_bytes_in_use"] / 2**30
    m.update(inputs.text_stream_metrics(self.data_iter))
    self.writer.write(step, m)
    self.progress.update(step, f"loss {float(m['loss']):.4f} lr {float(m['lr']):.2e} "
                         f"gnorm {float(m['grad_norm']):.3f} {tps:,.0f} tok/s")
    self.t_last, self.tok_last = time.time(), 0.0

  def close(self) -> None:
    if self._tracing:  # the loop stopped inside the profiled steps (SIGTERM, Ctrl-C, an error)
      jax.profiler.stop_trace()
      self._tracing = False
    self.progress.close()
    self.ckpt.close()
    self.writer.close()
