"""Public MSA ops: input validation, then dispatch on `implementation`.

Validation runs on shapes, dtypes and static arguments only (plus the values of `block_idx` when it is a concrete
array), so a bad call fails here with a message naming the argument instead of deep inside a trace or a compile.

Shapes (see DESIGN.md §2): `q [B, T, Hq, D]`, `k, v [B, S, Hkv, D]`, `q_idx [B, T, Hkv, d_idx]`,
`k_idx [B, S, d_idx]`, `block_idx int32 [B, Hkv, T, topk]`, `segment_ids int [B, S]`. Query t sits at slot
`q_offset + t` (default `S - T`, bottom-right alignment) and sees key j iff `j <= q_offset + t` and, when
`segment_ids` is given (packed sequences), `segment_ids[b, j] == segment_ids[b, q_offset + t]`.

`q_offset` is a Python int (static: each value compiles once, as before) or an int32 scalar array, possibly a
tracer (dynamic: a jitted decode loop passes its cache length). A traced offset cannot be range-checked here; with
an offset out of range the query segments are read from the clamped window `[0, S - T]`.
"""

from __future__ import annotations

import numbers
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.msa import pallas as _pallas
from pallas_kernels.msa import pallas_kl as _pallas_kl
from pallas_kernels.msa import pallas_select as _pallas_select
from pallas_kernels.msa import reference as _reference
from pallas_kernels.msa import xla as _xla

Implementation = Literal["xla", "reference", "pallas"]
_IMPLEMENTATIONS = ("xla", "reference", "pallas")
# Ops with a Pallas implementation (on other backends than GPU "pallas" runs in interpret mode), and those for which
# None resolves to it on a GPU: only kernels that were lowered and measured there.
_PALLAS_OPS = ("sparse_attention", "select_blocks", "kl_loss", "sparse_decode")
_PALLAS_DEFAULT_OPS = ("sparse_attention", "select_blocks")


# ---------------------------------------------------------------------------------------------------------------------
# Validation helpers
# ---------------------------------------------------------------------------------------------------------------------


def _resolve_implementation(implementation: str | None, op: str) -> str:
  """None picks the fastest implementation of `op` on the default backend: the Pallas kernels on a GPU where they
  exist (sparse_attention), else xla."""
  if implementation is None:
    return "pallas" if op in _PALLAS_DEFAULT_OPS and jax.default_backend() == "gpu" else "xla"
  if implementation not in _IMPLEMENTATIONS:
    raise ValueError(f"implementation={implementation!r}: expected None or one of {_IMPLEMENTATIONS}")
  if implementation == "pallas" and op not in _PALLAS_OPS:
    raise NotImplementedError(
        f"{op}(implementation='pallas'): no Pallas kernel for this op yet (only {', '.join(_PALLAS_OPS)}); "
        "use implementation='xla' (any backend) or 'reference' (small sizes only)")
  return implementation


def _check_array(name: str, x, rank: int, layout: str, *, kind: str = "float") -> tuple[int, ...]:
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name}: expected an array {layout}, got {type(x).__name__}")
  shape = tuple(x.shape)
  if len(shape) != rank:
    raise ValueError(f"{name}: shape {shape} has rank {len(shape)}, expected rank {rank} {layout}")
  if kind == "float" and not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{name}: dtype {x.dtype} with shape {shape}, expected a floating dtype")
  if kind == "int" and not jnp.issubdtype(x.dtype, jnp.signedinteger):
    raise TypeError(f"{name}: dtype {x.dtype} with shape {shape}, expected a signed integer dtype (int32)")
  if any(d == 0 for d in shape):
    raise ValueError(f"{name}: shape {shape} has an empty dimension, expected {layout} with all sizes >= 1")
  return shape


