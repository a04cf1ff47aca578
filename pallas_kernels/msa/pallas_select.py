"""`select_blocks` on Pallas (Triton backend): fused index scoring, block max-pooling and an exp-free running top-k.

One program per (b, group h, tile of TQ queries) walks the key blocks 0..(last block its queries can see). For each
block it scores the tile's index queries against the block's index keys ([TQ, d_idx] x [d_idx, bs], f32
accumulation), applies the causal (and segment) mask, max-pools to one score per query, and offers that score to a
running top-(topk - local_blocks) kept in registers: the candidate replaces the current minimum if it is strictly
larger (ties keep the earlier block, as `lax.top_k` does). Neither the T x S scores nor the T x num_blocks block
scores are ever written: memory is O(T * topk), whatever the context length. No exponential is taken: the softmax
would not change the order.

At the end the kept blocks are ordered by descending score (ties: lower block id first) with a selection sort over
the topk slots, the forced local blocks (own block, then older) are put first, and empty slots get -1: the contract
of api.select_blocks, identical to the xla implementation's output.

On the H200 (BENCHMARKS.md, issue 5): identical to the float32-at-full-precision reference on 7 shape families; at
128K tokens (M3 index shape) 14.1 ms = 622 TFLOP/s of causal index scoring, 3.5x lax.top_k alone over materialised
block scores and 37x the xla implementation. The GPU default for select_blocks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.msa._common import dot, iota, row_offsets, rows_cols


def _next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def fits_gpu_kernel(d_idx: int, block_size) -> bool:
  """Triton tiles need power-of-two sizes of at least 16 for the [rows, d_idx] x [d_idx, block] dot."""
  ok = lambda n: isinstance(n, int) and n >= 16 and n & (n - 1) == 0  # noqa: E731
  return ok(d_idx) and ok(block_size)


def _index_dot(q, k, fp8_dot: bool):
  """[TQ, bs] f32 scores q . k^T. fp8 operands (an fp8 index cache) use the fp8 tensor-core dot when both are fp8
  and `fp8_dot`; otherwise they are widened to bf16 in registers (exact: every e4m3 value is a bf16 value)."""
  is8 = lambda x: x.dtype == jnp.float8_e4m3fn  # noqa: E731
  if is8(q) or is8(k):
    if not (fp8_dot and is8(q) and is8(k)):
      q, k = q.astype(jnp.bfloat16), k.astype(jnp.bfloat16)
    return jnp.dot(q, k.T, preferred_element_type=jnp.float32)
  return dot(q, k.T)


def _scan(offset_ref, q_ref, k_ref, seg_ref, ks_ref, b, h, tile, lo, hi, *, Hkv, R, F, TQ, bs, n_local, n_rest,
          NRP, fp8_dot):
  """Running top-n_rest over blocks [lo, hi) for the tile's rows: (vals f32 [TQ, NRP], ids int32 [TQ, NRP],
  q_block [TQ]). Slots past n_rest hold +inf: never the minimum, never replaced, never emitted.

  A program's rows are R "virtual rows": the T queries of group h (F = 1, Hkv = the group count), or with the
  groups folded into the rows (F = groups, Hkv = 1, h = 0) every (query, group) pair, row r = t * F + group, so
  that one read of a key block serves all groups (they share the index key)."""
  d_idx = q_ref.shape[-1]
  r = jnp.minimum(tile * TQ + iota(TQ), R - 1)  # rows past R repeat the last one (never stored)
  q = q_ref[(b, *rows_cols(r * Hkv + h, d_idx))]  # [TQ, d_idx]
  q_pos = offset_ref[b] + r // F  # [TQ]
  q_block = q_pos // bs
  q_seg = None if seg_ref is None else seg_ref[b, q_pos]
  col = jax.lax.broadcasted_iota(jnp.int32, (TQ, NRP), 1)

  def block(j, carry, masked):
    vals, ids = carry
    k0 = pl.multiple_of(j * bs, bs)
    k = k_ref[b, pl.ds(k0, bs), :]  # [bs, d_idx]
    s = _index_dot(q, k, fp8_dot)  # [TQ, bs]
    if ks_ref is not None:  # per-key dequantisation scale of an fp8 index cache
      s = s * ks_ref[b, pl.ds(k0, bs)][None, :]
    if masked:
      k_pos = k0 + iota(bs)
      vis = k_pos[None, :] <= q_pos[:, None]
      if seg_ref is not None:
        vis &= seg_ref[b, pl.ds(k0, bs)][None, :] == q_seg[:, None]
      s = jnp.where(vis, s, -jnp.inf)
    score = jnp.max(s, axis=1)  # [TQ]: max-pool over the visible keys
    distance = q_block - j
    score = jnp.where((distance >= 0) & (distance < n_local), -jnp.inf, score)  # local blocks are forced, not ranked
    low = jnp.min(vals, axis=1)  # [TQ]
    at = jnp.min(jnp.where(vals == low[:, None], col, NRP), axis=1)  # first slot holding the minimum
    take = ((col == at[:, None]) & (score > low)[:, None])  # [TQ, NRP]
    return jnp.where(take, score[:, None], vals), jnp.where(take, j, ids)

  vals = jnp.where(col < n_rest, -jnp.inf, jnp.inf).astype(jnp.float32)
  ids = jnp.full((TQ, NRP), -1, jnp.int32)
  if n_rest > 0:
    # Blocks wholly before the tile's first query are visible to every row: no causal mask to build there (most
    # blocks of a long context). Segments need the mask everywhere.
    full = lo if seg_ref is not None else jnp.clip((offset_ref[b] + (tile * TQ) // F + 1) // bs, lo, hi)
    vals, ids = jax.lax.fori_loop(lo, full, functools.partial(block, masked=False), (vals, ids))
    vals, ids = jax.lax.fori_loop(full, hi, functools.partial(block, masked=True), (vals, ids))
  return vals, ids, q_block


def _last_block(offset_ref, b, tile, *, R, F, TQ, bs):
  """The last block any row of the tile can see (+1: a loop bound)."""
  return (offset_ref[b] + jnp.minimum(tile * TQ + TQ - 1, R - 1) // F) // bs + 1


def _select_kernel(offset_ref, q_ref, k_ref, *refs, Hkv, R, F, TQ, bs, n_local, n_rest, NRP, SP, slots, has_seg,
                   has_kscale, fp8_dot):
  seg_ref = refs[0] if has_seg else None
  ks_ref = refs[int(has_seg)] if has_kscale else None
  out_ref = refs[-1]
  bh, tile = pl.program_id(0), pl.program_id(1)
  b, h = bh // Hkv, bh % Hkv
  hi = _last_block(offset_ref, b, tile, R=R, F=F, TQ=TQ, bs=bs)
  vals, ids, q_block = _scan(offset_ref, q_ref, k_ref, seg_ref, ks_ref, b, h, tile, 0, hi, Hkv=Hkv, R=R, F=F, TQ=TQ,
                             bs=bs, n_local=n_local, n_rest=n_rest, NRP=NRP, fp8_dot=fp8_dot)
  col = jax.lax.broadcasted_iota(jnp.int32, (TQ, NRP), 1)
  big = jnp.int32(2 ** 30)
  out_col = jax.lax.broadcasted_iota(jnp.int32, (TQ, SP), 1)
  out = jnp.full((TQ, SP), -1, jnp.int32)
  for l in range(n_local):  # own block first, then older ones; -1 before the first block
    local = q_block - l
    out = jnp.where(out_col == l, jnp.where(local >= 0, local, -1)[:, None], out)
  used = col >= n_rest
  for i in range(n_rest):  # selection sort: descending score, lower block id first on ties
    best = jnp.max(jnp.where(used, -jnp.inf, vals), axis=1)  # [TQ]
    pick = jnp.min(jnp.where(~used & (vals == best[:, None]), ids, big), axis=1)
    pick = jnp.where(best > -jnp.inf, pick, -1)
    out = jnp.where(out_col == n_local + i, pick[:, None], out)
    used |= (ids == pick[:, None]) & (pick >= 0)[:, None]
  rows = tile * TQ + iota(TQ)
  plgpu.store(out_ref.at[(bh, *rows_cols(rows, SP))], out, mask=(out_col < slots))


def _candidates_kernel(offset_ref, q_ref, k_ref, *refs, Hkv, R, F, TQ, bs, n_local, n_rest, NRP, per_split,
                       has_seg, has_kscale, fp8_dot):
  """Split-K (decoding: few queries, long history): program `split` ranks only blocks
  [split * per_split, (split + 1) * per_split) and writes its candidates; XLA merges the splits."""
  seg_ref = refs[0] if has_seg else None
  ks_ref = refs[int(has_seg)] if has_kscale else None
  vals_ref, ids_ref = refs[-2:]
  bh, tile, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  b, h = bh // Hkv, bh % Hkv
  lo = split * per_split
  hi = jnp.minimum(lo + per_split, _last_block(offset_ref, b, tile, R=R, F=F, TQ=TQ, bs=bs))
  vals, ids, _ = _scan(offset_ref, q_ref, k_ref, seg_ref, ks_ref, b, h, tile, lo, jnp.maximum(hi, lo), Hkv=Hkv,
                       R=R, F=F, TQ=TQ, bs=bs, n_local=n_local, n_rest=n_rest, NRP=NRP, fp8_dot=fp8_dot)
  rows = tile * TQ + iota(TQ)
  cols = split * NRP + jax.lax.broadcasted_iota(jnp.int32, (1, NRP), 1)
  vals_ref[bh, rows[:, None], cols] = vals
  ids_ref[bh, rows[:, None], cols] = ids


def _merge_candidates(vals, ids, q_block, n_local, n_rest):
  """vals/ids [..., C] from all splits -> int32 [..., n_local + n_rest] in the contract's order."""
  # Descending score, then lower block id: lexsort's last key is the primary one. +inf padding slots sort first
  # and are dropped with the -inf (empty) ones below.
  vals = jnp.where(jnp.isposinf(vals), -jnp.inf, vals)
  order = jnp.lexsort((ids, -vals), axis=-1)[..., :n_rest]
  best, pick = jnp.take_along_axis(vals, order, -1), jnp.take_along_axis(ids, order, -1)
  rest = jnp.where(best > -jnp.inf, pick, -1)
  local = q_block[..., None] - jnp.arange(n_local)
  local = jnp.where(local >= 0, local, -1)
  return jnp.concatenate([local, rest], axis=-1).astype(jnp.int32)


