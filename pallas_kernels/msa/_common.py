"""Helpers shared by the MSA implementations (private to the package): sizes, the query offset, packed-sequence
segments, the selection's usable slots, key padding and the Pallas kernels' in-kernel building blocks.

`q_offset` is either a Python int (static: part of the jit cache key, so every distinct value compiles once and
all index arithmetic folds to constants) or an int32 scalar array (dynamic: one compilation serves every value,
which is what a jitted decode loop needs, where the offset is the traced cache length). The implementations take
the two forms as separate arguments, a static `static_offset` and a traced `dyn_offset`, because a tracer cannot be
a static jit argument.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


# ---------------------------------------------------------------------------------------------------------------------
# Query offset and segments (reference, xla)
# ---------------------------------------------------------------------------------------------------------------------


def split_q_offset(q_offset) -> tuple[int | None, jax.Array | None]:
  """q_offset (None, int or int scalar array) -> (static int or None, dynamic int32 [] or None)."""
  if q_offset is None or isinstance(q_offset, numbers.Integral):
    return (None if q_offset is None else int(q_offset)), None
  return None, jnp.asarray(q_offset, jnp.int32)


def resolve_q_offset(static_offset: int | None, dyn_offset: jax.Array | None, T: int, S: int):
  """Position of query 0: the dynamic offset if given, else the static one, else S - T (bottom-right)."""
  if dyn_offset is not None:
    return dyn_offset
  return S - T if static_offset is None else static_offset


def query_segments(segment_ids: jax.Array, q_offset, T: int) -> jax.Array:
  """segment_ids [B, S] -> [B, T]: the segment of query t is that of its slot q_offset + t.

  dynamic_slice works for a static and a traced offset alike; it clamps the start to [0, S - T], which is the
  valid range anyway (the API checks it whenever the offset is concrete).
  """
  return jax.lax.dynamic_slice_in_dim(segment_ids, q_offset, T, axis=1)


# ---------------------------------------------------------------------------------------------------------------------
# Selection and key layout (xla, the KV-outer map, the Pallas wrappers)
# ---------------------------------------------------------------------------------------------------------------------


def usable_slots(idx: jax.Array, num_blocks: int) -> jax.Array:
  """bool [..., K]: slot holds an in-range block id not already held by an earlier slot of the same row.

  The selection contract has no duplicates; dropping repeats here keeps the op a function of the selected *set*
  (as the reference's mask is) instead of silently double-counting a block.
  """
  K = idx.shape[-1]
  earlier = jnp.tril(jnp.ones((K, K), bool), k=-1)  # [slot, other]: other < slot
  repeated = ((idx[..., :, None] == idx[..., None, :]) & earlier).any(-1)
  return (idx >= 0) & (idx < num_blocks) & ~repeated


def pad_keys(x: jax.Array, S_pad: int, fill=0) -> jax.Array:
  """Pads the key axis (1) to S_pad slots (a whole number of blocks); pad keys lie past every query, so causality
  hides them."""
  S = x.shape[1]
  if S_pad == S:
    return x
  pad = [(0, 0)] * x.ndim
  pad[1] = (0, S_pad - S)
  return jnp.pad(x, pad, constant_values=fill)


def row_offsets(q_offset, B: int, S: int, T: int) -> jax.Array:
  """int32 [B]: the slot of query 0 in each batch row. q_offset: None (S - T), an int, a scalar or a [B] array
  (decoding with different cache lengths per row); every kernel reads its row's entry."""
  off = jnp.asarray(S - T if q_offset is None else q_offset, jnp.int32)
  return jnp.broadcast_to(jnp.reshape(off, (-1,)), (B,))


# ---------------------------------------------------------------------------------------------------------------------
# Inside the Pallas kernels
# ---------------------------------------------------------------------------------------------------------------------


def iota(n: int) -> jax.Array:
  """int32 [n]: 0 .. n - 1 (the broadcasted form lowers in Triton kernels)."""
  return jax.lax.broadcasted_iota(jnp.int32, (n,), 0)


def dot(a: jax.Array, b: jax.Array) -> jax.Array:
  """a @ b with f32 accumulation; f32 operands use full precision (Triton would otherwise round them to tf32)."""
  precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=precision)


def visible_mask(q_pos, k_pos, row_ok, seg_ref, b, k0, bs):
  """bool [rows, bs]: causal (key slot <= query slot), a live row, and (with segments) the same segment."""
  vis = (k_pos[None, :] <= q_pos[:, None]) & row_ok[:, None]
  if seg_ref is not None:
    vis &= seg_ref[b, q_pos][:, None] == seg_ref[b, pl.ds(k0, bs)][None, :]
  return vis


def rows_cols(rows: jax.Array, D: int) -> tuple[jax.Array, jax.Array]:
  """Index arrays that pick whole rows `rows [N]` of a [..., rows, D] ref: ([N, 1], [1, D]) -> a [N, D] tile.

  Gathers and scatters are written with an index array on every axis (no `:`), which both Triton (pointer
  arithmetic; the column iota keeps each row's accesses contiguous) and interpret mode (a numpy-style gather) take.
  """
  return rows[:, None], jax.lax.broadcasted_iota(jnp.int32, (1, D), 1)
