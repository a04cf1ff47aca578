"""M3 mixture-of-experts block: sigmoid router with a choice-only bias, top-k renormalised weights times
`routed_scaling_factor`, SwiGLU-OAI experts, one always-on shared expert.

Two expert implementations compute the same function: `ragged` (tokens sorted by expert, grouped matmuls from
`pallas_kernels.grouped_matmul` per `grouped_matmul_impl`: XLA's ragged_dot, or `tiled` / `mosaic` (Hopper),
whose memory does not grow with the number of experts as XLA's does on CPU and in its GPU backward; dropless, no
capacity factor, FLOPs of the chosen experts only) and `dense` (every expert on every token, weighted by the
sparse combine matrix: simple, used as a reference in tests). A third, `capacity`, drops assignments past a
per-expert capacity: fixed [E, C, d] buffers, plain batched matmuls that shard over `expert`, a bounded
footprint, but not HF's function.
A fourth, `expert_parallel` (models/moe_parallel.py), is `ragged`'s function with the experts split over the
`expert` mesh axis and the token slots exchanged by all-to-all; without an `expert` axis it is `ragged`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from m3_jax.models import moe_parallel
from m3_jax.models.layers import DenseMLP, param, swiglu_oai
from m3_jax.core.sharding import constrain


class RouterBias(nnx.Variable):
  """`e_score_correction_bias`: shifts which experts are chosen, never the combine weights; not trained by SGD
  (the train step moves it by `balance_bias_step` when `router_bias_update_rate` > 0)."""


@dataclasses.dataclass(frozen=True)
class MoEDims:
  d_model: int
  num_experts: int
  top_k: int
  intermediate: int
  shared_intermediate: int
  routed_scaling_factor: float
  alpha: float
  limit: float
  capacity_factor: float = 1.25
  matmul_impl: str = "xla"  # pallas_kernels.grouped_matmul implementation of the dropless paths
  chunk_tokens: int = 0  # expert_parallel: exchange each device's tokens this many at a time (0: all at once)

  @classmethod
  def from_config(cls, cfg) -> "MoEDims":
    """The MoE fields of a TextConfig."""
    return cls(d_model=cfg.hidden_size, num_experts=cfg.num_local_experts, top_k=cfg.num_experts_per_tok,
               intermediate=cfg.intermediate_size, shared_intermediate=cfg.shared_intermediate_size,
               routed_scaling_factor=cfg.routed_scaling_factor, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit,
               capacity_factor=cfg.capacity_factor, matmul_impl=cfg.grouped_matmul_impl,
               chunk_tokens=cfg.moe_chunk_tokens)


def route(logits: jax.Array, bias: jax.Array, top_k: int, scaling: float):
  """logits: [N, E] f32 -> (weights [N, k] f32, expert ids [N, k] int32, sigmoid scores [N, E])."""
  scores = jax.nn.sigmoid(logits)
  _, idx = jax.lax.top_k(scores + bias[None, :], top_k)  # the bias only picks
  w = jnp.take_along_axis(scores, idx, axis=-1)
  w = w / jnp.sum(w, axis=-1, keepdims=True) * scaling
  return w, idx.astype(jnp.int32), scores


def load_balance_loss(scores: jax.Array, idx: jax.Array, num_experts: int, mask: jax.Array | None):
  """Switch-style balance loss adapted to sigmoid scores: E * sum_e f_e * p_e, where f_e is the share of routed
  slots that went to e and p_e the mean normalised score of e. Equals 1 when routing is uniform.

  scores: [N, E]; idx: [N, k]; mask: [N] (1 for real tokens). Returns (loss, f [E]).
  """
  n, k = idx.shape
  m = jnp.ones((n,), jnp.float32) if mask is None else mask.astype(jnp.float32)
  counts = jnp.einsum("nke,n->e", jax.nn.one_hot(idx, num_experts, dtype=jnp.float32), m)  # a sum: no atomics
  denom = jnp.maximum(jnp.sum(m), 1.0)
  f = counts / (denom * k)
  p = jnp.sum(scores / jnp.sum(scores, axis=-1, keepdims=True) * m[:, None], axis=0) / denom
  return num_experts * jnp.sum(f * p), f


def balance_bias_step(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
  """Aux-loss-free load balancing (DeepSeek-V3 sec. 2.1.2, MiniMax-M3): one sign step of the router bias toward
  equal load. An expert over the mean load is made less likely to be chosen, one under it more, each by `rate`
  whatever the size of its error (one odd batch moves the bias by no more than that); the combine weights never
  see the bias, so balancing does not bend what the model computes from the experts it chose.

  bias: [E] f32 (`e_score_correction_bias`); load: [E] share of routed slots per expert. Returns the new bias [E].
  """
  if bias.shape != load.shape or bias.ndim != 1:
    raise ValueError(f"balance_bias_step: bias {bias.shape} and load {load.shape} must both be [num_experts]")
  return bias + rate * jnp.sign(jnp.mean(load) - load).astype(bias.dtype)


class MoE(nnx.Module):

  def __init__(self, dims: MoEDims, *, impl: str, rngs: nnx.Rngs, std: float = 0.02, param_dtype=jnp.float32,
               dtype=jnp.float32):
    self.dims, self.impl, self.dtype = dims, impl, dtype
    e, dm, i = dims.num_experts, dims.d_model, dims.intermediate
    self.router = param(rngs, (dm, e), ("embed", None), std=std, dtype=jnp.float32)
    self.e_score_correction_bias = RouterBias(jnp.zeros((e,), jnp.float32), logical_axes=(None,))
    self.gate_up = param(rngs, (e, dm, 2, i), ("exp", "embed", None, "mlp"), std=std, dtype=param_dtype)
    self.down = param(rngs, (e, i, dm), ("exp", "mlp", "embed"), std=std, dtype=param_dtype)
    self.shared = DenseMLP(dm, dims.shared_intermediate, alpha=dims.alpha, limit=dims.limit, rngs=rngs, std=std,
                           param_dtype=param_dtype, dtype=dtype)

  def update_bias(self, load: jax.Array, rate: float) -> None:
    """One aux-loss-free balancing step of `e_score_correction_bias` from this layer's load [E] (in place). The
    MoE of a scanned stack (models/transformer.py LayerStack) holds one bias row per layer: load [L, E]."""
    bias = self.e_score_correction_bias[...]
    if bias.ndim == 2 and load.shape == bias.shape:
      self.e_score_correction_bias[...] = jax.vmap(balance_bias_step, in_axes=(0, 0, None))(bias, load, rate)
    else:
      self.e_score_correction_bias[...] = balance_bias_step(bias, load, rate)

  def _experts_ragged(self, x: jax.Array, w: jax.Array, idx: jax.Array) -> jax.Array:
    """x: [N, d]; w, idx: [N, k] -> [N, d] f32. Dispatch and combine are gathers both ways (gather_slots), in the
    grouped matmul's own product dtype (moe_parallel.product_dtype: bf16 slots from the Hopper kernels)."""
    n, k = idx.shape
    order, inverse, group_sizes = moe_parallel.sort_slots(idx, self.dims.num_experts)
    y = moe_parallel.grouped_swiglu(moe_parallel.gather_slots(x, order, inverse, k), group_sizes,
                                    self.gate_up[...].astype(self.dtype), self.down[...].astype(self.dtype),
                                    alpha=self.dims.alpha, limit=self.dims.limit,
                                    matmul_impl=self.dims.matmul_impl)  # [N k, d], sorted by expert
    y = moe_parallel.gather_slots(y, inverse, order, 1).reshape(n, k, -1)  # [N, k, d]: each token's slots
    return moe_parallel.combine_slots(y, w)  # [N, d] f32

  def _experts_expert_parallel(self, x: jax.Array, w: jax.Array, idx: jax.Array) -> jax.Array:
    """x: [N, d]; w, idx: [N, k] -> [N, d] f32."""
    if moe_parallel.expert_shards() == 1:  # no expert axis to split over: the same function on this device
      return self._experts_ragged(x, w, idx)
    return moe_parallel.experts_all_to_all(x, w, idx, self.gate_up[...].astype(self.dtype),
                                           self.down[...].astype(self.dtype), alpha=self.dims.alpha,
                                           limit=self.dims.limit, matmul_impl=self.dims.matmul_impl,
                                           chunk_tokens=self.dims.chunk_tokens)

  def _experts_dense(self, x: jax.Array, w: jax.Array, idx: jax.Array) -> jax.Array:
    e = self.dims.num_experts
    combine = jnp.sum(jax.nn.one_hot(idx, e, dtype=jnp.float32) * w[..., None], axis=1)  # [N, E]
    gu = jnp.einsum("nd,edgi->negi", x, self.gate_up[...].astype(self.dtype), preferred_element_type=jnp.float32)
    h = swiglu_oai(gu[:, :, 0], gu[:, :, 1], alpha=self.dims.alpha, limit=self.dims.limit)  # [N, E, I]
    y = jnp.einsum("nei,eid->ned", h.astype(self.dtype), self.down[...].astype(self.dtype),
                   preferred_element_type=jnp.float32)
    return jnp.einsum("ned,ne->nd", y, combine)

  def _experts_capacity(self, x: jax.Array, w: jax.Array, idx: jax.Array) -> jax.Array:
    """x: [N, d]; w, idx: [N, k] -> [N, d]. Earlier tokens win a full expert's slots."""
    n, k = idx.shape
    e, dm = self.dims.num_experts, self.dims.d_model
    cap = max(1, int(-(-self.dims.capacity_factor * n * k // e)))
    flat = idx.reshape(-1)  # [N*k]
    onehot = jax.nn.one_hot(flat, e, dtype=jnp.int32)  # [N*k, E]
    slot = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)  # rank of the assignment in its expert
    keep = slot < cap
    slot = jnp.where(keep, slot, cap)  # out of range: dropped by mode="drop" below
    buf = jnp.zeros((e, cap, dm), x.dtype).at[flat, slot].set(jnp.repeat(x, k, axis=0), mode="drop")  # [E, C, d]
    buf = constrain(buf, ("activation_exp", None, "activation_embed"))
    gu = jnp.einsum("ecd,edgi->ecgi", buf, self.gate_up[...].astype(self.dtype), preferred_element_type=jnp.float32)
    h = swiglu_oai(gu[:, :, 0], gu[:, :, 1], alpha=self.dims.alpha, limit=self.dims.limit).astype(self.dtype)
    y = jnp.einsum("eci,eid->ecd", h, self.down[...].astype(self.dtype), preferred_element_type=jnp.float32)
    got = y.at[flat, slot].get(mode="fill", fill_value=0.0)  # [N*k, d]; dropped -> 0
    got = got.reshape(n, k, dm) * (w * keep.reshape(n, k))[..., None]  # [N, k, d]
    return jnp.sum(got, axis=1)

  def __call__(self, x: jax.Array, mask: jax.Array | None = None):
    """x: [B, T, d]; mask: [B, T] real-token mask for the balance statistics. Returns (y [B, T, d], aux)."""
    b, t, dm = x.shape
    xf = x.reshape(b * t, dm)  # [N, d]
    logits = jnp.einsum("nd,de->ne", xf.astype(jnp.float32), self.router[...])
    w, idx, scores = route(logits, self.e_score_correction_bias[...], self.dims.top_k,
                           self.dims.routed_scaling_factor)
    experts = {"ragged": self._experts_ragged, "dense": self._experts_dense, "capacity": self._experts_capacity,
               "expert_parallel": self._experts_expert_parallel}[self.impl]
    y = experts(xf, w, idx).astype(x.dtype).reshape(b, t, dm)
    y = constrain(y, ("activation_batch", "activation_length", "activation_embed"))
    y = y + self.shared(x)
    loss, load = load_balance_loss(scores, idx, self.dims.num_experts,
                                   None if mask is None else mask.reshape(-1))
    return y, {"moe_aux_loss": loss, "expert_load": load}