def _check_int(name: str, value, *, minimum: int) -> int:
  # bool is an int subclass; `block_size=True` is a bug, not a 1.
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{name}={value!r}: expected a Python int")
  if value < minimum:
    raise ValueError(f"{name}={value}: expected an int >= {minimum}")
  return int(value)


def _check_scale(name: str, value) -> float | None:
  if value is None:
    return None
  try:
    # A static float keeps the jitted implementations cacheable; a traced scale would need a different design.
    return float(value)
  except Exception as e:  # noqa: BLE001 - tracers raise ConcretizationTypeError, objects raise TypeError/ValueError
    raise TypeError(f"{name}={value!r}: expected a Python float or None") from e


def _resolve_q_offset(q_offset, T: int, S: int) -> int | jax.Array:
  """None -> S - T; a Python int is checked and stays static; an int scalar array stays an array (dynamic)."""
  if q_offset is None:
    if T > S:
      raise ValueError(f"q: T={T} queries but only S={S} keys; expected T <= S (queries are the last T positions)")
    return S - T
  if hasattr(q_offset, "shape") and hasattr(q_offset, "dtype"):
    if tuple(q_offset.shape) != () or not jnp.issubdtype(q_offset.dtype, jnp.integer):
      raise TypeError(f"q_offset: array of shape {tuple(q_offset.shape)} and dtype {q_offset.dtype}, expected a "
                      "Python int or a scalar integer array (int32 [])")
    if T > S:
      raise ValueError(f"q: T={T} queries but only S={S} keys; expected T <= S")
    try:
      value = int(np.asarray(q_offset))
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
      # Traced (e.g. the cache length inside a jitted decode loop): the value is only known at run time.
      return jnp.asarray(q_offset, jnp.int32)
    _check_offset_value(value, T, S)
    # A concrete array stays dynamic too: a Python decode loop passing arrays should not compile once per step.
    return jnp.asarray(q_offset, jnp.int32)
  if isinstance(q_offset, bool) or not isinstance(q_offset, numbers.Integral):
    raise TypeError(f"q_offset={q_offset!r}: expected a Python int or a scalar integer array (int32 [])")
  _check_offset_value(int(q_offset), T, S)
  return int(q_offset)


def _check_offset_value(q_offset: int, T: int, S: int) -> None:
  if q_offset < 0:
    raise ValueError(f"q_offset={q_offset}: expected an int >= 0")
  if q_offset + T > S:
    raise ValueError(
        f"q_offset={q_offset} with T={T} queries and S={S} keys: expected q_offset + T <= S "
        f"(q_offset <= {S - T})")


def _check_segment_ids(segment_ids, B: int, S: int):
  """None, or an integer [B, S] array of per-slot segment (document) ids."""
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


def _check_block_idx(block_idx, B: int, Hkv: int, T: int, num_blocks: int) -> None:
  shape = _check_array("block_idx", block_idx, 4, f"[B={B}, Hkv={Hkv}, T={T}, topk]", kind="int")
  if shape[:3] != (B, Hkv, T):
    raise ValueError(f"block_idx: shape {shape}, expected [B={B}, Hkv={Hkv}, T={T}, topk]")
  try:
    values = np.asarray(block_idx)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return  # traced: values are only known at run time; the implementations then ignore out-of-range entries
  lo, hi = int(values.min()), int(values.max())
  if lo < -1 or hi >= num_blocks:
    raise ValueError(
        f"block_idx: shape {shape} has values in [{lo}, {hi}], expected values in [-1, {num_blocks}) "
        f"(-1 = empty slot, {num_blocks} blocks of the keys)")


