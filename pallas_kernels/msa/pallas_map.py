"""The KV-outer map: the query-major selection inverted into, for every KV block, the (query, slot) pairs that chose it.

The selection `block_idx [B, Hkv, T, K]` says which blocks each (query, group) reads. The KV-outer kernels want the
opposite view: for block j of group h, the list of queries that read it, so that K_j and V_j are loaded once and
attended by all those queries together (DESIGN.md §2, "KV-outer"). Per (b, h) the T*K pairs are sorted by block id
(stably, so each block's queries stay in ascending order), which lays the pairs of one block out contiguously; a
pair's position in that order is where the kernels write its partial output, and `pair_pos` maps each (query, slot)
back to it for the merge.

Everything here is XLA on int32 arrays of size T*K per (b, h): one sort and a few searchsorted calls. Unusable
slots (-1, out of range, or a repeat of an earlier slot of the same row) get the sentinel block `num_blocks`, so they
sort last, belong to no block, and have `pair_pos = -1`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.msa._common import cdiv, usable_slots


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVMap:
  """Inverted selection of one call, per flattened (b, h) row `bh = b * Hkv + h`.

  sorted_t:    int32 [BH, P + pad] query of the p-th pair in block order (padded so chunk reads stay in range)
  blk_start:   int32 [BH, nb]      first pair of block j;  blk_count: int32 [BH, nb]  pairs of block j
  chunk_blk:   int32 [BH, C]       block of chunk c;  chunk_start: first pair;  chunk_count: pairs (0 = idle chunk)
  pair_pos:    int32 [BH, T * K]   position of pair (t, slot) in block order, -1 for an unusable slot
  P = T * K pairs; a chunk holds at most R consecutive pairs of one block; C = ceil(P / R) + nb is a static bound on
  the number of chunks (every block adds at most one partial chunk).
  """
  sorted_t: jax.Array
  blk_start: jax.Array
  blk_count: jax.Array
  chunk_blk: jax.Array
  chunk_start: jax.Array
  chunk_count: jax.Array
  pair_pos: jax.Array


def build_kv_map(block_idx: jax.Array, num_blocks: int, rows_per_chunk: int, pad: int | None = None) -> KVMap:
  """block_idx int32 [B, Hkv, T, K] -> KVMap with chunks of at most `rows_per_chunk` pairs.

  `sorted_t` gets `pad` (default rows_per_chunk) extra entries: a kernel reading R' <= pad pairs from any start
  inside the P pairs stays in range."""
  B, Hkv, T, K = block_idx.shape
  BH, P, nb, R = B * Hkv, T * K, num_blocks, rows_per_chunk
  ok = usable_slots(block_idx, nb)
  blk = jnp.where(ok, block_idx, nb).reshape(BH, P).astype(jnp.int32)  # [BH, P], pair p = t * K + slot

  order = jnp.argsort(blk, axis=-1, stable=True).astype(jnp.int32)  # [BH, P]
  sorted_blk = jnp.take_along_axis(blk, order, axis=-1)
  sorted_t = order // K
  # Unique destinations: a permutation, so this scatter is exact and deterministic.
  pos = jnp.zeros((BH, P), jnp.int32).at[jnp.arange(BH)[:, None], order].set(jnp.arange(P, dtype=jnp.int32))
  pair_pos = jnp.where(blk < nb, pos, -1)

  bounds = jax.vmap(lambda s: jnp.searchsorted(s, jnp.arange(nb + 1, dtype=jnp.int32), side="left"))(sorted_blk)
  bounds = bounds.astype(jnp.int32)  # [BH, nb + 1]
  blk_start, blk_count = bounds[:, :nb], bounds[:, 1:] - bounds[:, :nb]

  chunks = chunk_layout(blk_start, blk_count, P, R)
  return KVMap(
      sorted_t=jnp.pad(sorted_t, ((0, 0), (0, R if pad is None else max(pad, R)))),
      blk_start=blk_start,
      blk_count=blk_count,
      chunk_blk=chunks.blk,
      chunk_start=chunks.start,
      chunk_count=chunks.count,
      pair_pos=pair_pos,
  )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Chunks:
  """The pairs of every block cut into chunks of at most `pairs` consecutive pairs, per flattened (b, h) row.

  blk, start, count: int32 [BH, C]  block, first pair and pairs of chunk c (count 0 = idle chunk, blk 0)
  first, n:          int32 [BH, nb] first chunk of block j and its number of chunks (0 for a block no query chose)
  C = ceil(P / pairs) + nb is a static bound (every block adds at most one partial chunk). A block's chunks are
  consecutive, so a per-block reduction over them runs in a fixed order.
  """
  blk: jax.Array
  start: jax.Array
  count: jax.Array
  first: jax.Array
  n: jax.Array


def chunk_layout(blk_start: jax.Array, blk_count: jax.Array, total_pairs: int, pairs: int) -> Chunks:
  """blk_start, blk_count int32 [BH, nb] (KVMap; the counts sum to at most `total_pairs`) -> Chunks of at most
  `pairs` pairs each. XLA on [BH, C] int32 arrays."""
  nb = blk_count.shape[1]
  n = (blk_count + pairs - 1) // pairs  # [BH, nb]
  chunk_end = jnp.cumsum(n, axis=-1)  # chunks of blocks 0..j
  C = cdiv(total_pairs, pairs) + nb
  c = jnp.arange(C, dtype=jnp.int32)
  blk = jax.vmap(lambda e: jnp.searchsorted(e, c, side="right"))(chunk_end).astype(jnp.int32)  # [BH, C]
  live = blk < nb
  cb = jnp.minimum(blk, nb - 1)
  first = (chunk_end - n).astype(jnp.int32)  # [BH, nb]
  local = c - jnp.take_along_axis(first, cb, axis=-1)  # chunk's rank inside its block
  start = jnp.take_along_axis(blk_start, cb, axis=-1) + local * pairs
  count = jnp.clip(jnp.take_along_axis(blk_count, cb, axis=-1) - local * pairs, 0, pairs)
  return Chunks(blk=jnp.where(live, cb, 0), start=jnp.where(live, start, 0), count=jnp.where(live, count, 0),
                first=first, n=n.astype(jnp.int32))
