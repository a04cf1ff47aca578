"""Per-layer decoding caches: keys/values (and MSA's index keys) in fixed-size buffers with a traced length, so
one compiled prefill and one compiled decode step serve every position."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class LayerCache:
  k: jax.Array  # [B, S_max, Hkv, D]
  v: jax.Array  # [B, S_max, Hkv, D]
  k_idx: jax.Array | None  # [B, S_max, d_idx] for MSA layers (the index-key cache), else None
  length: jax.Array  # int32 []: slots filled so far (the same for every row of the batch)

  @classmethod
  def empty(cls, batch: int, max_len: int, num_kv_heads: int, head_dim: int, *, index_dim: int | None = None,
            dtype=jnp.float32) -> "LayerCache":
    kv = jnp.zeros((batch, max_len, num_kv_heads, head_dim), dtype)
    k_idx = None if index_dim is None else jnp.zeros((batch, max_len, index_dim), dtype)
    return cls(k=kv, v=kv, k_idx=k_idx, length=jnp.zeros((), jnp.int32))

  @property
  def max_len(self) -> int:
    return self.k.shape[1]

  def update(self, k: jax.Array, v: jax.Array, k_idx: jax.Array | None = None) -> "LayerCache":
    """Writes T new slots at `length`. k, v: [B, T, Hkv, D]; k_idx: [B, T, d_idx]."""
    at = (0, self.length, 0, 0)
    new_k = jax.lax.dynamic_update_slice(self.k, k.astype(self.k.dtype), at)
    new_v = jax.lax.dynamic_update_slice(self.v, v.astype(self.v.dtype), at)
    new_idx = self.k_idx
    if self.k_idx is not None:
      new_idx = jax.lax.dynamic_update_slice(self.k_idx, k_idx.astype(self.k_idx.dtype), (0, self.length, 0))
    return self.replace(k=new_k, v=new_v, k_idx=new_idx, length=self.length + k.shape[1])
