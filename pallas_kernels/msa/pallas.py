"""`sparse_attention` on Pallas (Triton backend): KV-outer forward and backward under one `jax.custom_vjp`.

Same function as `reference.sparse_attention` / `xla.sparse_attention` (see api.sparse_attention for the contract):
exact softmax attention of each query head over its group's selected blocks, intersected with causality (and the
query's segment when `segment_ids` is given).

Pipeline (pallas_map, pallas_fwd, pallas_bwd):
  forward   selection -> KV-outer map (XLA sort) -> per-pair partials (Pallas) -> merge by log-sum-exp (Pallas)
  backward  delta = rowsum(dO * O) (XLA) -> dK, dV per block + per-pair dQ (Pallas) -> dQ merge (Pallas)
The map is built once in the forward and kept as a residual for the backward.

On a GPU the kernels compile through Triton; anywhere else they run in Pallas interpret mode (slow, for tests at
small sizes). Triton needs power-of-two tiles and dot dimensions >= 16: block_size and head_dim must be powers of two
>= 16 and G = Hq / Hkv a power of two; `sparse_attention` checks this before anything is traced. Interpret mode has
no such limits, so CPU tests also cover odd shapes; every shape family must still be lowered once on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.msa import pallas_bwd, pallas_fwd
from pallas_kernels.msa._common import cdiv, pad_keys, row_offsets, usable_slots
from pallas_kernels.msa.pallas_map import build_kv_map, chunk_layout


def _pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Static knobs of the Pallas kernels (hashable: part of the jit cache key).

  rows: query rows (pairs x G heads) per KV-outer forward step; fwd_steps: steps per forward program (a program
    loads its KV block once for up to fwd_steps * rows rows); bwd_rows: rows per backward loop step; bwd_steps:
    steps per backward program (None: as many as split the pairs into about 1024 programs, see
    pallas_bwd.backward_chunk); merge_rows: query rows per merge program. rows / bwd_rows None = by dtype: the
    H200's 227 KB of shared memory per program holds a 128-row bf16 forward tile but only a 64-row backward
    step (q, dO, K, V and the transposed P and dS tiles all live there); f32 halves both.
  partial_dtype: dtype of the per-pair forward partials; None = q's dtype (each partial is normalised before it is
    rounded, and the merge weights are f32).
  dq_dtype: dtype of the per-pair dQ partials, None = q's dtype (each partial is a sum over one block in f32,
    rounded once, then the merge sums them in f32); bf16 halves the backward's largest temporary
    (T * topk * Hq * D elements: 32 GiB at 128K tokens in the M3 shape).
  """
  block_size: int
  scale: float
  interpret: bool
  rows: int | None = None
  fwd_steps: int = 8
  fwd_stages: int = 1
  bwd_rows: int | None = None
  bwd_steps: int | None = None
  merge_rows: int = 128
  partial_dtype: str | None = None
  dq_dtype: str | None = None
  num_warps: int = 4
  bwd_warps: int = 8
  bwd_stages: int = 1
  merge_warps: int = 4
  merge_stages: int = 2

  def fwd_rows(self, dtype) -> int:
    return self.rows or (128 if jnp.dtype(dtype).itemsize <= 2 else 64)

  def bwd_rows_for(self, dtype) -> int:
    return self.bwd_rows or (64 if jnp.dtype(dtype).itemsize <= 2 else 32)


def fits_gpu_kernels(G: int, D: int, block_size: int) -> bool:
  try:
    check_gpu_shapes(G, D, block_size)
  except ValueError:
    return False
  return True


def check_gpu_shapes(G: int, D: int, block_size: int) -> None:
  """Triton's tile rules, checked before tracing so the error names the argument instead of a lowering failure."""
  if not _pow2(block_size) or block_size < 16:
    raise ValueError(f"block_size={block_size}: the Pallas GPU kernels need a power of two >= 16 "
                     "(use implementation='xla' for other block sizes)")
  if not _pow2(D) or D < 16:
    raise ValueError(f"q: head dim D={D}, the Pallas GPU kernels need a power of two >= 16")
  if not _pow2(G) or G > 128:
    raise ValueError(f"q: G = Hq / Hkv = {G} query heads per KV head, the Pallas GPU kernels need a power of two "
                     "<= 128")


