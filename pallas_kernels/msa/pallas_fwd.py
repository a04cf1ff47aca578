"""Pallas (Triton) forward kernels of MSA's sparse attention.

KV-outer (the fast path, DESIGN.md §2):
  1. `kv_outer_partials`: one program per chunk of at most `steps * R` (query, slot) pairs that chose the same KV
     block (see pallas_map): hot blocks are split over several programs, each loads K_j and V_j once and then
     walks its pairs R at a time, gathering R queries x G heads of the group as one [R*G, D] tile, and writes each
     pair's softmax-normalised partial output and log-sum-exp, in block order.
  2. `merge_partials`: one program per tile of queries; for each of the K slots it gathers the partial written for
     that (query, slot) and combines them by their log-sum-exps. Writes the output in q's layout and the final
     log-sum-exp (kept for the backward pass).
Every (query, head) row is written by exactly one program and merged in slot order, so results are bitwise
reproducible (no atomics).

Query-major (`query_major_forward`): the baseline the issue asks to measure first. One program per (query, group)
walks its K selected blocks with an online softmax; each KV block is re-read by every query that chose it.

Layout conventions inside the kernels: q, out as [B, T * Hq, D] (row t * Hq + head), k, v as [B, S_pad, Hkv, D],
per-(b, h) buffers flattened to `bh = b * Hkv + h`. All index vectors are kept in range (buffers are padded), so
masks only decide what is computed or stored, never whether an address is valid.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.msa._common import dot, iota, rows_cols, visible_mask


# ---------------------------------------------------------------------------------------------------------------------
# KV-outer partials
# ---------------------------------------------------------------------------------------------------------------------


def _partials_kernel(offset_ref, chunk_blk_ref, chunk_start_ref, chunk_count_ref, sorted_t_ref, q_ref, k_ref, v_ref,
                     *refs, G, Hq, Hkv, R, bs, D, scale, has_seg):
  seg_ref = refs[0] if has_seg else None
  o_ref, lse_ref = refs[-2:]
  bh, c = pl.program_id(0), pl.program_id(1)
  b, h = bh // Hkv, bh % Hkv
  count = chunk_count_ref[bh, c]

  start = chunk_start_ref[bh, c]
  k0 = pl.multiple_of(chunk_blk_ref[bh, c] * bs, bs)
  k = k_ref[b, pl.ds(k0, bs), h, :]  # [bs, D], loaded once for all the chunk's steps
  v = v_ref[b, pl.ds(k0, bs), h, :]
  k_pos = k0 + iota(bs)
  i = iota(R * G)
  r, g = i // G, i % G

  def step(it, carry):
    first = start + it * R
    row_ok = it * R + r < count
    t = sorted_t_ref[bh, first + r]  # [R*G]: query of each row (rows past `count` read a neighbour's, masked)
    q = q_ref[(b, *rows_cols(t * Hq + h * G + g, D))]  # [R*G, D]
    s = dot(q, k.T) * scale  # [R*G, bs]
    vis = visible_mask(offset_ref[b] + t, k_pos, row_ok, seg_ref, b, k0, bs)
    s = jnp.where(vis, s, -jnp.inf)
    m = jnp.max(s, axis=1)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)  # a row that sees no key of this block: p = 0, lse = -inf
    p = jnp.exp(s - m_safe[:, None])
    l = jnp.sum(p, axis=1)
    o = dot(p.astype(v.dtype), v) / jnp.where(l > 0, l, 1.0)[:, None]  # [R*G, D]
    lse = jnp.where(l > 0, m_safe + jnp.log(l), -jnp.inf)
    rows = pl.ds(first * G, R * G)  # the pairs of a chunk are contiguous in block order
    plgpu.store(o_ref.at[bh, rows, :], o.astype(o_ref.dtype), mask=row_ok[:, None])
    plgpu.store(lse_ref.at[bh, rows], lse, mask=row_ok)
    return carry

  # Idle chunks (count 0) run no step.
  jax.lax.fori_loop(0, (count + R - 1) // R, step, 0)


def kv_outer_partials(q, k, v, kv_map, offset, seg, *, G, R, bs, scale, partial_dtype, interpret, num_warps,
                      num_stages):
  """q [B, T*Hq, D], k/v [B, S_pad, Hkv, D] -> partial outputs [BH, (P+R)*G, D] and lse f32 [BH, (P+R)*G]."""
  B, _, D = q.shape
  Hkv = k.shape[2]
  Hq = G * Hkv
  BH, C = kv_map.chunk_blk.shape
  rows = kv_map.sorted_t.shape[1] * G  # (P + R) * G
  kernel = functools.partial(_partials_kernel, G=G, Hq=Hq, Hkv=Hkv, R=R, bs=bs, D=D, scale=scale,
                                 has_seg=seg is not None)
  extra = () if seg is None else (seg,)
  return pl.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct((BH, rows, D), partial_dtype), jax.ShapeDtypeStruct((BH, rows), jnp.float32)),
      grid=(BH, C),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="msa_kv_outer_partials",
  )(offset, kv_map.chunk_blk, kv_map.chunk_start, kv_map.chunk_count, kv_map.sorted_t, q, k, v, *extra)


# ---------------------------------------------------------------------------------------------------------------------
# Merge of the partials
# ---------------------------------------------------------------------------------------------------------------------


def _merge_kernel(pair_pos_ref, o_part_ref, lse_part_ref, out_ref, lse_ref, *, G, Hq, Hkv, K, TQ, D):
  bh, tile = pl.program_id(0), pl.program_id(1)
  b, h = bh // Hkv, bh % Hkv
  i = iota(TQ * G)
  t, g = tile * TQ + i // G, i % G

  def slot(s, carry):
    acc, m, l = carry
    p = pair_pos_ref[bh, t * K + s]  # [TQ*G]
    valid = p >= 0
    row = jnp.where(valid, p, 0) * G + g
    lse_s = jnp.where(valid, lse_part_ref[bh, row], -jnp.inf)
    o_s = o_part_ref[(bh, *rows_cols(row, D))].astype(jnp.float32)  # [TQ*G, D]
    o_s = jnp.where(valid[:, None], o_s, 0.0)  # rows of unusable slots are unwritten (may hold NaN)
    m_new = jnp.maximum(m, lse_s)
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha, w = jnp.exp(m - m_use), jnp.exp(lse_s - m_use)
    return acc * alpha[:, None] + w[:, None] * o_s, m_new, l * alpha + w

  init = (jnp.zeros((TQ * G, D), jnp.float32), jnp.full((TQ * G,), -jnp.inf, jnp.float32),
          jnp.zeros((TQ * G,), jnp.float32))
  acc, m, l = jax.lax.fori_loop(0, K, slot, init)
  rows = t * Hq + h * G + g
  out_ref[(b, *rows_cols(rows, D))] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(out_ref.dtype)
  lse_ref[b, rows] = jnp.where(l > 0, jnp.where(m == -jnp.inf, 0.0, m) + jnp.log(l), -jnp.inf)


def merge_partials(pair_pos, o_part, lse_part, *, B, T_pad, Hq, Hkv, K, TQ, out_dtype, interpret, num_warps,
                   num_stages):
  """pair_pos [BH, T_pad*K] -> out [B, T_pad*Hq, D] (out_dtype), lse f32 [B, T_pad*Hq]."""
  G = Hq // Hkv
  D = o_part.shape[-1]
  kernel = functools.partial(_merge_kernel, G=G, Hq=Hq, Hkv=Hkv, K=K, TQ=TQ, D=D)
  return pl.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct((B, T_pad * Hq, D), out_dtype),
                 jax.ShapeDtypeStruct((B, T_pad * Hq), jnp.float32)),
      grid=(B * Hkv, T_pad // TQ),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="msa_merge_partials",
  )(pair_pos, o_part, lse_part)


# ---------------------------------------------------------------------------------------------------------------------
# Query-major baseline
# ---------------------------------------------------------------------------------------------------------------------


def _query_major_kernel(offset_ref, blocks_ref, q_ref, k_ref, v_ref, *refs, G, GP, Hq, Hkv, K, bs, scale, D,
                        has_seg):
  seg_ref = refs[0] if has_seg else None
  out_ref = refs[-1]
  bh, t = pl.program_id(0), pl.program_id(1)
  b, h = bh // Hkv, bh % Hkv
  i = iota(GP)
  # Dots need >= 16 rows: groups smaller than that are padded by repeating the last head (not stored).
  rows = t * Hq + h * G + jnp.minimum(i, G - 1)
  q = q_ref[(b, *rows_cols(rows, D))]  # [GP, D]
  q_pos = jnp.full((GP,), offset_ref[b] + t, jnp.int32)

  def slot(s, carry):
    acc, m, l = carry
    blk = blocks_ref[bh, t * K + s]
    k0 = pl.multiple_of(jnp.maximum(blk, 0) * bs, bs)
    k = k_ref[b, pl.ds(k0, bs), h, :]
    v = v_ref[b, pl.ds(k0, bs), h, :]
    sc = dot(q, k.T) * scale  # [GP, bs]
    vis = visible_mask(q_pos, k0 + iota(bs), jnp.full((GP,), blk >= 0), seg_ref, b, k0, bs)
    sc = jnp.where(vis, sc, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(sc, axis=1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(sc - m_use[:, None])
    alpha = jnp.exp(m - m_use)
    return acc * alpha[:, None] + dot(p.astype(v.dtype), v), m_new, l * alpha + jnp.sum(p, axis=1)

  init = (jnp.zeros((GP, D), jnp.float32), jnp.full((GP,), -jnp.inf, jnp.float32), jnp.zeros((GP,), jnp.float32))
  acc, _, l = jax.lax.fori_loop(0, K, slot, init)
  out = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(out_ref.dtype)
  # Padding rows go to spare rows past the end: a masked scatter with repeated addresses would race in interpret mode.
  rows = jnp.where(i < G, rows, out_ref.shape[1] - GP + i)
  plgpu.store(out_ref.at[(b, *rows_cols(rows, D))], out, mask=(i < G)[:, None])


def query_major_forward(q, k, v, blocks, offset, seg, *, T, G, K, bs, scale, interpret, num_warps, num_stages):
  """q [B, T*Hq, D], blocks int32 [BH, T*K] (-1 = unusable slot) -> out [B, T*Hq + 16, D] (rows past T*Hq unused)."""
  B, _, D = q.shape
  Hkv = k.shape[2]
  Hq = G * Hkv
  kernel = functools.partial(_query_major_kernel, G=G, GP=max(G, 16), Hq=Hq, Hkv=Hkv, K=K, bs=bs, scale=scale,
                                 D=D, has_seg=seg is not None)
  extra = () if seg is None else (seg,)
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((B, q.shape[1] + max(G, 16), D), q.dtype),
      grid=(B * Hkv, T),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="msa_query_major_forward",
  )(offset, blocks, q, k, v, *extra)
