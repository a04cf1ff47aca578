"""GQA self-attention of the M3 text tower and the dense attention dispatch (`attention_impl`).

Per-head Gemma RMSNorm on q and k, partial NeoX RoPE, grouped-query attention with causal and segment (packing)
masks. `minimax_m3_sparse` layers reuse this projection path and swap the core for MSA (m3_jax/models/msa.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from m3_jax.models.layers import RMSNorm, apply_rope, param
from m3_jax.core.sharding import constrain


def attention_mask(q_pos: jax.Array, k_pos: jax.Array, q_seg: jax.Array | None, k_seg: jax.Array | None) -> jax.Array:
  """bool [B, 1, T, S]: key j visible to query t iff j is not in t's future and both are in the same segment.

  q_pos/k_pos are slot indices in the (possibly cached) sequence: [T] and [S].
  """
  mask = (k_pos[None, :] <= q_pos[:, None])[None, None]  # [1, 1, T, S]
  if q_seg is not None:
    mask = mask & (q_seg[:, None, :, None] == k_seg[:, None, None, :])
  return mask


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, impl: str = "xla",
                          q_offset: int | None = None, segment_ids: jax.Array | None = None,
                          kv_segment_ids: jax.Array | None = None, return_probs: bool = False):
  """Causal GQA attention. q: [B, T, Hq, D]; k, v: [B, S, Hkv, D]; query t sits at slot q_offset + t
  (default S - T). Returns out [B, T, Hq, D] (and probs [B, Hq, T, S] f32 if return_probs, xla only)."""
  b, t, hq, d = q.shape
  s, hkv = k.shape[1], k.shape[2]
  g = hq // hkv
  # Decoding passes a traced q_offset over a fixed-size cache: that path stays on XLA (cuDNN's causal mode assumes
  # the queries are the last T of S keys).
  use_cudnn = impl == "cudnn" and not return_probs and q_offset is None
  q_offset = s - t if q_offset is None else q_offset
  kv_segment_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
  q_pos = q_offset + jnp.arange(t)
  k_pos = jnp.arange(s)
  if use_cudnn:
    mask = None
    if segment_ids is not None or t != s:
      mask = attention_mask(q_pos, k_pos, segment_ids, kv_segment_ids)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=mask is None, implementation="cudnn")
  if impl not in ("xla", "cudnn"):
    raise ValueError(f"attention impl {impl!r}; expected 'xla' or 'cudnn'")
  qg = q.reshape(b, t, hkv, g, d)  # [B, T, Hkv, G, D]
  scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * (d ** -0.5)
  mask = attention_mask(q_pos, k_pos, segment_ids, kv_segment_ids)[:, :, None]  # [B|1, 1, 1, T, S]
  scores = jnp.where(mask, scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1)  # [B, Hkv, G, T, S]
  out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v).reshape(b, t, hq, d)
  if return_probs:
    return out, probs.reshape(b, hq, t, s)
  return out


@dataclasses.dataclass(frozen=True)
class AttentionDims:
  d_model: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rotary_dim: int
  rope_theta: float
  eps: float

  @classmethod
  def from_config(cls, cfg) -> "AttentionDims":
    """The attention fields of a TextConfig (shared by dense and MSA layers)."""
    return cls(d_model=cfg.hidden_size, num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
               head_dim=cfg.head_dim, rotary_dim=cfg.rotary_dim, rope_theta=cfg.rope_theta, eps=cfg.rms_norm_eps)


class Attention(nnx.Module):
  """Dense GQA attention (`full_attention` layers). Weights are [in, heads, head_dim] for einsum and sharding;
  m3_jax/interop maps them to HF's [out, in] Linear layout."""

  def __init__(self, dims: AttentionDims, *, impl: str, rngs: nnx.Rngs, std: float = 0.02,
               param_dtype=jnp.float32, dtype=jnp.float32, document_mask: bool = True):
    self.dims, self.impl, self.dtype = dims, impl, dtype
    self.document_mask = document_mask
    dm, hq, hkv, hd = dims.d_model, dims.num_heads, dims.num_kv_heads, dims.head_dim
    self.q_proj = param(rngs, (dm, hq, hd), ("embed", "q_heads", "head_dim"), std=std, dtype=param_dtype)
    self.k_proj = param(rngs, (dm, hkv, hd), ("embed", "kv_heads", "head_dim"), std=std, dtype=param_dtype)
    self.v_proj = param(rngs, (dm, hkv, hd), ("embed", "kv_heads", "head_dim"), std=std, dtype=param_dtype)
    self.o_proj = param(rngs, (hq, hd, dm), ("q_heads", "head_dim", "embed"), std=std, dtype=param_dtype)
    self.q_norm = RMSNorm(hd, eps=dims.eps, param_dtype=param_dtype)
    self.k_norm = RMSNorm(hd, eps=dims.eps, param_dtype=param_dtype)

  def project(self, x: jax.Array, positions: jax.Array):
    """x: [B, T, d_model] -> q [B, T, Hq, D], k, v [B, T, Hkv, D] with q/k norm and RoPE applied."""
    dims, dt = self.dims, self.dtype
    q = jnp.einsum("btd,dhk->bthk", x, self.q_proj[...].astype(dt))  # [B, T, Hq, D]
    k = jnp.einsum("btd,dhk->bthk", x, self.k_proj[...].astype(dt))  # [B, T, Hkv, D]
    v = jnp.einsum("btd,dhk->bthk", x, self.v_proj[...].astype(dt))  # [B, T, Hkv, D]
    q = apply_rope(self.q_norm(q), positions, rotary_dim=dims.rotary_dim, theta=dims.rope_theta)
    k = apply_rope(self.k_norm(k), positions, rotary_dim=dims.rotary_dim, theta=dims.rope_theta)
    q = constrain(q, ("activation_batch", "activation_length", "activation_heads", None))
    k = constrain(k, ("activation_batch", "activation_length", "activation_kv_heads", None))
    v = constrain(v, ("activation_batch", "activation_length", "activation_kv_heads", None))
    return q, k, v

  def output(self, o: jax.Array) -> jax.Array:
    """o: [B, T, Hq, D] -> [B, T, d_model]."""
    return jnp.einsum("bthk,hkd->btd", o, self.o_proj[...].astype(self.dtype))

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None, *,
               cache: Any = None, capture: bool = False, step_state: Any = None):
    """x: [B, T, d_model]; positions: [B, T] (RoPE positions, restarting per packed document).
    step_state (the training step, read by MSA's warmup) is unused by dense attention.
    Returns (y [B, T, d_model], aux dict)."""
    del step_state
    q, k, v = self.project(x, positions)
    aux = {}
    q_offset = None
    if not self.document_mask:
      segment_ids = None
    if cache is not None:  # decoding: attend over the whole buffer; unwritten slots lie in every query's future
      q_offset = cache.length
      cache = cache.update(k, v)
      k, v, aux["cache"] = cache.k, cache.v, cache
      segment_ids = None  # generation is one sequence per row
    res = dot_product_attention(q, k, v, impl=self.impl, q_offset=q_offset, segment_ids=segment_ids,
                                return_probs=capture)
    if capture:
      res, aux["attention_probs"] = res
    return self.output(res), aux
