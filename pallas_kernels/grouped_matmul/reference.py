"""The small-size oracle: every group's matmul on every row, kept where the row belongs to the group (G times the
FLOPs; for tests)."""

import jax
import jax.numpy as jnp


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """x: [M, K]; w: [G, K, N]; group_sizes: [G] -> [M, N] in x.dtype (rows past sum(group_sizes) are 0)."""
  ends = jnp.cumsum(group_sizes)
  row = jnp.arange(x.shape[0])
  group = jnp.sum(row[:, None] >= ends[None, :], axis=1)  # [M]; G for rows past the last group
  onehot = (group[:, None] == jnp.arange(w.shape[0])[None, :]).astype(jnp.float32)  # [M, G]
  y = jnp.einsum("mk,gkn->mgn", x.astype(jnp.float32), w.astype(jnp.float32),
                 precision=jax.lax.Precision.HIGHEST)  # [M, G, N]
  return jnp.einsum("mgn,mg->mn", y, onehot).astype(x.dtype)