def select_blocks(q_idx, k_idx, *, block_size: int, topk: int, local_blocks: int = 1, q_offset=None,
                  segment_ids=None, k_idx_scale=None, interpret: bool | None = None, query_tile: int = 128,
                  key_splits: int = 1, num_warps: int = 8, num_stages: int = 2, fp8_dot: bool = True,
                  fold_groups: bool | None = None) -> jax.Array:
  """int32 [B, Hkv, T, min(topk, num_blocks)]; see api.select_blocks for the contract.

  key_splits > 1 ranks disjoint ranges of blocks in separate programs and merges their candidates in XLA: for
  decoding, where B * Hkv programs alone would leave most of the GPU idle while one program streams the whole
  index-key cache. q_offset may be a [B] array (one offset per row). `k_idx_scale` f32 [B, S]: per-key scale of an
  fp8 (float8_e4m3fn) k_idx, applied to the scores before max-pooling; q_idx may be fp8 too (a per-row scale of
  q_idx does not change a row's ranking, so it needs none). `fp8_dot=False` widens fp8 operands to bf16 before the
  dot (bytes saved, no fp8 tensor-core use). `fold_groups` (default: on when T * Hkv <= query_tile, i.e. decoding)
  puts all groups' queries in one program's rows, so each index-key block is read once instead of once per group.
  """
  # Block ids have no derivative; without this, differentiating a caller would make pallas_call trace a JVP of the
  # kernel, which it cannot.
  q_idx, k_idx, k_idx_scale = jax.lax.stop_gradient((q_idx, k_idx, k_idx_scale))
  B, T, Hkv, d_idx = q_idx.shape
  S = k_idx.shape[1]
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  bs = block_size
  nb = -(-S // bs)
  slots = min(topk, nb)
  n_local = min(local_blocks, slots)
  n_rest = slots - n_local
  NRP = _next_pow2(max(n_rest, 1))
  S_pad = nb * bs
  k_pad = jnp.pad(k_idx, ((0, 0), (0, S_pad - S), (0, 0)))  # pad keys lie past every query: causally invisible
  seg = None
  if segment_ids is not None:
    seg = jnp.pad(jnp.asarray(segment_ids, jnp.int32), ((0, 0), (0, S_pad - S)), constant_values=-1)
  kscale = None
  if k_idx_scale is not None:
    kscale = jnp.pad(jnp.asarray(k_idx_scale, jnp.float32), ((0, 0), (0, S_pad - S)))
  offset = row_offsets(q_offset, B, S, T)
  if fold_groups is None:
    fold_groups = T * Hkv <= query_tile
  # Programs per batch row (H) and virtual rows per program (Rv, F per query): see _scan.
  H, Rv, F = (1, T * Hkv, Hkv) if fold_groups else (Hkv, T, 1)
  # Dots need >= 16 rows on the GPU; interpret mode takes any tile.
  TQ = min(query_tile, _next_pow2(Rv)) if interpret else max(16, min(query_tile, _next_pow2(Rv)))
  T_pad = -(-Rv // TQ) * TQ
  extra = tuple(x for x in (seg, kscale) if x is not None)
  args = (offset, q_idx.reshape(B, T * Hkv, d_idx), k_pad, *extra)
  common = dict(Hkv=H, R=Rv, F=F, TQ=TQ, bs=bs, n_local=n_local, n_rest=n_rest, NRP=NRP, has_seg=seg is not None,
                has_kscale=kscale is not None, fp8_dot=fp8_dot)

  def unfold(x):  # [B * H, T_pad, C] -> [B, Hkv, T, C]
    x = x[:, :Rv]
    return x.reshape(B, T, Hkv, -1).transpose(0, 2, 1, 3) if fold_groups else x.reshape(B, Hkv, T, -1)

  params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
  if key_splits <= 1 or n_rest == 0:
    SP = _next_pow2(max(slots, 1))
    out = pl.pallas_call(
        functools.partial(_select_kernel, SP=SP, slots=slots, **common),
        out_shape=jax.ShapeDtypeStruct((B * H, T_pad, SP), jnp.int32),
        grid=(B * H, T_pad // TQ), compiler_params=params, interpret=interpret, name="msa_select_blocks",
    )(*args)
    return unfold(out)[..., :slots]
  per_split = -(-nb // key_splits)
  splits = -(-nb // per_split)
  vals, ids = pl.pallas_call(
      functools.partial(_candidates_kernel, per_split=per_split, **common),
      out_shape=(jax.ShapeDtypeStruct((B * H, T_pad, splits * NRP), jnp.float32),
                 jax.ShapeDtypeStruct((B * H, T_pad, splits * NRP), jnp.int32)),
      grid=(B * H, T_pad // TQ, splits), compiler_params=params, interpret=interpret,
      name="msa_select_candidates",
  )(*args)
  q_block = ((offset[:, None] + jnp.arange(T)) // bs)[:, None, :]  # [B, 1, T]
  vals, ids = unfold(vals), unfold(ids)
  return _merge_candidates(vals, ids, jnp.broadcast_to(q_block, (B, Hkv, T)), n_local, n_rest)
