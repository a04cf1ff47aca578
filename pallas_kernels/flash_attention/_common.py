"""Helpers shared by the flash-attention implementations (private to the package)."""

from __future__ import annotations

import jax


def query_segments(segment_ids: jax.Array, q_offset, T: int) -> jax.Array:
  """segment_ids [B, S] -> [B, T]: the segment of query t is that of its slot q_offset + t.

  dynamic_slice serves a static and a traced offset alike; it clamps the start to [0, S - T], the valid range (the
  API checks it whenever the offset is concrete).
  """
  return jax.lax.dynamic_slice_in_dim(segment_ids, q_offset, T, axis=1)
