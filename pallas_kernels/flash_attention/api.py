"""Public flash attention: input validation, then dispatch on `implementation`.

Validation runs on shapes, dtypes and static arguments only (plus the value of `q_offset` when it is concrete), so a
bad call fails here with a message naming the argument instead of deep inside a trace or a compile.

Shapes: `q [B, T, Hq, D]`, `k, v [B, S, Hkv, D]` with Hq a multiple of Hkv (query head h reads kv head
h // (Hq // Hkv)), `segment_ids int [B, S]`. Query t sits at slot `q_offset + t` (default `S - T`, bottom-right
alignment) and sees key j iff `j <= q_offset + t` and, when `segment_ids` is given (packed documents),
`segment_ids[b, j] == segment_ids[b, q_offset + t]`.

`q_offset` is a Python int or an int32 scalar array, possibly a tracer: with context parallelism each device computes
the offset of its local queries from `jax.lax.axis_index` inside `jax.shard_map`. A traced offset cannot be
range-checked here; with an offset out of range the query segments are read from the clamped window `[0, S - T]`,
and a query whose position is below 0 sees no key (its output is 0).
"""

from __future__ import annotations

import numbers
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.flash_attention import reference as _reference
from pallas_kernels.flash_attention import xla as _xla

Implementation = Literal["xla", "reference"]
IMPLEMENTATIONS = ("xla", "reference")


def _check_qkv(q, k, v) -> tuple[int, int, int, int, int, int]:
  """-> (B, T, Hq, D, S, Hkv) of q [B, T, Hq, D], k, v [B, S, Hkv, D]."""
  for name, x, layout in (("q", q, "[B, T, Hq, D]"), ("k", k, "[B, S, Hkv, D]"), ("v", v, "[B, S, Hkv, D]")):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"{name}: expected an array {layout}, got {type(x).__name__}")
    shape = tuple(x.shape)
    if len(shape) != 4:
      raise ValueError(f"{name}: shape {shape} has rank {len(shape)}, expected rank 4 {layout}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name}: dtype {x.dtype} with shape {shape}, expected a floating dtype")
    if 0 in shape:
      raise ValueError(f"{name}: shape {shape} has an empty dimension, expected {layout} with all sizes >= 1")
  B, T, Hq, D = q.shape
  B_k, S, Hkv, D_k = k.shape
  if (B_k, D_k) != (B, D):
    raise ValueError(f"k: shape {tuple(k.shape)}, expected [B={B}, S, Hkv, D={D}] to match q {tuple(q.shape)}")
  if Hq % Hkv:
    raise ValueError(f"q: Hq={Hq} heads (shape {tuple(q.shape)}) is not a multiple of Hkv={Hkv} "
                     f"(k shape {tuple(k.shape)})")
  if tuple(v.shape) != tuple(k.shape):
    raise ValueError(f"v: shape {tuple(v.shape)}, expected the shape of k {tuple(k.shape)}")
  if not q.dtype == k.dtype == v.dtype:
    # One dtype for the three: the block matmuls then run in it (bf16 in, f32 accumulation) with no silent upcast.
    raise TypeError(f"k, v: dtypes {k.dtype}, {v.dtype}, expected the dtype of q ({q.dtype})")
  return B, T, Hq, D, S, Hkv


def _check_offset_value(q_offset: int, T: int, S: int) -> None:
  if q_offset < 0 or q_offset + T > S:
    raise ValueError(f"q_offset={q_offset} with T={T} queries and S={S} keys: expected 0 <= q_offset <= S - T = "
                     f"{S - T} (every query slot q_offset + t must be a key slot)")


def _resolve_q_offset(q_offset, T: int, S: int) -> int | jax.Array:
  """None -> S - T; a Python int is range-checked; an int scalar array is range-checked when concrete and stays an
  array (traced or not: one compilation serves every value)."""
  if T > S:
    raise ValueError(f"q: T={T} queries but k has only S={S} keys; expected T <= S (queries are T of the S slots)")
  if q_offset is None:
    return S - T
  if hasattr(q_offset, "shape") and hasattr(q_offset, "dtype"):
    if tuple(q_offset.shape) != () or not jnp.issubdtype(q_offset.dtype, jnp.integer):
      raise TypeError(f"q_offset: array of shape {tuple(q_offset.shape)} and dtype {q_offset.dtype}, expected a "
                      "Python int or a scalar integer array (int32 [])")
    try:
      value = int(np.asarray(q_offset))
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
      return q_offset  # traced (e.g. from jax.lax.axis_index inside a shard_map): known at run time only
    _check_offset_value(value, T, S)
    return q_offset
  # bool is an int subclass; q_offset=True is a bug, not a 1.
  if isinstance(q_offset, bool) or not isinstance(q_offset, numbers.Integral):
    raise TypeError(f"q_offset={q_offset!r}: expected None, a Python int or a scalar integer array (int32 [])")
  _check_offset_value(int(q_offset), T, S)
  return int(q_offset)


