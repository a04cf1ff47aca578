"""The small-size definition: the masked softmax over the whole score matrix, [B, Hkv, G, T, S] in f32, differentiated
by plain autodiff. For tests and for checking `xla`; its memory grows as T * S."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.flash_attention._common import query_segments


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, q_offset, segment_ids: jax.Array | None,
                    scale: float) -> jax.Array:
  """q [B, T, Hq, D], k, v [B, S, Hkv, D], q_offset int or int32 [] -> [B, T, Hq, D] in q.dtype; see
  api.flash_attention for the contract."""
  B, T, Hq, D = q.shape
  S, Hkv = k.shape[1], k.shape[2]
  G = Hq // Hkv
  q_pos = q_offset + jnp.arange(T)  # [T]
  mask = (jnp.arange(S)[None, :] <= q_pos[:, None])[None]  # [1, T, S]
  if segment_ids is not None:
    q_seg = query_segments(segment_ids, q_offset, T)  # [B, T]
    mask = mask & (q_seg[:, :, None] == segment_ids[:, None, :])  # [B, T, S]
  mask = mask[:, None, None]  # [B or 1, 1, 1, T, S]

  qg = q.reshape(B, T, Hkv, G, D)  # query head h = kv head h // G, group member h % G
  s = jnp.einsum("bthgd,bshd->bhgts", qg, k, preferred_element_type=jnp.float32) * scale  # [B, Hkv, G, T, S]
  s = jnp.where(mask, s, -jnp.inf)
  # The max only shifts the exponent; cutting its gradient keeps a row without visible keys (max -inf) NaN-free.
  m = jax.lax.stop_gradient(s.max(-1, keepdims=True))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m)  # masked entries: exp(-inf) = 0
  total = p.sum(-1, keepdims=True)
  p = p / jnp.where(total > 0, total, 1.0)  # a row that sees no key gives 0, not 0 / 0
  out = jnp.einsum("bhgts,bshd->bthgd", p, v.astype(jnp.float32))  # [B, T, Hkv, G, D]
  return out.reshape(B, T, Hq, D).astype(q.dtype)
