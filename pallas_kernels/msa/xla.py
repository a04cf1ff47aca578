"""Scalable XLA implementation of the MSA ops (CPU, GPU, TPU).

Nothing here materialises a T x S array for the sparse ops. Queries are processed in chunks of `tc` rows under
`lax.map`; each chunk gathers its selected KV blocks, `[B, Hkv, tc, topk * block_size, D]`, and the chunk body is
wrapped in `jax.checkpoint` so that the backward pass recomputes the gather and the probabilities chunk by chunk
instead of keeping them for all T queries: memory stays O(tc * topk * block_size) on top of the inputs and their
gradients. The chunk size comes from a per-chunk memory budget; `query_chunk` overrides it (tests use it to exercise
several chunks and query padding at small sizes).

Key padding: K/V (and k_idx) are zero-padded to a whole number of blocks. A pad key sits at position >= S, and every
query's position is < S, so the causal test `key_pos <= query_pos` already excludes it (whatever its segment id).

Packed sequences: with `segment_ids [B, S]`, a key is visible only to the queries of its segment. The segment ids
are blocked and gathered exactly like the keys, so a chunk only ever holds `[B, Hkv, tc, topk * block_size]` of them.

q_offset: each public function splits it (see _common) into a static int, which keeps today's compiled code, or a
dynamic int32 scalar, which is an ordinary jit argument so one compilation serves a whole decode loop. All index
arithmetic below (`starts`, `pos`, the query segments) is written to accept either.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._carry import carried_zero
from pallas_kernels.msa._common import cdiv, query_segments, resolve_q_offset, split_q_offset, usable_slots

# Working set one query chunk may use. Big enough to amortise the per-iteration overhead of lax.map on CPU, small
# enough that forward + backward of one chunk fits beside the model on a GPU.
_CHUNK_BYTES = 256 * 2**20
_MAX_CHUNK = 512


def _chunking(T: int, bytes_per_query: int, query_chunk: int | None) -> tuple[int, int]:
  """(rows per chunk, number of chunks); rows are balanced so the padding is < one row per chunk."""
  cap = query_chunk if query_chunk is not None else max(1, min(_MAX_CHUNK, _CHUNK_BYTES // max(1, bytes_per_query)))
  n = cdiv(T, cap)
  return cdiv(T, n), n


def _chunk_rows(x: jax.Array, axis: int, tc: int, n: int, fill=0) -> jax.Array:
  """Pads the query axis of x to n * tc rows and moves a new chunk axis of size n to the front."""
  T = x.shape[axis]
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, n * tc - T)
  x = jnp.pad(x, pad, constant_values=fill)
  x = x.reshape(x.shape[:axis] + (n, tc) + x.shape[axis + 1:])
  return jnp.moveaxis(x, axis, 0)


def _unchunk_rows(x: jax.Array, axis: int, T: int) -> jax.Array:
  """Inverse of _chunk_rows: [n, ...] with the chunk-local query axis at `axis` of each chunk -> T rows there."""
  x = jnp.moveaxis(x, 0, axis)  # [..., n, tc, ...]
  x = x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])
  return jax.lax.slice_in_dim(x, 0, T, axis=axis)


def _to_blocks(x: jax.Array, block_size: int) -> jax.Array:
  """[B, S, H, D] -> [B, H, num_blocks, block_size, D], zero-padding the last block."""
  B, S, H, D = x.shape
  num_blocks = cdiv(S, block_size)
  x = jnp.pad(x, ((0, 0), (0, num_blocks * block_size - S), (0, 0), (0, 0)))
  x = x.reshape(B, num_blocks, block_size, H, D)
  return x.transpose(0, 3, 1, 2, 4)  # [B, H, num_blocks, block_size, D]


def _gather_blocks(blocks: jax.Array, idx: jax.Array) -> jax.Array:
  """blocks [B, H, num_blocks, bs, D] (or [B, num_blocks, bs, D], shared by all H), idx [B, H, tc, K] (>= 0)
  -> [B, H, tc, K * bs, D]."""
  take = lambda x, i: x[i]  # [num_blocks, bs, D], [tc, K] -> [tc, K, bs, D]
  shared = blocks.ndim == 4
  g = jax.vmap(jax.vmap(take, in_axes=(None if shared else 0, 0)))(blocks, idx)  # [B, H, tc, K, bs, D]
  return g.reshape(g.shape[:3] + (-1, g.shape[-1]))


def _selected_key_mask(idx: jax.Array, ok: jax.Array, pos: jax.Array, block_size: int,
                       seg_blocks: jax.Array | None = None, q_seg: jax.Array | None = None) -> jax.Array:
  """bool [B, H, tc, K * bs]: gathered key visible to its query (usable slot, causal, and same segment).

  idx, ok: [B, H, tc, K]; pos: [tc]; seg_blocks: [B, num_blocks, bs] key segments (or None); q_seg: [B, tc].
  """
  key_pos = idx[..., None] * block_size + jnp.arange(block_size)  # [B, H, tc, K, bs]
  visible = ok[..., None] & (key_pos <= pos[:, None, None])
  visible = visible.reshape(visible.shape[:3] + (-1,))  # [B, H, tc, N]
  if seg_blocks is not None:
    key_seg = _gather_blocks(seg_blocks[..., None], idx)[..., 0]  # [B, H, tc, N]
    visible &= key_seg == q_seg[:, None, :, None]
  return visible


def _segment_inputs(segment_ids: jax.Array | None, q_offset, T: int, S_pad: int, tc: int, n: int):
  """(key segments padded to S_pad [B, S_pad], query segments per chunk [n, B, tc]), or (None, None).

  Pad keys and padded query rows get segment 0: pad keys are already invisible (causality), and padded rows have
  an empty support or a discarded output, so the value does not matter.
  """
  if segment_ids is None:
    return None, None
  seg = segment_ids.astype(jnp.int32)
  q_seg = _chunk_rows(query_segments(seg, q_offset, T), 1, tc, n)  # [n, B, tc]
  return jnp.pad(seg, ((0, 0), (0, S_pad - seg.shape[1]))), q_seg


def _masked_softmax(s: jax.Array, mask: jax.Array) -> jax.Array:
  """Softmax over the last axis restricted to `mask`; an all-masked row gives zeros (not nan), also in the VJP."""
  s = jnp.where(mask, s, -jnp.inf)
  m = jax.lax.stop_gradient(s.max(-1, keepdims=True))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m)
  total = p.sum(-1, keepdims=True)
  return p / jnp.where(total > 0, total, 1.0)


def _kl_rows(teacher: jax.Array, z: jax.Array, mask: jax.Array) -> jax.Array:
  """sum of KL(teacher || softmax_mask(z)) over all rows (last axis = support); empty rows add 0.

  Written as sum P * (log P - z + lse) so that d/dz = softmax(z) - P exactly (P sums to 1 on a non-empty row).
  """
  z = jnp.where(mask, z, -jnp.inf)
  m = jax.lax.stop_gradient(z.max(-1, keepdims=True))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  total = jnp.exp(z - m).sum(-1, keepdims=True)
  lse = m + jnp.log(jnp.where(total > 0, total, 1.0))
  log_student = jnp.where(mask, z - lse, 0.0)
  positive = teacher > 0
  log_teacher = jnp.log(jnp.where(positive, teacher, 1.0))
  return jnp.where(positive, teacher * (log_teacher - log_student), 0.0).sum()


# ---------------------------------------------------------------------------------------------------------------------
# select_blocks
# ---------------------------------------------------------------------------------------------------------------------


def select_blocks(q_idx: jax.Array, k_idx: jax.Array, *, block_size: int, topk: int, local_blocks: int = 1,
                  q_offset=None, segment_ids: jax.Array | None = None,
                  query_chunk: int | None = None) -> jax.Array:
  """int32 [B, Hkv, T, min(topk, num_blocks)]; see api.select_blocks for the contract.

  Per query chunk: scores [B, Hkv, tc, S] -> block max over visible keys [B, Hkv, tc, num_blocks] -> top-k; only
  the indices of a chunk outlive its iteration.
  """
  static_offset, dyn_offset = split_q_offset(q_offset)
  return _select_blocks(q_idx, k_idx, dyn_offset, segment_ids, block_size=block_size, topk=topk,
                        local_blocks=local_blocks, static_offset=static_offset, query_chunk=query_chunk)


@functools.partial(jax.jit, static_argnames=("block_size", "topk", "local_blocks", "static_offset", "query_chunk"))
def _select_blocks(q_idx, k_idx, dyn_offset, segment_ids, *, block_size, topk, local_blocks, static_offset,
                   query_chunk):
  B, T, Hkv, d_idx = q_idx.shape
  S = k_idx.shape[1]
  # tied to the index queries: masks built from the offset alone would be hoisted out of scanned layers (_carry)
  q_offset = resolve_q_offset(static_offset, dyn_offset, T, S) + carried_zero(q_idx)
  num_blocks = cdiv(S, block_size)
  slots = min(topk, num_blocks)
  # local_blocks > slots only when every block is local (slots = num_blocks), so clipping it loses nothing.
  n_local = min(local_blocks, slots)
  n_rest = slots - n_local

  S_pad = num_blocks * block_size
  k_pad = jnp.pad(k_idx, ((0, 0), (0, S_pad - S), (0, 0)))  # [B, S_pad, d_idx]
  key_pos = jnp.arange(S_pad)
  tc, n = _chunking(T, 2 * B * Hkv * S_pad * 4, query_chunk)
  q_chunks = _chunk_rows(q_idx, 1, tc, n)  # [n, B, tc, Hkv, d_idx]
  starts = q_offset + tc * jnp.arange(n)
  key_seg, q_seg_chunks = _segment_inputs(segment_ids, q_offset, T, S_pad, tc, n)  # [B, S_pad], [n, B, tc]

  def chunk(args):
    qc, start, q_seg = args
    pos = start + jnp.arange(tc)  # [tc]
    visible = (key_pos <= pos[:, None])[None]  # [1, tc, S_pad]
    if q_seg is not None:
      visible = visible & (key_seg[:, None, :] == q_seg[:, :, None])  # [B, tc, S_pad]
    s = jnp.einsum("bthi,bsi->bhts", qc, k_pad, preferred_element_type=jnp.float32)  # [B, Hkv, tc, S_pad]
    s = jnp.where(visible[:, None], s, -jnp.inf)
    block_score = s.reshape(B, Hkv, tc, num_blocks, block_size).max(-1)  # [B, Hkv, tc, num_blocks]

    q_block = pos // block_size  # [tc]
    # Local blocks are forced whatever their score: with segments an older local block may hold only another
    # document's keys; it still takes its slot (as in HF) and the attention mask makes it contribute nothing.
    local = q_block[:, None] - jnp.arange(n_local)  # [tc, n_local]: own block first, then older
    local = jnp.broadcast_to(jnp.where(local >= 0, local, -1), (B, Hkv, tc, n_local))
    if n_rest == 0:
      return local
    distance = q_block[:, None] - jnp.arange(num_blocks)  # [tc, num_blocks]
    is_local = (distance >= 0) & (distance < n_local)
    # A local slot can only be -1 when every visible block is already local, so the -inf (invisible) tail of the
    # top-k below lands after it and the valid-entries-first contract holds.
    top_score, top = jax.lax.top_k(jnp.where(is_local, -jnp.inf, block_score), n_rest)  # [B, Hkv, tc, n_rest]
    rest = jnp.where(top_score > -jnp.inf, top, -1)
    return jnp.concatenate([local, rest], axis=-1)  # [B, Hkv, tc, slots]

  out = jax.lax.map(chunk, (q_chunks, starts, q_seg_chunks))  # [n, B, Hkv, tc, slots]
  return _unchunk_rows(out, 2, T).astype(jnp.int32)  # [B, Hkv, T, slots]


# ---------------------------------------------------------------------------------------------------------------------
# sparse_attention
# ---------------------------------------------------------------------------------------------------------------------


def sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, block_idx: jax.Array, *, block_size: int,
                     scale: float | None = None, q_offset=None, segment_ids: jax.Array | None = None,
                     query_chunk: int | None = None) -> jax.Array:
  """[B, T, Hq, D]; see api.sparse_attention for the contract."""
  static_offset, dyn_offset = split_q_offset(q_offset)
  return _sparse_attention(q, k, v, block_idx, dyn_offset, segment_ids, block_size=block_size, scale=scale,
                           static_offset=static_offset, query_chunk=query_chunk)


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "static_offset", "query_chunk"))
def _sparse_attention(q, k, v, block_idx, dyn_offset, segment_ids, *, block_size, scale, static_offset,
                      query_chunk):
  B, T, Hq, D = q.shape
  S, Hkv = k.shape[1], k.shape[2]
  G = Hq // Hkv
  K = block_idx.shape[-1]
  q_offset = resolve_q_offset(static_offset, dyn_offset, T, S) + carried_zero(q)  # see _select_blocks
  scale = D ** -0.5 if scale is None else scale
  acc = jnp.promote_types(q.dtype, jnp.float32)
  num_blocks = cdiv(S, block_size)
  N = K * block_size

  k_blocks = _to_blocks(k, block_size)  # [B, Hkv, num_blocks, bs, D]
  v_blocks = _to_blocks(v, block_size)
  # Per query: gathered K and V, their upcasts / cotangents in f32, and a few f32 [Hq, N] score-sized buffers.
  per_query = B * Hkv * N * D * (2 * k.dtype.itemsize + 2 * 4) + 3 * B * Hq * N * 4
  tc, n = _chunking(T, per_query, query_chunk)
  q_chunks = _chunk_rows(q.reshape(B, T, Hkv, G, D), 1, tc, n)  # [n, B, tc, Hkv, G, D]
  # Padded query rows get no blocks at all, hence zero output and zero gradient.
  idx_chunks = _chunk_rows(block_idx, 2, tc, n, fill=-1)  # [n, B, Hkv, tc, K]
  starts = q_offset + tc * jnp.arange(n)
  key_seg, q_seg_chunks = _segment_inputs(segment_ids, q_offset, T, num_blocks * block_size, tc, n)
  seg_blocks = None if key_seg is None else key_seg.reshape(B, num_blocks, block_size)

  def chunk(args):
    qc, idx, start, q_seg = args
    ok = usable_slots(idx, num_blocks)
    idx = jnp.where(ok, idx, 0)
    mask = _selected_key_mask(idx, ok, start + jnp.arange(tc), block_size, seg_blocks, q_seg)  # [B, Hkv, tc, N]
    kg = _gather_blocks(k_blocks, idx)  # [B, Hkv, tc, N, D]
    vg = _gather_blocks(v_blocks, idx)  # [B, Hkv, tc, N, D]
    s = jnp.einsum("bthgd,bhtnd->bhtgn", qc, kg, preferred_element_type=acc) * scale  # [B, Hkv, tc, G, N]
    p = _masked_softmax(s, mask[:, :, :, None, :])
    o = jnp.einsum("bhtgn,bhtnd->bthgd", p, vg.astype(acc))  # [B, tc, Hkv, G, D]
    return o.astype(q.dtype)

  out = jax.lax.map(jax.checkpoint(chunk, prevent_cse=False), (q_chunks, idx_chunks, starts, q_seg_chunks))
  out = _unchunk_rows(out, 1, T)  # [B, T, Hkv, G, D]
  return out.reshape(B, T, Hq, D)


# ---------------------------------------------------------------------------------------------------------------------
# kl_loss
# ---------------------------------------------------------------------------------------------------------------------


def kl_loss(q: jax.Array, k: jax.Array, q_idx: jax.Array, k_idx: jax.Array, block_idx: jax.Array | None, *,
            block_size: int, scale: float | None = None, index_scale: float | None = None, q_offset=None,
            segment_ids: jax.Array | None = None, query_chunk: int | None = None) -> jax.Array:
  """f32 scalar; see api.kl_loss for the contract.

  Sparse target: per chunk the selected K blocks and k_idx blocks are gathered, [B, Hkv, tc, K * bs, ...].
  Dense warmup target (block_idx=None): per chunk the scores against all S keys, [B, Hq, tc, S].
  """
  static_offset, dyn_offset = split_q_offset(q_offset)
  return _kl_loss(q, k, q_idx, k_idx, block_idx, dyn_offset, segment_ids, block_size=block_size, scale=scale,
                  index_scale=index_scale, static_offset=static_offset, query_chunk=query_chunk)


@functools.partial(jax.jit,
                   static_argnames=("block_size", "scale", "index_scale", "static_offset", "query_chunk"))
def _kl_loss(q, k, q_idx, k_idx, block_idx, dyn_offset, segment_ids, *, block_size, scale, index_scale,
             static_offset, query_chunk):
  B, T, Hq, D = q.shape
  S, Hkv = k.shape[1], k.shape[2]
  G = Hq // Hkv
  d_idx = q_idx.shape[-1]
  q_offset = resolve_q_offset(static_offset, dyn_offset, T, S) + carried_zero(q)  # see _select_blocks
  scale = D ** -0.5 if scale is None else scale
  index_scale = d_idx ** -0.5 if index_scale is None else index_scale
  num_blocks = cdiv(S, block_size)

  # The teacher is a target only: cut q and k off before anything is built from them.
  q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)

  if block_idx is None:
    per_query = 4 * B * (Hq + Hkv) * S * 4
    tc, n = _chunking(T, per_query, query_chunk)
    key_pos = jnp.arange(S)
    key_seg, q_seg_chunks = _segment_inputs(segment_ids, q_offset, T, S, tc, n)  # [B, S], [n, B, tc]

    def chunk(args):
      qc, qic, start, q_seg = args
      pos = start + jnp.arange(tc)  # [tc]
      # Padded query rows sit past S - 1 and would see every key: give them an empty support instead.
      mask = ((key_pos <= pos[:, None]) & (pos < q_offset + T)[:, None])[None]  # [1, tc, S]
      if q_seg is not None:
        mask = mask & (key_seg[:, None, :] == q_seg[:, :, None])  # [B, tc, S]
      s = jnp.einsum("bthgd,bshd->bhtgs", qc, k, preferred_element_type=jnp.float32) * scale  # [B, Hkv, tc, G, S]
      teacher = _masked_softmax(s, mask[:, None, :, None, :]).mean(3)  # [B, Hkv, tc, S]
      z = jnp.einsum("bthi,bsi->bhts", qic, k_idx, preferred_element_type=jnp.float32) * index_scale
      return _kl_rows(jax.lax.stop_gradient(teacher), z, jnp.broadcast_to(mask[:, None], z.shape))

    xs = (_chunk_rows(q.reshape(B, T, Hkv, G, D), 1, tc, n),  # [n, B, tc, Hkv, G, D]
          _chunk_rows(q_idx, 1, tc, n),  # [n, B, tc, Hkv, d_idx]
          q_offset + tc * jnp.arange(n),
          q_seg_chunks)
  else:
    K = block_idx.shape[-1]
    N = K * block_size
    k_blocks = _to_blocks(k, block_size)  # [B, Hkv, num_blocks, bs, D]
    k_idx_blocks = _to_blocks(k_idx[:, :, None, :], block_size)[:, 0]  # [B, num_blocks, bs, d_idx]
    per_query = B * Hkv * N * (D * k.dtype.itemsize + 3 * d_idx * 4) + 4 * B * (Hq + Hkv) * N * 4
    tc, n = _chunking(T, per_query, query_chunk)
    key_seg, q_seg_chunks = _segment_inputs(segment_ids, q_offset, T, num_blocks * block_size, tc, n)
    seg_blocks = None if key_seg is None else key_seg.reshape(B, num_blocks, block_size)

    def chunk(args):
      qc, qic, idx, start, q_seg = args
      ok = usable_slots(idx, num_blocks)
      idx = jnp.where(ok, idx, 0)
      mask = _selected_key_mask(idx, ok, start + jnp.arange(tc), block_size, seg_blocks, q_seg)  # [B, Hkv, tc, N]
      kg = _gather_blocks(k_blocks, idx)  # [B, Hkv, tc, N, D]
      s = jnp.einsum("bthgd,bhtnd->bhtgn", qc, kg, preferred_element_type=jnp.float32) * scale  # [B, Hkv, tc, G, N]
      teacher = _masked_softmax(s, mask[:, :, :, None, :]).mean(3)  # [B, Hkv, tc, N]
      kig = _gather_blocks(k_idx_blocks, idx)  # [B, Hkv, tc, N, d_idx]
      z = jnp.einsum("bthi,bhtni->bhtn", qic, kig, preferred_element_type=jnp.float32) * index_scale
      return _kl_rows(jax.lax.stop_gradient(teacher), z, mask)

    xs = (_chunk_rows(q.reshape(B, T, Hkv, G, D), 1, tc, n),  # [n, B, tc, Hkv, G, D]
          _chunk_rows(q_idx, 1, tc, n),  # [n, B, tc, Hkv, d_idx]
          _chunk_rows(block_idx, 2, tc, n, fill=-1),  # [n, B, Hkv, tc, K]: padded rows have an empty support
          q_offset + tc * jnp.arange(n),
          q_seg_chunks)

  per_chunk = jax.lax.map(jax.checkpoint(chunk, prevent_cse=False), xs)  # [n]
  return per_chunk.sum() / (B * T * Hkv)
