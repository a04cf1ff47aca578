"""A zero that depends on an array's values, for the XLA implementations' positions and masks.

Why: under an outer `jax.lax.scan` (the model's scanned layer stacks) JAX's partial evaluation hoists out of the loop
any work that depends on nothing the loop carries, and keeps its results for the backward. The causal masks of a
blockwise or chunked kernel are built from the query offset and iotas alone, so they were hoisted out of the kernels'
own loops too and stored for every (query block, key block) pair: [nq, nk, ..., bq, bk] bools and f32 fills, 2 TiB
per device for M3's dense layers at 1M tokens over 16 devices. Adding `carried_zero(q)` to the offset ties the masks
to the layer's input, so they stay inside the loops and are rebuilt block by block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def carried_zero(x: jax.Array) -> jax.Array:
  """An int32 0 computed from x's first element (its bits AND 0: exactly 0 for every value, NaN and inf included)."""
  bits = jax.lax.bitcast_convert_type(x.reshape(-1)[0], jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
  return (bits & 0).astype(jnp.int32)
