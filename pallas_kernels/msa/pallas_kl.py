"""`kl_loss` (sparse target) on Pallas: the indexer's KL alignment over the selected tokens only, KV-outer.

Support I(t, h) = the visible tokens of the blocks selected for (query t, group h). With the main branch's
log-sum-exp over that same support, `lse[t, head]` (what the sparse attention forward computes; pass it as `lse` to
skip recomputing it: the paper's "LSE fusion"), the teacher needs no second normalisation pass:

    P[t, j]  = mean over the G heads of the group of exp(q_head . k_j * scale - lse[t, head])      (sums to 1 on I)
    z[t, j]  = q_idx[t, h] . k_idx[j] * index_scale,     LSE_z[t] = logsumexp over I of z
    KL(t, h) = sum_I P log P - sum_I P z + LSE_z        (the student's log-softmax is z - LSE_z)

Forward: one KV-outer program per chunk of (query, slot) pairs of one block (pallas_map) writes, per pair, four
numbers: max and sum-exp of z over the block's visible keys, sum P log P and sum P z. XLA merges them per row (tiny
arrays: 4 floats per pair). Backward: dL/dz = (softmax_I(z) - P) / (B * T * Hkv) on I, and only q_idx and k_idx
receive gradients (the teacher is a stop-gradient target). One program per chunk of a block's pairs (like the
attention backward) accumulates its share of the block's dk_idx for this group in registers (merge_blocks sums the
chunks of a block) and writes each pair's dq_idx share, which merge_dq sums per query. dk_idx of the shared index
key is summed over the groups by XLA.

Everything is recomputed from q, k, lse, q_idx and k_idx; no T x S array exists at any point. The teacher's
G heads per (query, block) are where the FLOPs are (G dots of [D, block] per pair against one for z): `KLConfig`
says how they are computed.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.msa import pallas as msa_pallas
from pallas_kernels.msa import pallas_bwd
from pallas_kernels.msa._common import dot, iota, pad_keys, row_offsets, rows_cols, visible_mask
from pallas_kernels.msa.pallas_map import build_kv_map, chunk_layout


TEACHERS = ("fused", "loop", "unroll")
FUSED_MAX_TILE = 256  # rows x G of the fused teacher's [rows * G, block] score tile: kept in registers


@dataclasses.dataclass(frozen=True)
class KLConfig:
  """Tiling. `teacher` picks how the group's G heads are averaged (see `_teacher`): "loop" (the default: a device
  loop over the heads, one [rows, D] dot each), "fused" (one [rows * G, D] dot and an exact pooling dot) or
  "unroll" (the loop's dots unrolled in Python). On the H200 at 128K (M3 shape, bf16) the KL forward + backward
  takes 71.7 ms with "loop" and 108.6 ms with "fused" (BENCHMARKS.md); "unroll" compiles f32 inputs' full-precision
  dots as FMA code that grows with every head (the f32 G=16 D=128 family did not compile in 150 s)."""
  block_size: int
  scale: float
  index_scale: float
  interpret: bool
  teacher: str = "loop"
  rows: int = 32  # query pairs per loop step
  steps: int = 8  # forward: steps per program before a hot block is split over another program
  grad_steps: int | None = None  # backward: the same, None = pallas_bwd.backward_chunk's even split
  num_warps: int = 4
  num_stages: int = 1


def _teacher(q_ref, k, lse_ref, b, h, t, vis, rg, *, G, Hq, D, scale, mode):
  """[R, bs] mean over the group's heads of exp(s - lse): the main branch's probabilities on the support.

  t [R] query positions, vis [R, bs] their support in this block. For "fused", rg = (rows, vis_rg, pool): the q rows
  of every (query, head) pair ([R * G], row r * G + g = query r, head g), their support [R * G, bs] and the
  [R, R * G] pooling matrix with 1/G where a row's head block is; one dot scores every head of the tile and the
  pooling dot averages them.
  """
  if mode == "fused":
    rows, vis_rg, pool = rg
    s = dot(q_ref[(b, *rows_cols(rows, D))], k.T) * scale  # [R*G, bs]
    e = jnp.where(vis_rg, jnp.exp(s - lse_ref[b, rows][:, None]), 0.0)
    # 1/G (G a power of two) is exact in bf16, so the pooling is as exact as e's pieces: e split into bf16 terms
    # (8 bits of mantissa each) keeps 16 bits with two terms (16-bit inputs) and all 24 with three (f32 inputs).
    acc = jnp.zeros(vis.shape, jnp.float32)
    for _ in range(3 if q_ref.dtype == jnp.float32 else 2):
      piece = e.astype(jnp.bfloat16)
      acc += dot(pool, piece)
      e = e - piece.astype(jnp.float32)
    return acc

  def head(g, acc):
    rows = t * Hq + h * G + g
    s = dot(q_ref[(b, *rows_cols(rows, D))], k.T) * scale  # [R, bs]
    return acc + jnp.where(vis, jnp.exp(s - lse_ref[b, rows][:, None]), 0.0)

  acc = jnp.zeros(vis.shape, jnp.float32)
  if mode == "loop":
    acc = jax.lax.fori_loop(0, G, head, acc)
  else:
    for g in range(G):
      acc = head(g, acc)
  return acc / G


def _fused_rows(sorted_t_ref, bh, h, first, row_ok_of, q_off, k_pos, seg_ref, b, k0, *, R, G, Hq, bs, mode):
  """The fused teacher's per-head rows of this step (see `_teacher`); None for the other modes."""
  if mode != "fused":
    return None
  pair = iota(R * G)
  r_rg = pair // G  # [R*G]: the query row of each (row, head)
  t_rg = sorted_t_ref[bh, first + r_rg]
  rows = t_rg * Hq + h * G + jax.lax.rem(pair, G)  # [R*G] rows of q [B, T * Hq, D]
  vis_rg = visible_mask(q_off + t_rg, k_pos, row_ok_of(r_rg), seg_ref, b, k0, bs)  # [R*G, bs]
  pool = jnp.where(iota(R)[:, None] == r_rg[None, :], 1.0 / G, 0.0).astype(jnp.bfloat16)  # [R, R*G]
  return rows, vis_rg, pool


def _stats_kernel(offset_ref, chunk_blk_ref, chunk_start_ref, chunk_count_ref, sorted_t_ref, q_ref, k_ref, lse_ref,
                  qi_ref, ki_ref, *refs, G, Hq, Hkv, R, bs, D, di, scale, index_scale, has_seg, teacher):
  seg_ref = refs[0] if has_seg else None
  mz_ref, lz_ref, plogp_ref, pz_ref = refs[-4:]
  bh, c = pl.program_id(0), pl.program_id(1)
  b, h = bh // Hkv, bh % Hkv
  start, count = chunk_start_ref[bh, c], chunk_count_ref[bh, c]
  k0 = pl.multiple_of(chunk_blk_ref[bh, c] * bs, bs)
  k = k_ref[b, pl.ds(k0, bs), h, :]  # [bs, D]
  ki = ki_ref[b, pl.ds(k0, bs), :]  # [bs, di]
  k_pos = k0 + iota(bs)
  r = iota(R)

  def step(it, carry):
    first = start + it * R
    row_ok_of = lambda rr: it * R + rr < count  # noqa: E731
    row_ok = row_ok_of(r)
    t = sorted_t_ref[bh, first + r]  # [R]
    vis = visible_mask(offset_ref[b] + t, k_pos, row_ok, seg_ref, b, k0, bs)
    rg = _fused_rows(sorted_t_ref, bh, h, first, row_ok_of, offset_ref[b], k_pos, seg_ref, b, k0, R=R, G=G, Hq=Hq,
                     bs=bs, mode=teacher)
    p = _teacher(q_ref, k, lse_ref, b, h, t, vis, rg, G=G, Hq=Hq, D=D, scale=scale, mode=teacher)
    z = dot(qi_ref[(b, *rows_cols(t * Hkv + h, di))], ki.T) * index_scale  # [R, bs]
    z = jnp.where(vis, z, -jnp.inf)
    mz = jnp.max(z, axis=1)
    mz_safe = jnp.where(mz == -jnp.inf, 0.0, mz)
    lz = jnp.sum(jnp.exp(z - mz_safe[:, None]), axis=1)
    plogp = jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=1)
    pz = jnp.sum(jnp.where(vis, p * jnp.where(vis, z, 0.0), 0.0), axis=1)
    idx = pl.ds(first, R)
    for ref, val in ((mz_ref, mz), (lz_ref, lz), (plogp_ref, plogp), (pz_ref, pz)):
      plgpu.store(ref.at[bh, idx], val, mask=row_ok)
    return carry

  jax.lax.fori_loop(0, (count + R - 1) // R, step, 0)


def _grad_kernel(offset_ref, chunk_blk_ref, chunk_start_ref, chunk_count_ref, sorted_t_ref, q_ref, k_ref, lse_ref,
                 qi_ref, ki_ref, lse_z_ref, *refs, G, Hq, Hkv, R, bs, D, di, scale, index_scale, has_seg, teacher):
  seg_ref = refs[0] if has_seg else None
  dki_ref, dqi_ref = refs[-2:]
  bh, c = pl.program_id(0), pl.program_id(1)
  b, h = bh // Hkv, bh % Hkv
  start, count = chunk_start_ref[bh, c], chunk_count_ref[bh, c]
  k0 = pl.multiple_of(chunk_blk_ref[bh, c] * bs, bs)
  k = k_ref[b, pl.ds(k0, bs), h, :]
  ki = ki_ref[b, pl.ds(k0, bs), :]
  k_pos = k0 + iota(bs)
  r = iota(R)

  def step(it, dki):
    first = start + it * R
    row_ok_of = lambda rr: it * R + rr < count  # noqa: E731
    row_ok = row_ok_of(r)
    t = sorted_t_ref[bh, first + r]
    vis = visible_mask(offset_ref[b] + t, k_pos, row_ok, seg_ref, b, k0, bs)
    rg = _fused_rows(sorted_t_ref, bh, h, first, row_ok_of, offset_ref[b], k_pos, seg_ref, b, k0, R=R, G=G, Hq=Hq,
                     bs=bs, mode=teacher)
    p = _teacher(q_ref, k, lse_ref, b, h, t, vis, rg, G=G, Hq=Hq, D=D, scale=scale, mode=teacher)
    qi = qi_ref[(b, *rows_cols(t * Hkv + h, di))]  # [R, di]
    z = dot(qi, ki.T) * index_scale
    dz = jnp.where(vis, jnp.exp(z - lse_z_ref[bh, t][:, None]) - p, 0.0)  # [R, bs], before the 1 / (B T Hkv)
    dqi = dot(dz.astype(qi.dtype), ki) * index_scale  # [R, di]
    plgpu.store(dqi_ref.at[bh, pl.ds(first, R), :], dqi, mask=row_ok[:, None])
    return dki + dot(dz.astype(qi.dtype).T, qi)

  dki = jax.lax.fori_loop(0, (count + R - 1) // R, step, jnp.zeros((bs, di), jnp.float32))
  dki_ref[bh, c] = dki * index_scale  # this chunk's share of the block's dk_idx; merge_blocks sums the chunks


def _prepare(q, k, q_idx, k_idx, block_idx, segment_ids, cfg):
  B, T, Hq, D = q.shape
  S, Hkv = k.shape[1], k.shape[2]
  nb = -(-S // cfg.block_size)
  S_pad = nb * cfg.block_size
  pad = lambda x, fill=0: pad_keys(x, S_pad, fill)  # noqa: E731
  seg = None if segment_ids is None else pad(jnp.asarray(segment_ids, jnp.int32), -1)
  kv_map = build_kv_map(block_idx, nb, cfg.rows * cfg.steps, pad=cfg.rows)
  return dict(B=B, T=T, Hq=Hq, D=D, S=S, Hkv=Hkv, G=Hq // Hkv, nb=nb, K=block_idx.shape[-1], di=q_idx.shape[-1],
              q2=q.reshape(B, T * Hq, D), kp=pad(k), qi2=q_idx.reshape(B, T * Hkv, -1), kip=pad(k_idx), seg=seg,
              kv_map=kv_map)


def _common_kw(x, cfg):
  return dict(G=x["G"], Hq=x["Hq"], Hkv=x["Hkv"], R=cfg.rows, bs=cfg.block_size, D=x["D"], di=x["di"],
              scale=cfg.scale, index_scale=cfg.index_scale, has_seg=x["seg"] is not None, teacher=cfg.teacher)


def _call(kernel, grid, out_shape, args, x, cfg, name):
  extra = () if x["seg"] is None else (x["seg"],)
  return pl.pallas_call(
      kernel, out_shape=out_shape, grid=grid, interpret=cfg.interpret, name=name,
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages))(*args, *extra)


def _row_stats(x, lse2, offset, cfg):
  """Per-pair statistics merged per (b, h, t): (LSE_z, sum P log P - sum P z, row has support), all [BH, T]."""
  m = x["kv_map"]
  BH, C = m.chunk_blk.shape
  n = m.sorted_t.shape[1]
  kernel = functools.partial(_stats_kernel, **_common_kw(x, cfg))
  stats = _call(kernel, (BH, C), tuple(jax.ShapeDtypeStruct((BH, n), jnp.float32) for _ in range(4)),
                (offset, m.chunk_blk, m.chunk_start, m.chunk_count, m.sorted_t, x["q2"], x["kp"], lse2, x["qi2"],
                 x["kip"]), x, cfg, "msa_kl_stats")
  valid = m.pair_pos >= 0  # [BH, T*K]
  pos = jnp.where(valid, m.pair_pos, 0)
  mz, lz, plogp, pz = (jnp.take_along_axis(a, pos, axis=1).reshape(BH, x["T"], x["K"]) for a in stats)
  valid = valid.reshape(BH, x["T"], x["K"])
  mz = jnp.where(valid, mz, -jnp.inf)  # unusable slots: unwritten rows of the stats buffers
  lz, plogp, pz = (jnp.where(valid, a, 0.0) for a in (lz, plogp, pz))
  top = jnp.max(mz, axis=-1)
  top_safe = jnp.where(top == -jnp.inf, 0.0, top)
  total = jnp.sum(lz * jnp.exp(mz - top_safe[..., None]), axis=-1)  # [BH, T]
  has = total > 0
  lse_z = jnp.where(has, top_safe + jnp.log(jnp.where(has, total, 1.0)), 0.0)
  return lse_z, jnp.sum(plogp, -1) - jnp.sum(pz, -1), has


def kl_loss(q, k, q_idx, k_idx, block_idx, *, block_size: int, scale: float | None = None,
            index_scale: float | None = None, q_offset=None, segment_ids=None, lse=None,
            interpret: bool | None = None, **knobs) -> jax.Array:
  """f32 scalar; see api.kl_loss (sparse target only). `lse [B, T, Hq]`: the main branch's log-sum-exp over the same
  support, e.g. from `pallas.sparse_attention_with_lse`; None computes it with the attention forward kernels."""
  B, T, Hq, D = q.shape
  S = k.shape[1]
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  G = Hq // k.shape[2]
  teacher = knobs.pop("teacher", "loop")
  if teacher not in TEACHERS:
    raise ValueError(f"teacher={teacher!r}: expected one of {TEACHERS}")
  if teacher == "fused":
    if G & (G - 1):
      raise ValueError(f"teacher='fused' needs a power-of-two group size (exact 1/G in bf16); G = Hq/Hkv = {G}")
    # [rows * G, block] scores stay in registers: as many rows as fit FUSED_MAX_TILE, at least 16 (a dot's M)
    knobs.setdefault("rows", max(16, FUSED_MAX_TILE // G))
    knobs.setdefault("num_warps", 8)
  cfg = KLConfig(block_size=block_size, scale=D ** -0.5 if scale is None else float(scale),
                 index_scale=q_idx.shape[-1] ** -0.5 if index_scale is None else float(index_scale),
                 interpret=interpret, teacher=teacher, **knobs)
  offset = row_offsets(q_offset, B, S, T)
  q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
  block_idx = jnp.asarray(block_idx, jnp.int32)
  if lse is None:
    # The attention forward over the same support; its output is not needed (v = k keeps the shapes).
    _, lse = msa_pallas.sparse_attention_with_lse(q, k, k, block_idx, block_size=block_size, scale=cfg.scale,
                                                  q_offset=offset, segment_ids=segment_ids, interpret=interpret)
  lse = jax.lax.stop_gradient(jnp.asarray(lse, jnp.float32)).reshape(B, T * Hq)
  seg = None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
  return _kl(q, k, q_idx, k_idx, block_idx, offset, seg, lse, cfg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _kl(q, k, q_idx, k_idx, block_idx, offset, seg, lse2, cfg):
  return _kl_fwd(q, k, q_idx, k_idx, block_idx, offset, seg, lse2, cfg)[0]


def _kl_fwd(q, k, q_idx, k_idx, block_idx, offset, seg, lse2, cfg):
  x = _prepare(q, k, q_idx, k_idx, block_idx, seg, cfg)
  lse_z, partial, has = _row_stats(x, lse2, offset, cfg)
  loss = jnp.sum(jnp.where(has, partial + lse_z, 0.0)) / (x["B"] * x["T"] * x["Hkv"])
  return loss, (q, k, q_idx, k_idx, block_idx, offset, seg, lse2, lse_z)


def _kl_bwd(cfg, res, g):
  q, k, q_idx, k_idx, block_idx, offset, seg, lse2, lse_z = res
  x = _prepare(q, k, q_idx, k_idx, block_idx, seg, cfg)
  m = x["kv_map"]
  B, T, Hkv, di = x["B"], x["T"], x["Hkv"], x["di"]
  BH = B * Hkv
  S_pad = x["kp"].shape[1]
  P = T * x["K"]
  chunks = chunk_layout(m.blk_start, m.blk_count, P, pallas_bwd.backward_chunk(BH, P, cfg.rows, cfg.grad_steps))
  C = chunks.blk.shape[1]
  kernel = functools.partial(_grad_kernel, **_common_kw(x, cfg))
  dki_part, dqi_part = _call(
      kernel, (BH, C),
      (jax.ShapeDtypeStruct((BH, C, cfg.block_size, di), jnp.float32),
       jax.ShapeDtypeStruct((BH, m.sorted_t.shape[1], di), jnp.float32)),
      (offset, chunks.blk, chunks.start, chunks.count, m.sorted_t, x["q2"], x["kp"], lse2, x["qi2"], x["kip"],
       lse_z), x, cfg, "msa_kl_grad")
  dki, = pallas_bwd.merge_blocks(chunks, (dki_part,), jnp.float32, interpret=cfg.interpret)
  dki = dki.reshape(B, Hkv, S_pad, di)
  TQ = 128
  T_pad = -(-T // TQ) * TQ
  pair_pos = jnp.pad(m.pair_pos, ((0, 0), (0, (T_pad - T) * x["K"])), constant_values=-1)
  dqi = pallas_bwd.merge_dq(pair_pos, dqi_part, B=B, T_pad=T_pad, Hq=Hkv, Hkv=Hkv, K=x["K"], TQ=TQ,
                            out_dtype=jnp.float32, interpret=cfg.interpret, num_warps=4, num_stages=2)
  coef = g / (B * T * Hkv)
  dq_idx = (dqi[:, :T * Hkv].reshape(q_idx.shape) * coef).astype(q_idx.dtype)
  dk_idx = (jnp.sum(dki, axis=1)[:, :x["S"]] * coef).astype(k_idx.dtype)  # the index key is shared by all groups
  return None, None, dq_idx, dk_idx, None, None, None, None


_kl.defvjp(_kl_fwd, _kl_bwd)
