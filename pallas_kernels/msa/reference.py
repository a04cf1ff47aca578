"""Pure-jnp definitions of the MSA ops: the oracle the scalable implementations are tested against.

Everything is materialised at full size ([B, H, T, S] scores and masks) so that each line reads as the math in
DESIGN.md §2. Only for small sizes.

Visibility (`_visible`): query t, at slot pos = q_offset + t, sees key j iff j <= pos and, with packed sequences,
segment_ids[b, j] == segment_ids[b, pos]. q_offset is a static int or a traced int32 scalar (see _common).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.msa._common import query_segments, resolve_q_offset, split_q_offset


def _visible(T: int, S: int, q_offset, segment_ids: jax.Array | None) -> jax.Array:
  """bool [B or 1, T, S]: key j is visible to query t (causal, and in the query's segment when segments are given)."""
  causal = (jnp.arange(S)[None, :] <= (q_offset + jnp.arange(T))[:, None])[None]  # [1, T, S]
  if segment_ids is None:
    return causal
  q_seg = query_segments(segment_ids, q_offset, T)  # [B, T]
  return causal & (q_seg[:, :, None] == segment_ids[:, None, :])  # [B, T, S]


def _selected_tokens(block_idx: jax.Array, S: int, block_size: int) -> jax.Array:
  """bool [B, Hkv, T, S]: key j lies in one of the selected blocks. -1 and out-of-range ids select nothing."""
  num_blocks = -(-S // block_size)
  chosen = (block_idx[..., None] == jnp.arange(num_blocks)).any(-2)  # [B, Hkv, T, num_blocks]
  return jnp.repeat(chosen, block_size, axis=-1)[..., :S]  # [B, Hkv, T, S]


def _masked_softmax(s: jax.Array, mask: jax.Array) -> jax.Array:
  """Softmax over the last axis restricted to `mask`; an all-masked row gives all zeros."""
  s = jnp.where(mask, s, -jnp.inf)
  m = jax.lax.stop_gradient(s.max(-1, keepdims=True))
  m = jnp.where(jnp.isfinite(m), m, 0.0)  # all-masked row: keep exp() at exp(-inf) = 0 instead of nan
  p = jnp.exp(s - m)
  total = p.sum(-1, keepdims=True)
  return p / jnp.where(total > 0, total, 1.0)


def _masked_log_softmax(s: jax.Array, mask: jax.Array) -> jax.Array:
  """log softmax over the last axis restricted to `mask`; 0 outside the mask."""
  s = jnp.where(mask, s, -jnp.inf)
  m = jax.lax.stop_gradient(s.max(-1, keepdims=True))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  total = jnp.exp(s - m).sum(-1, keepdims=True)
  lse = m + jnp.log(jnp.where(total > 0, total, 1.0))
  return jnp.where(mask, s - lse, 0.0)


def select_blocks(q_idx, k_idx, *, block_size: int, topk: int, local_blocks: int = 1, q_offset=None,
                  segment_ids=None) -> jax.Array:
  """int32 [B, Hkv, T, min(topk, num_blocks)]; see api.select_blocks for the contract."""
  static_offset, dyn_offset = split_q_offset(q_offset)
  return _select_blocks(q_idx, k_idx, dyn_offset, segment_ids, block_size=block_size, topk=topk,
                        local_blocks=local_blocks, static_offset=static_offset)


@functools.partial(jax.jit, static_argnames=("block_size", "topk", "local_blocks", "static_offset"))
def _select_blocks(q_idx, k_idx, dyn_offset, segment_ids, *, block_size, topk, local_blocks, static_offset):
  B, T, Hkv, _ = q_idx.shape
  S = k_idx.shape[1]
  q_offset = resolve_q_offset(static_offset, dyn_offset, T, S)
  num_blocks = -(-S // block_size)
  slots = min(topk, num_blocks)

  s = jnp.einsum("bthi,bsi->bhts", q_idx.astype(jnp.float32), k_idx.astype(jnp.float32))  # [B, Hkv, T, S]
  s = jnp.where(_visible(T, S, q_offset, segment_ids)[:, None], s, -jnp.inf)
  s = jnp.pad(s, ((0, 0), (0, 0), (0, 0), (0, num_blocks * block_size - S)), constant_values=-jnp.inf)
  block_score = s.reshape(B, Hkv, T, num_blocks, block_size).max(-1)  # [B, Hkv, T, num_blocks]

  q_block = (q_offset + jnp.arange(T)) // block_size  # [T]
  distance = q_block[:, None] - jnp.arange(num_blocks)[None, :]  # [T, num_blocks]: 0 = own block, 1 = previous
  # Local blocks are kept whatever their score: with segments an older local block may hold only another
  # document's keys (score -inf); it is still selected (HF forces local blocks), and the attention mask makes it
  # contribute nothing.
  is_local = (distance >= 0) & (distance < local_blocks)
  visible = block_score > -jnp.inf
  # Sort blocks by (class, key): class 0 = local (key: distance), 1 = other visible (key: -score), 2 = invisible.
  klass = jnp.where(is_local, 0, jnp.where(visible, 1, 2))
  klass = jnp.broadcast_to(klass, block_score.shape)
  key = jnp.where(is_local, distance.astype(jnp.float32), jnp.where(visible, -block_score, 0.0))
  order = jnp.lexsort((key, klass), axis=-1)[..., :slots]  # [B, Hkv, T, slots]
  picked_class = jnp.take_along_axis(klass, order, axis=-1)
  return jnp.where(picked_class < 2, order, -1).astype(jnp.int32)


def sparse_attention(q, k, v, block_idx, *, block_size: int, scale: float | None = None, q_offset=None,
                     segment_ids=None) -> jax.Array:
  """[B, T, Hq, D]; see api.sparse_attention for the contract."""
  static_offset, dyn_offset = split_q_offset(q_offset)
  return _sparse_attention(q, k, v, block_idx, dyn_offset, segment_ids, block_size=block_size, scale=scale,
                           static_offset=static_offset)


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "static_offset"))
def _sparse_attention(q, k, v, block_idx, dyn_offset, segment_ids, *, block_size, scale, static_offset):
  B, T, Hq, D = q.shape
  S, Hkv = k.shape[1], k.shape[2]
  G = Hq // Hkv
  q_offset = resolve_q_offset(static_offset, dyn_offset, T, S)
  scale = D ** -0.5 if scale is None else scale
  acc = jnp.promote_types(q.dtype, jnp.float32)

  allowed = _selected_tokens(block_idx, S, block_size) & _visible(T, S, q_offset, segment_ids)[:, None]
  allowed = jnp.repeat(allowed, G, axis=1)  # [B, Hq, T, S]: head h uses group h // G
  k = jnp.repeat(k, G, axis=2).astype(acc)  # [B, S, Hq, D]
  v = jnp.repeat(v, G, axis=2).astype(acc)  # [B, S, Hq, D]
  s = jnp.einsum("bthd,bshd->bhts", q.astype(acc), k) * scale  # [B, Hq, T, S]
  p = _masked_softmax(s, allowed)
  return jnp.einsum("bhts,bshd->bthd", p, v).astype(q.dtype)  # [B, T, Hq, D]


def kl_loss(q, k, q_idx, k_idx, block_idx, *, block_size: int, scale: float | None = None,
            index_scale: float | None = None, q_offset=None, segment_ids=None) -> jax.Array:
  """f32 scalar; see api.kl_loss for the contract. block_idx=None: dense support (all visible keys)."""
  static_offset, dyn_offset = split_q_offset(q_offset)
  return _kl_loss(q, k, q_idx, k_idx, block_idx, dyn_offset, segment_ids, block_size=block_size, scale=scale,
                  index_scale=index_scale, static_offset=static_offset)


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "index_scale", "static_offset"))
def _kl_loss(q, k, q_idx, k_idx, block_idx, dyn_offset, segment_ids, *, block_size, scale, index_scale,
             static_offset):
  B, T, Hq, D = q.shape
  S, Hkv = k.shape[1], k.shape[2]
  G = Hq // Hkv
  d_idx = q_idx.shape[-1]
  q_offset = resolve_q_offset(static_offset, dyn_offset, T, S)
  scale = D ** -0.5 if scale is None else scale
  index_scale = d_idx ** -0.5 if index_scale is None else index_scale

  support = jnp.broadcast_to(_visible(T, S, q_offset, segment_ids)[:, None], (B, Hkv, T, S))
  if block_idx is not None:
    support = support & _selected_tokens(block_idx, S, block_size)  # [B, Hkv, T, S]

  q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
  s = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), jnp.repeat(k, G, axis=2).astype(jnp.float32)) * scale
  p_heads = _masked_softmax(s, jnp.repeat(support, G, axis=1))  # [B, Hq, T, S]
  teacher = jax.lax.stop_gradient(p_heads.reshape(B, Hkv, G, T, S).mean(2))  # [B, Hkv, T, S]

  z = jnp.einsum("bthi,bsi->bhts", q_idx.astype(jnp.float32), k_idx.astype(jnp.float32)) * index_scale
  log_student = _masked_log_softmax(z, support)  # [B, Hkv, T, S]
  positive = teacher > 0
  log_teacher = jnp.log(jnp.where(positive, teacher, 1.0))
  kl = jnp.where(positive, teacher * (log_teacher - log_student), 0.0)
  return kl.sum() / (B * T * Hkv)
