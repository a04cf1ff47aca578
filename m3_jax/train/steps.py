"""The pure train and eval steps (jitted by the trainer with explicit shardings and donated state), and
`to_global`, which makes a host batch their global input."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from m3_jax.core import context, sharding
from m3_jax.core.batch import TEXT_KEYS, VISUAL_KEYS
from m3_jax.train.state import TrainState


def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Per-position next-token NLL [B, T] (f32) of logits [B, T, V] f32 and targets [B, T]."""
  logz = jax.nn.logsumexp(logits, axis=-1)
  gold = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return logz - gold


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Mean next-token NLL over masked positions. logits [B, T, V] f32; targets, mask [B, T]. Returns (mean, count)."""
  mask = mask.astype(jnp.float32)
  count = jnp.sum(mask)
  return jnp.sum(token_nll(logits, targets) * mask) / jnp.maximum(count, 1.0), count


def forward(graphdef, params, rest, batch, *, step=None, capture_attention=False, head=True):
  """(logits, aux) of the TextModel or VLModel in graphdef; a VL batch also passes its pixels (absent modalities
  stay absent, so a text-only batch runs a VL model on text alone). head=False: (hidden [B, T, d], aux)."""
  model = nnx.merge(graphdef, params, rest)
  step_state = None if step is None else {"step": step}
  visual = {k: batch[k] for k in VISUAL_KEYS if k in batch}
  return model(batch["inputs"], batch["positions"], batch["segment_ids"], loss_mask=batch["loss_mask"],
               step_state=step_state, capture_attention=capture_attention, head=head, **visual)


def chunked_token_stats(head_logits: Callable, hidden: jax.Array, targets: jax.Array,
                        chunk: int) -> tuple[jax.Array, jax.Array]:
  """Per-position NLL and argmax hit, both [B, T] f32, from hidden [B, T, d] `chunk` positions (of every row) at a
  time.

  The full logits are [B, T, V] f32 (at 1M tokens and V = 8192: 32 GiB, and as much again for their gradient);
  here one chunk's logits exist at a time, and under jax.checkpoint the backward recomputes them per chunk (one
  extra [chunk, d] x [d, V] matmul per chunk) instead of keeping them.
  """
  b, t, d = hidden.shape
  if t % chunk:
    raise ValueError(f"train.loss_chunk={chunk} must divide the sequence length {t}")
  n = t // chunk
  xs = (jnp.moveaxis(hidden.reshape(b, n, chunk, d), 1, 0), jnp.moveaxis(targets.reshape(b, n, chunk), 1, 0))

  @jax.checkpoint
  def one(args):
    h, tg = args  # [B, c, d], [B, c]
    logits = head_logits(h)  # [B, c, V] f32
    return token_nll(logits, tg), (jnp.argmax(logits, axis=-1) == tg).astype(jnp.float32)

  nll, hit = jax.lax.map(one, xs)  # [n, B, c] each
  return jnp.moveaxis(nll, 0, 1).reshape(b, t), jnp.moveaxis(hit, 0, 1).reshape(b, t)


def _token_stats(graphdef, params, rest, batch, *, step=None, loss_chunk=0):
  """(nll [B, T], hit [B, T], aux): from the full logits, or `loss_chunk` tokens at a time when that divides T
  (the trainer checks it does for training rows; an eval set of another length takes the full logits)."""
  if loss_chunk and batch["inputs"].shape[1] % loss_chunk == 0:
    hidden, aux = forward(graphdef, params, rest, batch, step=step, head=False)
    head = nnx.merge(graphdef, params, rest).head_logits
    nll, hit = chunked_token_stats(head, hidden, batch["targets"], loss_chunk)
    return nll, hit, aux
  logits, aux = forward(graphdef, params, rest, batch, step=step)
  hit = (jnp.argmax(logits, axis=-1) == batch["targets"]).astype(jnp.float32)
  return token_nll(logits, batch["targets"]), hit, aux


def optimizer_step(tx: optax.GradientTransformation, grads, opt_state, params):
  """One optimizer step -> (new params, new optimizer state, the update).

  Each parameter's update is materialised before it is applied: otherwise XLA fuses the update into both the
  update-norm reduction and the in-place write of the (donated) parameter, cannot order the two, and keeps a copy
  of every parameter (24 GiB per device for M3 on 64 devices). One barrier per leaf, so that each update can be
  applied (and freed) before the next is made. Versus the fused form, p + u may round once more (no FMA)."""
  updates, opt_state = tx.update(grads, opt_state, params)
  updates = jax.tree.map(jax.lax.optimization_barrier, updates)
  return optax.apply_updates(params, updates), opt_state, updates


def make_train_step(graphdef, tx: optax.GradientTransformation, schedule: Callable, *, moe_aux_coef: float,
                    kl_weight: float, router_bias_rate: float, loss_chunk: int = 0) -> Callable:
  """(state, batch) -> (state one step on, metrics). The loss is the text cross-entropy + moe_aux_coef x the MoE
  load-balance loss (the model's `router_aux_loss_coef`) + kl_weight x MSA's indexer KL loss. With
  router_bias_rate > 0 (the model's `router_bias_update_rate`) every MoE layer's router bias then takes one
  aux-loss-free balancing step from this step's expert load, inside the compiled step (state.rest).
  loss_chunk > 0 (`train.loss_chunk`) computes the logits and the loss that many tokens at a time (long contexts:
  the [B, T, V] f32 logits are never held whole); the same loss and gradients to f32 rounding."""

  def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    def loss_fn(params):
      if loss_chunk:  # check_fits: it divides train.seq_len
        nll, _, aux = _token_stats(graphdef, params, state.rest, batch, step=state.step, loss_chunk=loss_chunk)
        mask = batch["loss_mask"].astype(jnp.float32)
        count = jnp.sum(mask)
        ce = jnp.sum(nll * mask) / jnp.maximum(count, 1.0)
      else:
        logits, aux = forward(graphdef, params, state.rest, batch, step=state.step)
        ce, count = cross_entropy(logits, batch["targets"], batch["loss_mask"])
      total = ce + moe_aux_coef * aux["moe_aux_loss"] + kl_weight * aux["kl_loss"]
      return total, (ce, count, aux)

    (total, (ce, count, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    params, opt_state, updates = optimizer_step(tx, grads, state.opt_state, state.params)
    metrics = {
        "loss": ce,
        "total_loss": total,
        "moe_aux_loss": aux["moe_aux_loss"],
        "kl_loss": aux["kl_loss"],
        "grad_norm": optax.global_norm(grads),
        # the update and parameters this step produced: the divergence check reads them before anything is saved
        "update_norm": optax.global_norm(updates),
        "param_norm": optax.global_norm(params),
        "lr": schedule(state.step),
        "tokens": count,
        **{f"msa/{k}": v for k, v in aux["metrics"].items()},
    }
    rest = state.rest
    if "expert_load" in aux:
      load = aux["expert_load"]  # [L_moe, E]: share of routed slots per expert
      e = load.shape[-1]
      metrics["moe/max_load"] = jnp.max(load) * e  # over all MoE layers; 1 when balanced
      metrics["moe/min_load"] = jnp.min(load) * e
      model = nnx.merge(graphdef, state.params, state.rest)
      for row, (layer, _) in zip(load, model.moe_layers()):
        mean = jnp.maximum(jnp.mean(row), 1e-30)  # 1/E; 0 only for a batch without a real token
        metrics[f"moe/max_over_mean/layer{layer}"] = jnp.max(row) / mean
        metrics[f"moe/min_over_mean/layer{layer}"] = jnp.min(row) / mean
      if router_bias_rate > 0:
        model.update_router_biases(load, router_bias_rate)
        _, _, rest = nnx.split(model, nnx.Param, ...)
    new_state = state.replace(step=state.step + 1, params=params, rest=rest, opt_state=opt_state)
    return new_state, metrics

  return train_step


def make_eval_step(graphdef, loss_chunk: int = 0) -> Callable:
  """(params, rest, batch) -> sums over the batch: NLL, target tokens and argmax hits (teacher-forced accuracy)
  under loss_mask, and the same three under every extra `NAME_mask` [B, L] of the batch (e.g. the synthetic-video
  eval's direction_mask / object_mask) as `NAME/loss_sum`, `NAME/tokens`, `NAME/correct`."""

  def eval_step(params, rest, batch) -> dict:
    nll, hit, _ = _token_stats(graphdef, params, rest, batch, loss_chunk=loss_chunk)
    out = {}
    for key in sorted(batch):
      if key.endswith("_mask"):
        mask = batch["loss_mask"].astype(jnp.float32)
        if key != "loss_mask":
          mask = mask * batch[key].astype(jnp.float32)
        prefix = "" if key == "loss_mask" else key[:-len("_mask")] + "/"
        out.update({f"{prefix}loss_sum": jnp.sum(nll * mask), f"{prefix}tokens": jnp.sum(mask),
                    f"{prefix}correct": jnp.sum(hit * mask)})
    return out

  return eval_step


def to_global(batch: dict, mesh: jax.sharding.Mesh) -> dict:
  """Host-local numpy batch -> global jax.Arrays sharded over the batch axes (dim 0 of every array; pixels keep
  their other dims whole). Keys outside the batch contract stay on the host, except eval masks (`NAME_mask`).

  With `context` > 1 the [B, T] arrays are reordered to core/context.py's device order first and split along T:
  every step sums over tokens, so losses and gradients are those of the sequence order."""
  sh = sharding.batch_sharding(mesh)
  n = sharding.context_shards(mesh)
  return {k: jax.make_array_from_process_local_data(sh, context.to_device_order(np.asarray(v), n))
          for k, v in batch.items() if k in TEXT_KEYS + VISUAL_KEYS or k.endswith("_mask")}
