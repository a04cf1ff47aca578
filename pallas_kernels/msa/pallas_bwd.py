"""Pallas (Triton) backward kernels of MSA's sparse attention (KV-outer).

With the forward's final log-sum-exp `lse` and `delta = rowsum(dO * O)` per (query, head), the probabilities of any
(query, block) pair are recomputed exactly as `exp(q.k * scale - lse)`, so the pairs of one block can be processed
without the other blocks of their rows:

  1. `kv_outer_backward`: one program per chunk of at most `steps * R` pairs of one block (pallas_map.chunk_layout).
     It loads K_j, V_j once and walks its pairs R queries at a time (the block order of the forward), accumulating
     its share of dK_j and dV_j in registers, written as an f32 partial per chunk. Each step's dQ contribution
     (`dS K_j * scale`, one per (query, slot) pair) is written to a partial buffer in block order.
  2. `merge_blocks`: one program per block sums its chunks' dK/dV partials in chunk order.
  3. `merge_dq`: one program per tile of queries sums the K partial dQ rows of each query in slot order.
Every pass is deterministic: every output element is written once, sums run in a fixed order, no atomics.

Why chunks: the early blocks every query can see and the blocks of the diagonal have many more pairs than the
others (block 0 had 3.7x the mean in a trained small model at 32K). With one program per block, the heaviest
block's program alone set the kernel's time when there are few programs per SM (16 query heads on one KV head:
256 programs at 32K for 132 SMs). Chunks of a size chosen from the total number of pairs (`backward_chunk`) give
every program about the same work.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.msa._common import cdiv, dot, iota, rows_cols, visible_mask


def backward_chunk(BH: int, P: int, R: int, steps: int | None, target_programs: int = 1024) -> int:
  """Pairs per backward program: `steps` loop steps of R pairs, or (None) as many as split the BH * P pairs into
  about `target_programs` programs (several waves of the 132 SMs, so that the last wave's tail is short)."""
  if steps is None:
    steps = max(1, cdiv(cdiv(BH * P, target_programs), R))
  return steps * R


def _dkv_kernel(offset_ref, chunk_blk_ref, chunk_start_ref, chunk_count_ref, sorted_t_ref, q_ref, k_ref, v_ref,
                do_ref, lse_ref, delta_ref, *refs, G, Hq, Hkv, R, bs, D, scale, has_seg):
  seg_ref = refs[0] if has_seg else None
  dk_ref, dv_ref, dq_ref = refs[-3:]
  bh, c = pl.program_id(0), pl.program_id(1)
  b, h = bh // Hkv, bh % Hkv
  start, count = chunk_start_ref[bh, c], chunk_count_ref[bh, c]
  k0 = pl.multiple_of(chunk_blk_ref[bh, c] * bs, bs)
  k = k_ref[b, pl.ds(k0, bs), h, :]  # [bs, D]
  v = v_ref[b, pl.ds(k0, bs), h, :]
  k_pos = k0 + iota(bs)
  i = iota(R * G)
  r, g = i // G, i % G

  def chunk(it, carry):
    dk, dv = carry
    first = start + it * R
    row_ok = it * R + r < count
    t = sorted_t_ref[bh, first + r]  # [R*G]
    rows = t * Hq + h * G + g
    q = q_ref[(b, *rows_cols(rows, D))]  # [R*G, D]
    do = do_ref[(b, *rows_cols(rows, D))]
    lse = lse_ref[b, rows]  # [R*G] f32
    delta = delta_ref[b, rows]
    s = dot(q, k.T) * scale  # [R*G, bs]
    vis = visible_mask(offset_ref[b] + t, k_pos, row_ok, seg_ref, b, k0, bs)
    # A visible key implies a finite lse; the where keeps exp(+inf) of dead rows out of the sums.
    p = jnp.where(vis, jnp.exp(s - lse[:, None]), 0.0)
    dv = dv + dot(p.astype(do.dtype).T, do)  # [bs, D]
    dp = dot(do, v.T)  # [R*G, bs]
    ds = p * (dp - delta[:, None])
    dk = dk + dot(ds.astype(q.dtype).T, q)
    dq = dot(ds.astype(k.dtype), k) * scale  # [R*G, D]: this pair's share of dQ
    plgpu.store(dq_ref.at[bh, pl.ds(first * G, R * G), :], dq.astype(dq_ref.dtype), mask=row_ok[:, None])
    return dk, dv

  zeros = jnp.zeros((bs, D), jnp.float32)
  dk, dv = jax.lax.fori_loop(0, (count + R - 1) // R, chunk, (zeros, zeros))
  dk_ref[bh, c] = dk * scale  # idle chunks write zeros nobody reads
  dv_ref[bh, c] = dv


def kv_outer_backward(q, k, v, do, lse, delta, kv_map, chunks, offset, seg, *, G, R, bs, scale, dq_dtype, interpret,
                      num_warps, num_stages):
  """q, do [B, T*Hq, D]; lse, delta f32 [B, T*Hq]; k, v [B, S_pad, Hkv, D]; chunks: pallas_map.Chunks
  -> dk, dv [B, S_pad, Hkv, D] (k's dtype) and per-pair dq [BH, (P+R)*G, D] (dq_dtype)."""
  B, _, D = q.shape
  S_pad, Hkv = k.shape[1], k.shape[2]
  BH, C = chunks.blk.shape
  rows = kv_map.sorted_t.shape[1] * G
  kernel = functools.partial(_dkv_kernel, G=G, Hq=G * Hkv, Hkv=Hkv, R=R, bs=bs, D=D, scale=scale,
                             has_seg=seg is not None)
  extra = () if seg is None else (seg,)
  part = jax.ShapeDtypeStruct((BH, C, bs, D), jnp.float32)
  dk_part, dv_part, dq = pl.pallas_call(
      kernel,
      out_shape=(part, part, jax.ShapeDtypeStruct((BH, rows, D), dq_dtype)),
      grid=(BH, C),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="msa_kv_outer_backward",
  )(offset, chunks.blk, chunks.start, chunks.count, kv_map.sorted_t, q, k, v, do, lse, delta, *extra)
  dk, dv = merge_blocks(chunks, (dk_part, dv_part), k.dtype, interpret=interpret)  # [BH, S_pad, D] each
  as_keys = lambda x: x.reshape(B, Hkv, S_pad, D).transpose(0, 2, 1, 3)  # noqa: E731  [B, S_pad, Hkv, D]
  return as_keys(dk), as_keys(dv), dq


def _block_merge_kernel(first_ref, n_ref, *refs, bs, width, count):
  parts, outs = refs[:count], refs[count:]
  bh, j = pl.program_id(0), pl.program_id(1)
  first, n = first_ref[bh, j], n_ref[bh, j]

  def add(i, accs):
    return tuple(acc + part[bh, first + i] for acc, part in zip(accs, parts))

  accs = jax.lax.fori_loop(0, n, add, tuple(jnp.zeros((bs, width), jnp.float32) for _ in parts))
  for out, acc in zip(outs, accs):  # a block no query chose gets zeros
    out[bh, pl.ds(pl.multiple_of(j * bs, bs), bs), :] = acc.astype(out.dtype)


def merge_blocks(chunks, parts, out_dtype, *, interpret, num_warps=4, num_stages=2):
  """Per-chunk partials f32 [BH, C, bs, W] (a tuple) -> per-block sums [BH, nb * bs, W] in out_dtype, each block's
  chunks added in chunk order."""
  BH, nb = chunks.first.shape
  _, _, bs, W = parts[0].shape
  kernel = functools.partial(_block_merge_kernel, bs=bs, width=W, count=len(parts))
  return pl.pallas_call(
      kernel,
      out_shape=tuple(jax.ShapeDtypeStruct((BH, nb * bs, W), out_dtype) for _ in parts),
      grid=(BH, nb),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="msa_merge_blocks",
  )(chunks.first, chunks.n, *parts)


def _dq_merge_kernel(pair_pos_ref, dq_part_ref, dq_ref, *, G, Hq, Hkv, K, TQ, D):
  bh, tile = pl.program_id(0), pl.program_id(1)
  b, h = bh // Hkv, bh % Hkv
  i = iota(TQ * G)
  t, g = tile * TQ + i // G, i % G

  def slot(s, acc):
    p = pair_pos_ref[bh, t * K + s]  # [TQ*G]
    valid = p >= 0
    row = jnp.where(valid, p, 0) * G + g
    part = dq_part_ref[(bh, *rows_cols(row, D))].astype(jnp.float32)  # [TQ*G, D]
    return acc + jnp.where(valid[:, None], part, 0.0)  # rows of unusable slots are unwritten

  acc = jax.lax.fori_loop(0, K, slot, jnp.zeros((TQ * G, D), jnp.float32))
  dq_ref[(b, *rows_cols(t * Hq + h * G + g, D))] = acc.astype(dq_ref.dtype)


def merge_dq(pair_pos, dq_part, *, B, T_pad, Hq, Hkv, K, TQ, out_dtype, interpret, num_warps, num_stages):
  """pair_pos [BH, T_pad*K], dq_part [BH, rows, D] -> dq [B, T_pad*Hq, D]."""
  D = dq_part.shape[-1]
  kernel = functools.partial(_dq_merge_kernel, G=Hq // Hkv, Hq=Hq, Hkv=Hkv, K=K, TQ=TQ, D=D)
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((B, T_pad * Hq, D), out_dtype),
      grid=(B * Hkv, T_pad // TQ),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="msa_merge_dq",
  )(pair_pos, dq_part)
