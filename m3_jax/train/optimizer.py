"""AdamW with warmup-cosine or warmup-stable-decay (WSD) schedules, global-norm clipping, a weight-decay mask."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from m3_jax.models.transformer import LAYER_AXIS

SCHEDULES = ("cosine", "wsd", "constant")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  learning_rate: float = 3e-3
  schedule: str = "cosine"
  warmup_steps: int = 100
  total_steps: int = 1000
  # WSD: the last `decay_fraction` of the steps decay linearly (or 1-sqrt) to min_lr_ratio * lr.
  decay_fraction: float = 0.2
  decay_shape: str = "linear"
  min_lr_ratio: float = 0.1
  # From step lr_scale_from on, the schedule's LR times lr_scale (a CPT phase re-tuning its LR); 1.0: unchanged.
  lr_scale: float = 1.0
  lr_scale_from: int = 0
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  grad_clip: float = 1.0

  def __post_init__(self):
    if self.schedule not in SCHEDULES:
      raise ValueError(f"optim.schedule={self.schedule!r}; expected one of {SCHEDULES}")
    if self.decay_shape not in ("linear", "sqrt"):
      raise ValueError(f"optim.decay_shape={self.decay_shape!r}; expected 'linear' or 'sqrt'")
    if not 0 <= self.warmup_steps <= self.total_steps:
      raise ValueError(f"optim.warmup_steps={self.warmup_steps} must be in [0, total_steps={self.total_steps}]")
    if not 0.0 <= self.decay_fraction <= 1.0:
      raise ValueError(f"optim.decay_fraction={self.decay_fraction} must be in [0, 1]")
    if not self.lr_scale > 0.0:
      raise ValueError(f"optim.lr_scale={self.lr_scale} must be > 0")
    if not (isinstance(self.lr_scale_from, int) and self.lr_scale_from >= 0):
      raise ValueError(f"optim.lr_scale_from={self.lr_scale_from!r} must be an int >= 0")


def wsd_decay_start(cfg: OptimConfig) -> int:
  """First step of the WSD decay phase (the CPT experiments add vision here)."""
  return max(cfg.warmup_steps, cfg.total_steps - int(round(cfg.decay_fraction * cfg.total_steps)))


def make_schedule(cfg: OptimConfig) -> optax.Schedule:
  base = _base_schedule(cfg)
  if cfg.lr_scale == 1.0:
    return base  # the very same function: runs without a rescale share one compiled step
  scale, start = float(cfg.lr_scale), int(cfg.lr_scale_from)

  def rescaled(step):
    return base(step) * jnp.where(jnp.asarray(step) >= start, scale, 1.0)

  return rescaled


def _base_schedule(cfg: OptimConfig) -> optax.Schedule:
  lr, floor = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio
  warm = max(cfg.warmup_steps, 1)
  if cfg.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, lr, warm, max(cfg.total_steps, warm + 1), end_value=floor)
  if cfg.schedule == "constant":
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warm), optax.constant_schedule(lr)], [warm])
  start = wsd_decay_start(cfg)
  length = max(cfg.total_steps - start, 1)

  def wsd(step):
    step = jnp.asarray(step, jnp.float32)
    warmup = lr * jnp.minimum(step / warm, 1.0)
    frac = jnp.clip((step - start) / length, 0.0, 1.0)
    shape = frac if cfg.decay_shape == "linear" else 1.0 - jnp.sqrt(1.0 - frac)
    decayed = lr - (lr - floor) * shape
    return jnp.where(step < start, warmup, decayed)

  return wsd


def decay_mask(params):
  """Decay matrices only; norms' scales and the router bias (not a Param) are left alone. The leading layer axis of
  a scanned stack (TextConfig.scan_layers) is no matrix dim: a stack's norm scales [L, d] are not decayed either."""

  def is_matrix(x) -> bool:
    if not isinstance(x, nnx.Variable):
      return x.ndim >= 2
    axes = x.get_metadata().get("logical_axes") or ()
    return x.get_value().ndim - (1 if axes[:1] == (LAYER_AXIS,) else 0) >= 2

  return jax.tree.map(is_matrix, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_optimizer(cfg: OptimConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
  schedule = make_schedule(cfg)
  tx = optax.chain(
      optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip > 0 else optax.identity(),
      optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask),
  )
  return tx, schedule
