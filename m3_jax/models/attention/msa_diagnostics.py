"""MSA's analysis paths, outside the training math: the selection's recall metrics and the groups' agreement
(`block_metrics`, on the steps `msa_metrics_every` picks; `group_jaccard`), whether a retrieval needle's block was
selected (`needle_block_selected`, for evaluations) and the materialised probabilities the sparse branch uses
(`selected_probs`, for `capture_attention`).

Both compute dense probabilities with the shared masked-softmax core (core.py); neither carries a gradient into
the model's training signal.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from m3_jax.models.attention.core import attention_probs, causal_mask


def block_metrics(q: jax.Array, k: jax.Array, block_idx: jax.Array, *, block_size: int, local_blocks: int, q_offset,
                  segment_ids: jax.Array | None, num_queries: int, key: jax.Array) -> dict[str, jax.Array]:
  """Diagnostics on a sample of queries of batch row 0 (no gradient):

  - mass_recall: share of the full attention probability mass (mean over the group's heads) that falls in the
    selected blocks; random_mass_recall: the same for a random selection with the same forced local blocks;
  - block_recall: overlap of the selection with the oracle top blocks by attention mass (same count);
  - group_jaccard: how alike the KV groups' selected sets are (`group_jaccard`; 1 when the selection is shared).
  q: [B, T, Hq, D]; k: [B, S, Hkv, D]; block_idx: [B, Hkv, T, topk]; segment_ids: [B, S] or None.
  """
  q, k = jax.lax.stop_gradient(q[0]), jax.lax.stop_gradient(k[0])  # [T, Hq, D], [S, Hkv, D]
  t = q.shape[0]
  s, hkv = k.shape[0], k.shape[1]
  nb = -(-s // block_size)
  nq = min(num_queries, t)
  rows = jnp.linspace(t // 2, t - 1, nq).astype(jnp.int32)  # the later half, where sparsity bites
  pos = q_offset + rows  # [nq]
  seg = None if segment_ids is None else segment_ids[0]
  visible = causal_mask(pos, jnp.arange(s), None if seg is None else seg[pos][None],
                        None if seg is None else seg[None])  # [1, 1, nq, S]
  probs = attention_probs(q[rows][None], k[None], visible)[0].mean(axis=1)  # [Hkv, nq, S]
  mass = jnp.pad(probs, ((0, 0), (0, 0), (0, nb * block_size - s))).reshape(hkv, nq, nb, block_size).sum(-1)
  sel = block_idx[0][:, rows]  # [Hkv, nq, topk]
  chosen = jnp.zeros((hkv, nq, nb + 1), jnp.float32).at[
      jnp.arange(hkv)[:, None, None], jnp.arange(nq)[None, :, None], jnp.where(sel < 0, nb, sel)].set(1.0)[..., :nb]
  n_valid = jnp.sum(sel >= 0, axis=-1)  # [Hkv, nq]
  mass_recall = jnp.mean(jnp.sum(mass * chosen, -1))
  # oracle: the n_valid blocks with the most attention mass
  rank = jnp.argsort(jnp.argsort(-mass, axis=-1), axis=-1)  # 0 = heaviest block
  oracle = (rank < n_valid[..., None]).astype(jnp.float32)
  block_recall = jnp.mean(jnp.sum(oracle * chosen, -1) / jnp.maximum(n_valid, 1))
  random_recall = _random_mass_recall(mass, n_valid, pos, nb, block_size=block_size, local_blocks=local_blocks,
                                      key=key)
  return {"mass_recall": mass_recall, "block_recall": block_recall, "random_mass_recall": random_recall,
          "group_jaccard": jnp.mean(_pairwise_jaccard(chosen))}


@functools.partial(jax.jit, static_argnames="num_blocks")
def group_jaccard(block_idx: jax.Array, num_blocks: int) -> jax.Array:
  """Mean pairwise Jaccard similarity |A ∩ B| / |A ∪ B| of the KV groups' selected block sets, per query, averaged
  over the queries (and batch rows). -1 slots and repeated ids count as nothing and once; with one group, or two
  empty sets, the similarity is 1. The forced local blocks are in every group's set, so unrelated selections of
  k blocks with L local ones score about L / (2k - L), not 0.
  block_idx: int [B, Hkv, T, topk] with ids < num_blocks -> f32 scalar."""
  if block_idx.ndim != 4:
    raise ValueError(f"group_jaccard: block_idx shape {block_idx.shape}, expected [B, Hkv, T, topk]")
  b, hkv, t, _ = block_idx.shape
  chosen = jnp.zeros((b, hkv, t, num_blocks + 1), jnp.float32).at[
      jnp.arange(b)[:, None, None, None], jnp.arange(hkv)[None, :, None, None], jnp.arange(t)[None, None, :, None],
      jnp.where(block_idx < 0, num_blocks, block_idx)].set(1.0)[..., :num_blocks]  # [B, Hkv, T, nb]
  return jnp.mean(jax.vmap(_pairwise_jaccard)(chosen))


def _pairwise_jaccard(chosen: jax.Array) -> jax.Array:
  """chosen: {0, 1} f32 [Hkv, n, nb] (block in the group's set) -> f32 [n], the mean over group pairs g < g'."""
  hkv = chosen.shape[0]
  if hkv == 1:
    return jnp.ones(chosen.shape[1], jnp.float32)
  inter = jnp.einsum("gnb,hnb->ghn", chosen, chosen)  # [Hkv, Hkv, n]
  size = jnp.sum(chosen, -1)  # [Hkv, n]
  union = size[:, None] + size[None, :] - inter  # [Hkv, Hkv, n]
  jac = jnp.where(union > 0, inter / jnp.maximum(union, 1.0), 1.0)
  g, h = jnp.triu_indices(hkv, k=1)
  return jnp.mean(jac[g, h], axis=0)


def needle_block_selected(block_idx, needle_positions, query_positions, block_size: int) -> jax.Array:
  """Whether the block holding each needle token is among the blocks a query selected, per KV group.

  For retrieval evaluation: pass the selection of the query that produces the answer (its first token) and the
  key slots of the needle's tokens; `out.all(-1)` then says the whole needle was readable by that group.
  block_idx: int [B, Hkv, T, topk] (an MSA layer's selection, e.g. from `capture_attention`); needle_positions:
  int [B] or [B, N] key slots of the needle tokens; query_positions: int [B], the query's row t in block_idx (its
  slot minus the q_offset the selection was made with: the slot itself for a forward from slot 0).
  Returns bool [B, Hkv] for needle_positions [B], else [B, Hkv, N].
  """
  block_idx = jnp.asarray(block_idx)
  needle = jnp.asarray(needle_positions)
  query = jnp.asarray(query_positions)
  if block_idx.ndim != 4 or not jnp.issubdtype(block_idx.dtype, jnp.integer):
    raise ValueError(f"needle_block_selected: block_idx shape {block_idx.shape} dtype {block_idx.dtype}, expected "
                     "int [B, Hkv, T, topk]")
  b, _, t, _ = block_idx.shape
  if needle.ndim not in (1, 2) or needle.shape[0] != b or not jnp.issubdtype(needle.dtype, jnp.integer):
    raise ValueError(f"needle_block_selected: needle_positions shape {needle.shape} dtype {needle.dtype}, expected "
                     f"int [B={b}] or [B={b}, N]")
  if query.shape != (b,) or not jnp.issubdtype(query.dtype, jnp.integer):
    raise ValueError(f"needle_block_selected: query_positions shape {query.shape} dtype {query.dtype}, expected "
                     f"int [B={b}]")
  if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
    raise ValueError(f"needle_block_selected: block_size={block_size!r}, expected a positive int")
  try:
    q_lo, q_hi, n_lo = int(query.min()), int(query.max()), int(needle.min())
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
    q_lo, q_hi, n_lo = 0, 0, 0  # traced: only known at run time
  if q_lo < 0 or q_hi >= t:
    raise ValueError(f"needle_block_selected: query_positions in [{q_lo}, {q_hi}], expected rows of block_idx in "
                     f"[0, T={t})")
  if n_lo < 0:
    raise ValueError(f"needle_block_selected: needle_positions has {n_lo}, expected key slots >= 0")
  sel = jnp.take_along_axis(block_idx, query[:, None, None, None], axis=2)[:, :, 0]  # [B, Hkv, topk]
  blocks = (needle if needle.ndim == 2 else needle[:, None]) // block_size  # [B, N]
  hit = jnp.any((sel[:, :, None, :] == blocks[:, None, :, None]) & (sel[:, :, None, :] >= 0), axis=-1)  # [B, Hkv, N]
  return hit if needle.ndim == 2 else hit[..., 0]


def _random_mass_recall(mass: jax.Array, n_valid: jax.Array, pos: jax.Array, nb: int, *, block_size: int,
                        local_blocks: int, key: jax.Array) -> jax.Array:
  """The baseline: forced local blocks, then uniformly random visible blocks, as many as the selection holds.
  mass: [Hkv, nq, nb] attention mass per block; n_valid: [Hkv, nq]; pos: [nq] query slots."""
  hkv, nq = n_valid.shape
  q_block = pos // block_size  # [nq]
  blocks = jnp.arange(nb)
  vis_block = blocks[None, :] <= q_block[:, None]  # [nq, nb]
  rnd = jax.random.uniform(key, (hkv, nq, nb))
  local = (blocks[None, :] <= q_block[:, None]) & (blocks[None, :] > q_block[:, None] - local_blocks)
  rnd = jnp.where(local[None], 2.0, jnp.where(vis_block[None], rnd, -1.0))
  rrank = jnp.argsort(jnp.argsort(-rnd, axis=-1), axis=-1)
  rchosen = ((rrank < n_valid[..., None]) & vis_block[None]).astype(jnp.float32)
  return jnp.mean(jnp.sum(mass * rchosen, -1))


def selected_probs(q: jax.Array, k: jax.Array, block_idx: jax.Array, *, block_size: int, q_offset=None,
                   segment_ids: jax.Array | None = None) -> jax.Array:
  """Attention probabilities over (selected blocks ∩ causal ∩ segment), materialised: analysis only.
  q: [B, T, Hq, D]; k: [B, S, Hkv, D]; block_idx: [B, Hkv, T, topk]; segment_ids: [B, S] -> [B, Hq, T, S] f32."""
  b, t, hq, _ = q.shape
  s, hkv = k.shape[1], k.shape[2]
  nb = -(-s // block_size)
  q_offset = s - t if q_offset is None else q_offset
  chosen = jnp.zeros((b, hkv, t, nb + 1), bool).at[
      jnp.arange(b)[:, None, None, None], jnp.arange(hkv)[None, :, None, None], jnp.arange(t)[None, None, :, None],
      jnp.where(block_idx < 0, nb, block_idx)].set(True)[..., :nb]
  key_ok = jnp.repeat(chosen, block_size, axis=-1)[..., :s]  # [B, Hkv, T, S]
  q_seg = None if segment_ids is None else jax.lax.dynamic_slice_in_dim(segment_ids, q_offset, t, axis=1)
  key_ok &= causal_mask(q_offset + jnp.arange(t), jnp.arange(s), q_seg, segment_ids)  # [B|1, 1, T, S]
  return attention_probs(q, k, key_ok).reshape(b, hq, t, s)
