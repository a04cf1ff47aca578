"""The one masked-softmax attention core: mask building, softmax over visible keys, the probability-weighted sum.

Dense attention (dense.py), the vision tower's segment attention (models/vision.py) and MSA's analysis paths
(msa_diagnostics.py) all compute their probabilities here; only cuDNN and the Pallas/XLA MSA kernels
(pallas_kernels.msa) have their own. Scores are f32 (`preferred_element_type`), scaled by D^-1/2; masked keys get
-inf before the softmax, so a query must see at least one key.

Masks are bool and broadcast to [B, heads, T, S], where `heads` is 1 or the number of KV heads (the GQA group axis
is added here).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_mask(q_pos: jax.Array, k_pos: jax.Array, q_seg: jax.Array | None = None,
                k_seg: jax.Array | None = None) -> jax.Array:
  """bool [B|1, 1, T, S]: key j visible to query t iff j is not in t's future and both are in the same segment.

  q_pos/k_pos are slot indices in the (possibly cached) sequence: [T] and [S]; q_seg/k_seg: [B, T] and [B, S]
  packing ids, or None (one sequence per row).
  """
  mask = (k_pos[None, :] <= q_pos[:, None])[None, None]  # [1, 1, T, S]
  if q_seg is not None:
    mask = mask & (q_seg[:, None, :, None] == k_seg[:, None, None, :])
  return mask


def key_length_mask(kv_len: jax.Array, num_keys: int) -> jax.Array:
  """bool [B, 1, 1, S]: the first kv_len[b] keys of row b are real, the rest padding. kv_len: int [B]."""
  return (jnp.arange(num_keys)[None, :] < kv_len[:, None])[:, None, None, :]


def attention_probs(q: jax.Array, k: jax.Array, mask: jax.Array | None) -> jax.Array:
  """Softmax over the visible keys. q: [B, T, Hq, D]; k: [B, S, Hkv, D] (Hq a multiple of Hkv: GQA, query head h
  reads KV head h // (Hq / Hkv)); mask: bool broadcastable to [B, Hkv, T, S], or None (every key visible).
  Returns f32 [B, Hkv, G, T, S] with G = Hq / Hkv."""
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  if hq % hkv:
    raise ValueError(f"attention_probs: q has {hq} heads (shape {q.shape}), not a multiple of k's {hkv} heads "
                     f"(shape {k.shape})")
  qg = q.reshape(b, t, hkv, hq // hkv, d)  # [B, T, Hkv, G, D]
  scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * (d ** -0.5)
  if mask is not None:
    scores = jnp.where(mask[:, :, None], scores, -jnp.inf)  # [B|1, Hkv|1, 1, T, S] against [B, Hkv, G, T, S]
  return jax.nn.softmax(scores, axis=-1)  # [B, Hkv, G, T, S]


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, *,
                     return_probs: bool = False):
  """q: [B, T, Hq, D]; k, v: [B, S, Hkv, D]; mask as for `attention_probs`. Returns out [B, T, Hq, D] (and, with
  return_probs, the probabilities f32 [B, Hq, T, S])."""
  b, t, hq, d = q.shape
  s = k.shape[1]
  probs = attention_probs(q, k, mask)  # [B, Hkv, G, T, S]
  out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v).reshape(b, t, hq, d)  # [B, T, Hq, D]
  if return_probs:
    return out, probs.reshape(b, hq, t, s)
  return out
