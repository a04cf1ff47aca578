"""Helpers shared by the reference and XLA implementations: the query offset and packed-sequence segments.

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