def sparse_attention(q, k, v, block_idx, *, block_size: int, scale: float | None = None, q_offset=None,
                     segment_ids=None, interpret: bool | None = None, **knobs) -> jax.Array:
  """[B, T, Hq, D]; see api.sparse_attention. `knobs` override KernelConfig fields (benchmarks, tests)."""
  return sparse_attention_with_lse(q, k, v, block_idx, block_size=block_size, scale=scale, q_offset=q_offset,
                                   segment_ids=segment_ids, interpret=interpret, **knobs)[0]


def sparse_attention_with_lse(q, k, v, block_idx, *, block_size: int, scale: float | None = None, q_offset=None,
                              segment_ids=None, interpret: bool | None = None, **knobs):
  """(out [B, T, Hq, D], lse f32 [B, T, Hq]): also the log-sum-exp of each row over its support (-inf for a row
  that sees no key), which the KL kernel reuses. lse is a constant for differentiation (its cotangent is dropped)."""
  B, T, Hq, D = q.shape
  S, Hkv = k.shape[1], k.shape[2]
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  if not interpret:
    check_gpu_shapes(Hq // Hkv, D, block_size)
  cfg = KernelConfig(block_size=block_size, scale=D ** -0.5 if scale is None else float(scale),
                     interpret=interpret, **knobs)
  offset = row_offsets(q_offset, B, S, T)
  seg = None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
  return _attention(q, k, v, jnp.asarray(block_idx, jnp.int32), offset, seg, cfg)


# ---------------------------------------------------------------------------------------------------------------------
# custom_vjp
# ---------------------------------------------------------------------------------------------------------------------


def _shapes(q, k, block_idx, cfg):
  B, T, Hq, D = q.shape
  S, Hkv = k.shape[1], k.shape[2]
  G, K = Hq // Hkv, block_idx.shape[-1]
  nb = cdiv(S, cfg.block_size)
  R = max(1, cfg.fwd_rows(q.dtype) // G)
  TQ = max(1, cfg.merge_rows // G)
  return B, T, Hq, D, S, Hkv, G, K, nb, R, TQ, cdiv(T, TQ) * TQ


def _forward(q, k, v, block_idx, offset, seg, cfg):
  B, T, Hq, D, S, Hkv, G, K, nb, R, TQ, T_pad = _shapes(q, k, block_idx, cfg)
  S_pad = nb * cfg.block_size
  kp, vp = pad_keys(k, S_pad), pad_keys(v, S_pad)
  segp = None if seg is None else pad_keys(seg, S_pad, fill=-1)
  kv_map = build_kv_map(block_idx, nb, R * cfg.fwd_steps, pad=max(R, max(1, cfg.bwd_rows_for(q.dtype) // G)))
  q2 = q.reshape(B, T * Hq, D)  # [B, T*Hq, D]: row t * Hq + head
  partial_dtype = q.dtype if cfg.partial_dtype is None else jnp.dtype(cfg.partial_dtype)
  o_part, lse_part = pallas_fwd.kv_outer_partials(
      q2, kp, vp, kv_map, offset, segp, G=G, R=R, bs=cfg.block_size, scale=cfg.scale, partial_dtype=partial_dtype,
      interpret=cfg.interpret, num_warps=cfg.num_warps, num_stages=cfg.fwd_stages)
  pair_pos = jnp.pad(kv_map.pair_pos, ((0, 0), (0, (T_pad - T) * K)), constant_values=-1)  # [BH, T_pad*K]
  out, lse = pallas_fwd.merge_partials(
      pair_pos, o_part, lse_part, B=B, T_pad=T_pad, Hq=Hq, Hkv=Hkv, K=K, TQ=TQ, out_dtype=q.dtype,
      interpret=cfg.interpret, num_warps=cfg.merge_warps, num_stages=cfg.merge_stages)
  out = out[:, :T * Hq].reshape(B, T, Hq, D)
  lse = lse[:, :T * Hq]
  # k, v are kept unpadded (the backward pads them again) so that the backward knows S from their shapes.
  return (out, lse.reshape(B, T, Hq)), (q2, k, v, out, lse, kv_map, pair_pos, offset, segp)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention(q, k, v, block_idx, offset, seg, cfg):
  return _forward(q, k, v, block_idx, offset, seg, cfg)[0]


def _attention_fwd(q, k, v, block_idx, offset, seg, cfg):
  return _forward(q, k, v, block_idx, offset, seg, cfg)


def _attention_bwd(cfg, res, cotangents):
  do, _ = cotangents  # lse is a constant
  q2, k, v, out, lse, kv_map, pair_pos, offset, segp = res
  B, T, Hq, D = out.shape
  S, Hkv = k.shape[1], k.shape[2]
  S_pad = kv_map.blk_start.shape[1] * cfg.block_size
  kp, vp = pad_keys(k, S_pad), pad_keys(v, S_pad)
  G, K = Hq // Hkv, kv_map.pair_pos.shape[1] // T
  R, TQ = max(1, cfg.bwd_rows_for(q2.dtype) // G), max(1, cfg.merge_rows // G)
  T_pad = cdiv(T, TQ) * TQ
  delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1).reshape(B, T * Hq)  # [B, T*Hq]
  dq_dtype = q2.dtype if cfg.dq_dtype is None else jnp.dtype(cfg.dq_dtype)
  P = T * K
  chunks = chunk_layout(kv_map.blk_start, kv_map.blk_count, P,
                        pallas_bwd.backward_chunk(B * Hkv, P, R, cfg.bwd_steps))
  dk, dv, dq_part = pallas_bwd.kv_outer_backward(
      q2, kp, vp, do.reshape(B, T * Hq, D).astype(q2.dtype), lse, delta, kv_map, chunks, offset, segp, G=G, R=R,
      bs=cfg.block_size, scale=cfg.scale, dq_dtype=dq_dtype, interpret=cfg.interpret,
      num_warps=cfg.bwd_warps, num_stages=cfg.bwd_stages)
  dq = pallas_bwd.merge_dq(pair_pos, dq_part, B=B, T_pad=T_pad, Hq=Hq, Hkv=Hkv, K=K, TQ=TQ, out_dtype=q2.dtype,
                           interpret=cfg.interpret, num_warps=cfg.merge_warps, num_stages=cfg.merge_stages)
  dq = dq[:, :T * Hq].reshape(B, T, Hq, D)
  return dq, dk[:, :S], dv[:, :S], None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


# ---------------------------------------------------------------------------------------------------------------------
# Query-major baseline (forward only)
# ---------------------------------------------------------------------------------------------------------------------


def sparse_attention_query_major(q, k, v, block_idx, *, block_size: int, scale: float | None = None, q_offset=None,
                                 segment_ids=None, interpret: bool | None = None, num_warps: int = 4,
                                 num_stages: int = 2) -> jax.Array:
  """The simple kernel: one program per (query, group) over its K blocks. Forward only; benchmarks and tests."""
  B, T, Hq, D = q.shape
  S, Hkv = k.shape[1], k.shape[2]
  K = block_idx.shape[-1]
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  if not interpret:
    check_gpu_shapes(Hq // Hkv, D, block_size)
  nb = cdiv(S, block_size)
  S_pad = nb * block_size
  block_idx = jnp.asarray(block_idx, jnp.int32)
  blocks = jnp.where(usable_slots(block_idx, nb), block_idx, -1).reshape(B * Hkv, T * K)
  offset = row_offsets(q_offset, B, S, T)
  seg = None if segment_ids is None else pad_keys(jnp.asarray(segment_ids, jnp.int32), S_pad, fill=-1)
  out = pallas_fwd.query_major_forward(
      q.reshape(B, T * Hq, D), pad_keys(k, S_pad), pad_keys(v, S_pad), blocks, offset, seg, T=T, G=Hq // Hkv,
      K=K, bs=block_size, scale=D ** -0.5 if scale is None else float(scale), interpret=interpret,
      num_warps=num_warps, num_stages=num_stages)
  return out[:, :T * Hq].reshape(B, T, Hq, D)
