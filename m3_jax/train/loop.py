"""The train loop's per-step decisions, named so the trainer reads in sections: the divergence check, when to log
(loss, lr, tokens/s, MFU, the text stream), save and evaluate; SIGTERM as a clean stop; and the ahead-of-time compile
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


class Diverged(FloatingPointError):
  """The updated state is not finite (or the loss spiked): nothing of that step was saved; the message names the last
  good checkpoint and what to change."""


def divergence(m: dict[str, Any], *, loss_spike: float = 0.0, lowest_loss: float | None = None) -> str | None:
  """What is wrong with a step's fetched metrics, or None. The parameter and update norms are those of the state
  the step produced (the one that would be saved), so a blown-up update is caught before it reaches a checkpoint."""
  bad = [f"{k}={m[k]}" for k in ("loss", "grad_norm", "update_norm", "param_norm")
         if k in m and not np.isfinite(m[k])]
  if bad:
    return "non-finite " + ", ".join(bad)
  if loss_spike > 0 and lowest_loss is not None and float(m["loss"]) > loss_spike * lowest_loss:
    return (f"the loss {float(m['loss']):.4g} is over train.loss_spike={loss_spike:g} times the lowest loss of this "
            f"run so far ({lowest_loss:.4g})")
  return None


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
    self.writer = MetricWriter(workdir, process_index=jax.process_index(), resume_step=start)
    self.progress = Progress(self.steps, start, quiet=jax.process_index() != 0)
    self.stopper = _StopOnSigterm()
    self.first_eval: dict = {}
    self.final_eval: dict = {}
    self.last_saved = last_saved
    self.optim = config.optim
    self.loss_spike = float(t.get("loss_spike", 0.0) or 0.0)
    self.lowest_loss: float | None = None
    self._metrics: dict[str, Any] | None = None  # the last step's metrics, still on device
    self._checked = start  # the last step whose state passed the divergence check (a restored one did)
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
    """Saves `step` once its state has passed the divergence check (checked now if it was not yet)."""
    if self._checked != step:
      self.check(step, jax.device_get(self._metrics))
    if self.ckpt.save(step, state, self.data_iter, self.run_config, force=force):
      self.last_saved = step

  def save_initial(self, state: TrainState, data_state: Any) -> None:
    """A fresh run's initial state as step 0, with the data iterator before its first batch (`data_state`, taken
    before the trainer read that batch): a run that diverges before its first periodic save still leaves a finite
    state to resume from."""
    after = self.data_iter.get_state()
    self.data_iter.set_state(data_state)
    self.save(0, state, force=True)
    self.data_iter.set_state(after)

  def check(self, step: int, m: dict[str, Any]) -> None:
    """The divergence check of `step`'s fetched metrics: raises Diverged, naming the last good checkpoint."""
    problem = divergence(m, loss_spike=self.loss_spike, lowest_loss=self.lowest_loss)
    if problem is None:
      self._checked = step
      loss = float(m["loss"])
      self.lowest_loss = loss if self.lowest_loss is None else min(self.lowest_loss, loss)
      return
    self.ckpt.wait()  # a save still being written is the last good one once it is confirmed
    good = self.ckpt.last_good
    lr, clip = float(self.optim.learning_rate), float(self.optim.get("grad_clip", 0.0) or 0.0)
    advice = f"a lower --config.optim.learning_rate (now {lr:g})"
    if clip <= 0:
      advice += " and gradient clipping, e.g. --config.optim.grad_clip=1.0 (now off)"
    where = (f"the last good checkpoint is step {good} in {self.ckpt.directory}: rerun with {advice} to resume from "
             f"step {good}" if good is not None else
             f"no checkpoint was kept: rerun with {advice} to start again")
    what = (f"non-finite loss/grad at step {step} or in the state it produced" if problem.startswith("non-finite")
            else f"training diverged at step {step}")
    raise Diverged(f"{what} ({problem}, loss={m.get('loss')}); stopping without saving this state: {where}")

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
    self.ckpt.poll()  # a background save that failed stops the run here, one step after it failed
    self._metrics = metrics
    if self._tracing and (step == self.profile[1] or step == self.steps):
      self._stop_trace(metrics)
    self.tok_last += self.tokens_per_step
    is_log = step % self.log_every == 0 or step == self.steps or step == self.start + 1
    saving = self.ckpt.every > 0 and step % self.ckpt.every == 0
    if is_log or saving:
      m = jax.device_get(metrics)
      if is_log:  # the diverged step's row too: it shows what blew up
        self._log(step, m)
      self.check(step, m)
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

  def close(self, *, failed: bool = False) -> None:
    """Waits for the last save (its failure is raised, unless the run is already failing: then it is one line)."""
    if self._tracing:  # the loop stopped inside the profiled steps (SIGTERM, Ctrl-C, an error)
      jax.profiler.stop_trace()
      self._tracing = False
    self.progress.close()
    self.writer.close()
    try:
      self.ckpt.close()
    except ckpt_lib.CheckpointError as e:
      if not failed:
        raise
      self.progress.message(f"also: {e}")
