"""The pure train and eval steps (jitted by the trainer with explicit shardings and donated state)."""

from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer steps taken
  params: Any  # nnx.State of nnx.Param
  rest: Any  # nnx.State of every other variable (router correction bias, ...); not touched by the optimizer
  opt_state: Any
  rng: jax.Array  # for stochastic parts (none in the default models); saved so a resume is exact


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Mean next-token NLL over masked positions. logits [B, T, V] f32; targets, mask [B, T]. Returns (mean, count)."""
  logz = jax.nn.logsumexp(logits, axis=-1)
  gold = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  mask = mask.astype(jnp.float32)
  count = jnp.sum(mask)
  return jnp.sum((logz - gold) * mask) / jnp.maximum(count, 1.0), count


def forward(graphdef, params, rest, batch, *, step=None, capture_attention=False):
  model = nnx.merge(graphdef, params, rest)
  step_state = None if step is None else {"step": step}
  return model(batch["inputs"], batch["positions"], batch["segment_ids"], loss_mask=batch["loss_mask"],
               step_state=step_state, capture_attention=capture_attention)


def make_train_step(graphdef, tx: optax.GradientTransformation, schedule: Callable, *, moe_aux_coef: float,
                    kl_weight: float) -> Callable:

  def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    def loss_fn(params):
      logits, aux = forward(graphdef, params, state.rest, batch, step=state.step)
      ce, count = cross_entropy(logits, batch["targets"], batch["loss_mask"])
      total = ce + moe_aux_coef * aux["moe_aux_loss"] + kl_weight * aux["kl_loss"]
      return total, (ce, count, aux)

    (total, (ce, count, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {
        "loss": ce,
        "total_loss": total,
        "moe_aux_loss": aux["moe_aux_loss"],
        "kl_loss": aux["kl_loss"],
        "grad_norm": optax.global_norm(grads),
        "param_norm": optax.global_norm(params),
        "lr": schedule(state.step),
        "tokens": count,
        **{f"msa/{k}": v for k, v in aux["metrics"].items()},
    }
    if "expert_load" in aux:
      load = aux["expert_load"]  # [L_moe, E]: share of routed slots per expert, 1/E when balanced
      metrics["moe/max_load"] = jnp.max(load) * load.shape[-1]
      metrics["moe/min_load"] = jnp.min(load) * load.shape[-1]
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    return new_state, metrics

  return train_step


def make_eval_step(graphdef) -> Callable:

  def eval_step(params, rest, batch) -> dict:
    logits, _ = forward(graphdef, params, rest, batch)
    ce, count = cross_entropy(logits, batch["targets"], batch["loss_mask"])
    return {"loss_sum": ce * count, "tokens": count}

  return eval_step