def _check_qkv(q, k, v=None) -> tuple[int, int, int, int, int, int]:
  B, T, Hq, D = _check_array("q", q, 4, "[B, T, Hq, D]")
  k_shape = _check_array("k", k, 4, f"[B={B}, S, Hkv, D={D}]")
  if k_shape[0] != B or k_shape[3] != D:
    raise ValueError(f"k: shape {k_shape}, expected [B={B}, S, Hkv, D={D}] to match q {tuple(q.shape)}")
  _, S, Hkv, _ = k_shape
  if Hq % Hkv:
    raise ValueError(f"q: Hq={Hq} heads (shape {tuple(q.shape)}) is not a multiple of Hkv={Hkv} (k shape {k_shape})")
  if v is not None:
    v_shape = _check_array("v", v, 4, f"[B={B}, S={S}, Hkv={Hkv}, D={D}]")
    if v_shape != k_shape:
      raise ValueError(f"v: shape {v_shape}, expected the shape of k {k_shape}")
  return B, T, Hq, D, S, Hkv


def _dims(**known) -> str:
  """'[B=2, T, Hkv=4, d_idx]'-style layout string: sizes that are already fixed by other arguments get a value."""
  return "[" + ", ".join(name if size is None else f"{name}={size}" for name, size in known.items()) + "]"


def _check_index(q_idx, k_idx, B: int | None = None, T: int | None = None, Hkv: int | None = None,
                 S: int | None = None) -> tuple[int, int, int, int, int]:
  """Checks q_idx [B, T, Hkv, d_idx] and k_idx [B, S, d_idx]; sizes passed in come from q/k and must match."""
  qi_shape = _check_array("q_idx", q_idx, 4, _dims(B=B, T=T, Hkv=Hkv, d_idx=None))
  want_q = (B or qi_shape[0], T or qi_shape[1], Hkv or qi_shape[2], qi_shape[3])
  if qi_shape != want_q:
    raise ValueError(f"q_idx: shape {qi_shape}, expected {_dims(B=B, T=T, Hkv=Hkv, d_idx=None)} "
                     "(one index head per GQA group)")
  B, T, Hkv, d_idx = want_q
  want_k = _dims(B=B, S=S, d_idx=d_idx)
  ki_shape = _check_array("k_idx", k_idx, 3, want_k)
  if ki_shape != (B, S or ki_shape[1], d_idx):
    raise ValueError(f"k_idx: shape {ki_shape}, expected {want_k} (one index key head shared by all groups)")
  return B, T, Hkv, d_idx, ki_shape[1]


FP8 = jnp.float8_e4m3fn
_FP8_MAX = float(jnp.finfo(FP8).max)  # 448