def _check_segment_ids(segment_ids, B: int, S: int):
  if segment_ids is None:
    return None
  layout = f"[B={B}, S={S}]"
  if not hasattr(segment_ids, "shape") or not hasattr(segment_ids, "dtype"):
    raise TypeError(f"segment_ids: expected None or an integer array {layout}, got {type(segment_ids).__name__}")
  shape = tuple(segment_ids.shape)
  if shape != (B, S):
    raise ValueError(f"segment_ids: shape {shape}, expected {layout} (one segment id per key slot)")
  if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
    raise TypeError(f"segment_ids: dtype {segment_ids.dtype} with shape {shape}, expected an integer dtype")
  return jnp.asarray(segment_ids)


def _check_scale(scale) -> float | None:
  if scale is None:
    return None
  if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
    # A static float keeps the compiled function cacheable; a traced scale would be a different design.
    raise TypeError(f"scale={scale!r}: expected None or a Python float")
  return float(scale)


def _check_block(name: str, value) -> int | None:
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{name}={value!r}: expected None or a Python int >= 1")
  if value < 1:
    raise ValueError(f"{name}={value}: expected None or an int >= 1")
  return int(value)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, q_offset: int | jax.Array | None = None,
                    segment_ids: jax.Array | None = None, scale: float | None = None,
                    implementation: Implementation = "xla", block_q: int | None = None,
                    block_k: int | None = None) -> jax.Array:
  """Dense causal GQA attention of T queries over S keys, without a T x S array (implementation "xla").

  Args:
    q: `[B, T, Hq, D]` queries; Hq a multiple of Hkv, query head h reads kv head h // (Hq // Hkv).
    k, v: `[B, S, Hkv, D]` keys and values, in q's dtype (f32 or bf16: matmuls accumulate in f32).
    q_offset: slot of query 0 (default `S - T`): a Python int in [0, S - T], or an int32 scalar array (may be traced,
      e.g. `jax.lax.axis_index(...) * T` inside a `jax.shard_map`; then it is not range-checked).
    segment_ids: optional `int [B, S]` segment (document) id of every slot; None = one segment.
    scale: logit scale, default `1 / sqrt(D)`.
    implementation: "xla" (blockwise, memory O(block_q * block_k) beyond inputs, outputs and gradients) or
      "reference" (the whole [B, Hkv, G, T, S] score matrix in f32: small sizes only).
    block_q, block_k: query rows / key slots per block of "xla" (default 512 each, capped by T and S); ignored by
      "reference".

  Returns:
    `[B, T, Hq, D]` in q.dtype: `out[b, t, h] = sum_j softmax_j(scale * q[b, t, h] . k[b, j, h // G]) v[b, j, h // G]`
    over the keys j visible to query t (`j <= q_offset + t`, same segment). A query that sees no key (possible only
    with a traced offset below 0: every query sees at least its own slot) gives 0, with zero gradients.
    Differentiable in q, k and v.
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation={implementation!r}: expected one of {IMPLEMENTATIONS}")
  B, T, _, _, S, _ = _check_qkv(q, k, v)
  q_offset = _resolve_q_offset(q_offset, T, S)
  segment_ids = _check_segment_ids(segment_ids, B, S)
  scale = _check_scale(scale)
  block_q = _check_block("block_q", block_q)
  block_k = _check_block("block_k", block_k)
  if implementation == "reference":
    return _reference.flash_attention(q, k, v, q_offset=q_offset, segment_ids=segment_ids,
                                      scale=q.shape[3] ** -0.5 if scale is None else scale)
  return _xla.flash_attention(q, k, v, q_offset=q_offset, segment_ids=segment_ids, scale=scale, block_q=block_q,
                              block_k=block_k)