def quantize_index(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """fp8 (e4m3) copy of index queries or keys with one f32 scale per vector (the last axis): `x ~ x8 * scale`.

  For keys `[B, S, d_idx]` pass the scale `[B, S]` on as `k_idx_scale`; for queries the scale can be dropped (a
  positive per-query factor does not change that query's ranking of the blocks). Halves the bytes of a bf16 index
  cache, which is what one decoding step reads most of.
  """
  amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
  scale = jnp.where(amax > 0, amax / _FP8_MAX, 1.0)
  return (x.astype(jnp.float32) / scale[..., None]).astype(FP8), scale


def _check_k_scale(k_idx_scale, k_idx, B: int, S: int):
  """None, or f32 [B, S]; an fp8 k_idx needs one (its values alone are not the keys)."""
  if k_idx_scale is None:
    if k_idx.dtype == FP8:
      raise ValueError(f"k_idx: dtype {k_idx.dtype} needs k_idx_scale (float [B={B}, S={S}], from quantize_index)")
    return None
  shape = _check_array("k_idx_scale", k_idx_scale, 2, f"[B={B}, S={S}]")
  if shape != (B, S):
    raise ValueError(f"k_idx_scale: shape {shape}, expected [B={B}, S={S}] (one scale per index key)")
  return jnp.asarray(k_idx_scale, jnp.float32)


def _dequantize(q_idx, k_idx, k_scale):
  """What the xla / reference paths score: f32 index q/k with the key scales applied."""
  if k_scale is None and q_idx.dtype != FP8:
    return q_idx, k_idx
  k = k_idx.astype(jnp.float32)
  return q_idx.astype(jnp.float32), k if k_scale is None else k * k_scale[..., None]


def _num_blocks(S: int, block_size: int) -> int:
  return -(-S // block_size)


# ---------------------------------------------------------------------------------------------------------------------
# Public ops
# ---------------------------------------------------------------------------------------------------------------------


def select_blocks(q_idx, k_idx, *, block_size: int, topk: int, local_blocks: int = 1,
                  q_offset: int | jax.Array | None = None, implementation: Implementation | None = None,
                  segment_ids: jax.Array | None = None, k_idx_scale: jax.Array | None = None) -> jax.Array:
  """Per (query, group) top-k KV block selection of the MSA index branch.

  Args:
    q_idx: `[B, T, Hkv, d_idx]` index queries, one head per GQA group.
    k_idx: `[B, S, d_idx]` index keys, one head shared by all groups.
    block_size: keys per block; the last block may be partial when S is not a multiple.
    topk: slots per (query, group); clipped to the number of blocks `ceil(S / block_size)`.
    local_blocks: the query's own block and the `local_blocks - 1` before it are always kept (0 <= it <= topk),
      even when (with segment_ids) an older one holds no key of the query's segment.
    q_offset: position of query 0 (default `S - T`): int, or int32 scalar array (may be traced).
    implementation: None (= "pallas" on a GPU, else "xla"), "xla", "reference" or "pallas" (fused scoring +
      exp-free running top-k, never materialising scores; interpret mode off the GPU).
    segment_ids: optional `int [B, S]` segment id of every key slot (packed documents); None = one segment.
    k_idx_scale: optional `f32 [B, S]` per-key scale, required when k_idx is fp8 (`quantize_index`); q_idx may be
      fp8 as well (no scale needed: it does not change a query's ranking).

  Returns:
    `int32 [B, Hkv, T, min(topk, num_blocks)]`: local blocks first (own block, then older), then the other blocks
    with a visible key by descending max-pooled score `max_{visible j in block} q_idx . k_idx[j]`, then `-1`
    padding. Blocks are anchored to absolute slots, not to segment starts.
  """
  impl = _resolve_implementation(implementation, "select_blocks")
  B, T, _, d_idx, S = _check_index(q_idx, k_idx)
  if implementation is None and impl == "pallas" and not _pallas_select.fits_gpu_kernel(d_idx, block_size):
    impl = "xla"  # the default never fails on a shape the Triton kernel cannot tile
  block_size = _check_int("block_size", block_size, minimum=1)
  topk = _check_int("topk", topk, minimum=1)
  local_blocks = _check_int("local_blocks", local_blocks, minimum=0)
  if local_blocks > topk:
    raise ValueError(f"local_blocks={local_blocks}: expected local_blocks <= topk={topk}")
  q_offset = _resolve_q_offset(q_offset, T, S)
  segment_ids = _check_segment_ids(segment_ids, B, S)
  k_scale = _check_k_scale(k_idx_scale, k_idx, B, S)
  kw = dict(block_size=block_size, topk=topk, local_blocks=local_blocks, q_offset=q_offset, segment_ids=segment_ids)
  if impl == "pallas":
    return _pallas_select.select_blocks(q_idx, k_idx, k_idx_scale=k_scale, **kw)
  fn = _reference.select_blocks if impl == "reference" else _xla.select_blocks
  return fn(*_dequantize(q_idx, k_idx, k_scale), **kw)


def sparse_attention(q, k, v, block_idx, *, block_size: int, scale: float | None = None,
                     q_offset: int | jax.Array | None = None, implementation: Implementation | None = None,
                     segment_ids: jax.Array | None = None) -> jax.Array:
  """Exact softmax attention of each query head over its group's selected blocks, intersected with causality.

  Args:
    q: `[B, T, Hq, D]`; head h reads the selection of group `h // (Hq // Hkv)`.
    k, v: `[B, S, Hkv, D]`.
    block_idx: `int [B, Hkv, T, topk]` block ids; `-1` (empty) slots and repeated ids add nothing.
    block_size: keys per block.
    scale: logit scale, default `1 / sqrt(D)`.
    q_offset: position of query 0 (default `S - T`): int, or int32 scalar array (may be traced).
    implementation: None (= "pallas" on a GPU, else "xla"), "xla", "reference" or "pallas" (Triton on a GPU,
      interpret mode elsewhere: slow, for tests).
    segment_ids: optional `int [B, S]` segment id of every key slot; keys of other segments are masked out.

  Returns:
    `[B, T, Hq, D]` in q's dtype (f32 accumulation); a row that sees no key is 0. Differentiable in q, k, v.
  """
  impl = _resolve_implementation(implementation, "sparse_attention")
  B, T, Hq, D, S, Hkv = _check_qkv(q, k, v)
  if implementation is None and impl == "pallas" and not _pallas.fits_gpu_kernels(Hq // Hkv, D, block_size):
    impl = "xla"  # the default never fails on a shape the Triton kernels cannot tile
  block_size = _check_int("block_size", block_size, minimum=1)
  _check_block_idx(block_idx, B, Hkv, T, _num_blocks(S, block_size))
  scale = _check_scale("scale", scale)
  q_offset = _resolve_q_offset(q_offset, T, S)
  segment_ids = _check_segment_ids(segment_ids, B, S)
  if impl == "pallas" and jax.default_backend() == "gpu":
    _pallas.check_gpu_shapes(Hq // Hkv, D, block_size)
  fn = {"reference": _reference.sparse_attention, "xla": _xla.sparse_attention,
        "pallas": _pallas.sparse_attention}[impl]
  return fn(q, k, v, jnp.asarray(block_idx, jnp.int32), block_size=block_size, scale=scale, q_offset=q_offset,
            segment_ids=segment_ids)


def sparse_attention_with_lse(q, k, v, block_idx, *, block_size: int, scale: float | None = None,
                              q_offset: int | jax.Array | None = None, segment_ids: jax.Array | None = None):
  """`sparse_attention` on the Pallas kernels that also returns each row's log-sum-exp over its support.

  Returns:
    (out `[B, T, Hq, D]`, lse `f32 [B, T, Hq]`, `-inf` for a row that sees no key). Differentiable in q, k, v
    through `out`; lse is a constant for differentiation. Pass lse to `kl_loss(..., lse=lse)` so that the KL
    reuses the main branch's normaliser instead of running the attention forward a second time ("LSE fusion").
  """
  B, T, Hq, D, S, Hkv = _check_qkv(q, k, v)
  block_size = _check_int("block_size", block_size, minimum=1)
  _check_block_idx(block_idx, B, Hkv, T, _num_blocks(S, block_size))
  scale = _check_scale("scale", scale)
  q_offset = _resolve_q_offset(q_offset, T, S)
  segment_ids = _check_segment_ids(segment_ids, B, S)
  if jax.default_backend() == "gpu":
    _pallas.check_gpu_shapes(Hq // Hkv, D, block_size)
  return _pallas.sparse_attention_with_lse(q, k, v, jnp.asarray(block_idx, jnp.int32), block_size=block_size,
                                           scale=scale, q_offset=q_offset, segment_ids=segment_ids)


def kl_loss(q, k, q_idx, k_idx, block_idx, *, block_size: int, scale: float | None = None,
            index_scale: float | None = None, q_offset: int | jax.Array | None = None,
            implementation: Implementation | None = None, segment_ids: jax.Array | None = None,
            lse: jax.Array | None = None) -> jax.Array:
  """KL alignment loss that trains the index branch toward the main branch's attention.

  Args:
    q: `[B, T, Hq, D]`, k: `[B, S, Hkv, D]`: the main branch (teacher; no gradient flows into them).
    q_idx: `[B, T, Hkv, d_idx]`, k_idx: `[B, S, d_idx]`: the index branch (student).
    block_idx: `int [B, Hkv, T, topk]`, or None for the dense warmup target over the whole visible history.
    block_size: keys per block (unused when block_idx is None, still validated).
    scale: main logit scale, default `1 / sqrt(D)`.
    index_scale: index logit scale, default `1 / sqrt(d_idx)`.
    q_offset: position of query 0 (default `S - T`): int, or int32 scalar array (may be traced).
    implementation: None (= "xla"), "xla", "reference" or "pallas" (sparse target only, KV-outer over the selected
      tokens; the dense warmup target runs on xla; interpret mode off the GPU; not yet the GPU default).
    segment_ids: optional `int [B, S]` segment id of every key slot; the support keeps the query's segment only.
    lse: optional `f32 [B, T, Hq]` the main branch's log-sum-exp over the same support, from
      `sparse_attention_with_lse` with the same block_idx (LSE fusion; used by "pallas", ignored by the others,
      which normalise the teacher themselves). Must come from the same q, k, scale and selection.

  Returns:
    f32 scalar `mean_{b, t, group} KL(P || P_idx)` on the support I = visible tokens of the selected blocks, with
    `P = mean_{heads of the group} softmax_I(q_h . k * scale)` (stop-gradient) and
    `P_idx = softmax_I(q_idx . k_idx * index_scale)`. Every (b, t, group) row counts in the mean; a row with an
    empty support contributes 0. d loss / d index_logits = (P_idx - P) / (B * T * Hkv).
  """
  impl = _resolve_implementation(implementation, "kl_loss")
  B, T, _, _, S, Hkv = _check_qkv(q, k)
  _check_index(q_idx, k_idx, B, T, Hkv, S)
  block_size = _check_int("block_size", block_size, minimum=1)
  if block_idx is not None:
    _check_block_idx(block_idx, B, Hkv, T, _num_blocks(S, block_size))
    block_idx = jnp.asarray(block_idx, jnp.int32)
  scale = _check_scale("scale", scale)
  index_scale = _check_scale("index_scale", index_scale)
  q_offset = _resolve_q_offset(q_offset, T, S)
  segment_ids = _check_segment_ids(segment_ids, B, S)
  if lse is not None:
    lse_shape = _check_array("lse", lse, 3, f"[B={B}, T={T}, Hq={q.shape[2]}]")
    if lse_shape != (B, T, q.shape[2]):
      raise ValueError(f"lse: shape {lse_shape}, expected [B={B}, T={T}, Hq={q.shape[2]}] "
                       "(from sparse_attention_with_lse)")
  if impl == "pallas" and block_idx is not None:
    return _pallas_kl.kl_loss(q, k, q_idx, k_idx, block_idx, block_size=block_size, scale=scale,
                              index_scale=index_scale, q_offset=q_offset, segment_ids=segment_ids, lse=lse)
  # The dense warmup target (block_idx=None) has no Pallas kernel: it runs on xla.
  fn = _reference.kl_loss if impl == "reference" else _xla.kl_loss
  return fn(q, k, q_idx, k_idx, block_idx, block_size=block_size, scale=scale, index_scale=index_scale,
            q_offset=q_offset, segment_ids=segment_ids)


def sparse_decode(q, k_cache, v_cache, q_idx, k_idx_cache, lengths, *, block_size: int, topk: int,
                  local_blocks: int = 1, scale: float | None = None,
                  implementation: Implementation | None = None,
                  k_idx_scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """One MSA decoding step for a batch of sequences with caches of different fill levels.

  Args:
    q: `[B, T, Hq, D]` the T new tokens of each sequence (1 <= T <= 16: one token, or a few speculative / MTP
      drafts), already written into the caches.
    k_cache, v_cache: `[B, S_max, Hkv, D]`; k_idx_cache: `[B, S_max, d_idx]` the index keys (one head).
    q_idx: `[B, T, Hkv, d_idx]` the new tokens' index queries.
    lengths: `int [B]` filled slots per sequence, the new tokens included: token t of row b sits at slot
      `lengths[b] - T + t`, and slots >= lengths[b] (unwritten) are never read into the result.
    block_size, topk, local_blocks, scale: as in select_blocks / sparse_attention.
    implementation: None (= "xla"), "xla", "reference" or "pallas" (fused selection + query-major attention kernel:
      interpret mode off the GPU).
    k_idx_scale: `f32 [B, S_max]` per-key scales of an fp8 index-key cache (`quantize_index`); required when
      k_idx_cache is fp8, whose bytes are then half of a bf16 cache's.

  Returns:
    (out `[B, T, Hq, D]`, block_idx `int32 [B, Hkv, T, min(topk, ceil(S_max / block_size))]`): exactly what
    select_blocks + sparse_attention give on each row's own cache prefix.
  """
  impl = _resolve_implementation(implementation, "sparse_decode")
  B, T, Hq, D, S, Hkv = _check_qkv(q, k_cache, v_cache)
  if T > 16:
    raise ValueError(f"q: shape {tuple(q.shape)} has T={T} new tokens per sequence, expected 1 <= T <= 16 "
                     "(use select_blocks + sparse_attention with q_offset for chunked prefill)")
  _check_index(q_idx, k_idx_cache, B, T, Hkv, S)
  block_size = _check_int("block_size", block_size, minimum=1)
  topk = _check_int("topk", topk, minimum=1)
  local_blocks = _check_int("local_blocks", local_blocks, minimum=0)
  if local_blocks > topk:
    raise ValueError(f"local_blocks={local_blocks}: expected local_blocks <= topk={topk}")
  scale = _check_scale("scale", scale)
  if not hasattr(lengths, "shape") or tuple(lengths.shape) != (B,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"lengths: expected an integer array [B={B}], got "
                     f"{getattr(lengths, 'shape', type(lengths).__name__)} {getattr(lengths, 'dtype', '')}")
  try:
    values = np.asarray(lengths)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    values = None
  if values is not None and (values.min() < T or values.max() > S):
    raise ValueError(f"lengths: values in [{values.min()}, {values.max()}], expected T={T} <= lengths <= "
                     f"S_max={S} (the new tokens are in the cache)")
  offsets = jnp.asarray(lengths, jnp.int32) - T
  k_scale = _check_k_scale(k_idx_scale, k_idx_cache, B, S)
  if impl == "pallas":
    # Few queries over a long cache: split the blocks over programs (>= 16 blocks each) to use the whole GPU.
    splits = max(1, min(128, _num_blocks(S, block_size) // 16))
    block_idx = _pallas_select.select_blocks(q_idx, k_idx_cache, block_size=block_size, topk=topk,
                                             local_blocks=local_blocks, q_offset=offsets, key_splits=splits,
                                             k_idx_scale=k_scale, query_tile=64, num_warps=4)
    out = _pallas.sparse_attention_query_major(q, k_cache, v_cache, block_idx, block_size=block_size, scale=scale,
                                               q_offset=offsets)
    return out, block_idx

  q_idx, k_idx_cache = _dequantize(q_idx, k_idx_cache, k_scale)

  def row(qb, kb, vb, qib, kib, off):
    sel = select_blocks(qib[None], kib[None], block_size=block_size, topk=topk, local_blocks=local_blocks,
                        q_offset=off, implementation=impl)
    out = sparse_attention(qb[None], kb[None], vb[None], sel, block_size=block_size, scale=scale, q_offset=off,
                           implementation=impl)
    return out[0], sel[0]

  return jax.vmap(row)(q, k_cache, v_cache, q_idx, k_idx_cache, offsets)
