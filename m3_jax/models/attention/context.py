"""Context-parallel attention: the sequence split over the `context` mesh axis, attention of the whole sequence.

Outside attention every op is token-local, so a [B, T, ...] activation split along T needs nothing. Attention is the
one place a query needs other devices' tokens; `context_parallel` runs a layer's attention core inside one
`jax.shard_map` over the whole mesh:

  1. the key-side arrays (K, V; MSA's index keys; the segment ids) are all-gathered along `context` and put back in
     sequence order (core/context.py: device i holds chunks i and 2n - 1 - i). GQA keeps them small: Hkv heads (and
     one 128-wide index-key head) instead of Hq. The all-gather's transpose, a reduce-scatter, returns their
     gradients to the devices that own the tokens;
  2. each device runs the core on its two query chunks, each a contiguous run at a known offset (the kernels'
     traced `q_offset`): MSA selects blocks, runs the sparse kernels and the KL per device over its own queries, so
     the KV-outer map is built per device as well;
  3. per-token outputs stay where their queries are; scalar outputs (MSA's KL and metrics, means over rows) are
     averaged over the two chunks and then over every mesh axis, which splits the rows evenly.

All-gather rather than a ring: the gathered K/V of a GQA layer cost 2 x Hkv x D x 2 bytes per token (4 KiB at
Hkv=8, D=128 in bf16; 4 GiB at 1M tokens), within reach of one device at the lengths we target, and MSA needs every
key's index score anyway; a ring would overlap the transfer with compute but needs the kernels to merge partial
softmaxes across steps.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from m3_jax.core import sharding
from m3_jax.core.context import CONTEXT_AXIS, gathered_to_sequence, local_offsets

# (array, logical axis names) pairs, keyed by the name the core reads them under.
Arrays = Mapping[str, tuple[jax.Array, Sequence[str | None]]]
# core(queries: {name: [b, c, ...]}, keys: {name: [b, T, ...] in sequence order}, q_offset, scalars_in)
#   -> (out [b, c, ...], scalars: pytree of f32 scalars)
Core = Callable[[dict, dict, jax.Array, Any], tuple[jax.Array, Any]]


def shards() -> int:
  """Size of `context` in the current mesh (1 without a mesh or context parallelism)."""
  return sharding.context_shards()


def context_parallel(core: Core, queries: Arrays, keys: Arrays, out_names: Sequence[str | None],
                     scalars_in: Any = None) -> tuple[jax.Array, Any]:
  """Runs `core` with the whole sequence's keys for every device's queries (module docstring).

  queries / keys: name -> (array [B, T_local, ...] split over the batch axes and `context`, its logical axes);
  out_names: the logical axes of the core's per-token output; scalars_in: a pytree of replicated scalars the core
  reads (the training step). Returns (out [B, T_local, ...] in device order, scalars averaged over all queries).
  """
  mesh = sharding.current_mesh()
  n = sharding.context_shards(mesh)
  q_names, k_names = list(queries), list(keys)

  def spec(arr, names, what):
    return sharding.fitted_spec(arr.shape, names, mesh, what=f"context-parallel attention: {what}")

  # scalars_in: one P() (replicated) for the whole pytree, a prefix of any structure.
  in_specs = ([spec(*queries[k], k) for k in q_names], [spec(*keys[k], k) for k in k_names],
              jax.sharding.PartitionSpec())
  out_spec = sharding.logical_to_spec(out_names)

  def local(q_arrays, k_arrays, scal):
    t_local = q_arrays[0].shape[1]  # 2 c
    c, total = t_local // 2, t_local * n
    full = {}
    for name, x in zip(k_names, k_arrays):
      gathered = jax.lax.all_gather(x, CONTEXT_AXIS, axis=1, tiled=True)  # [b, T, ...] device order
      full[name] = gathered_to_sequence(gathered, n, axis=1)  # [b, T, ...] sequence order
    outs, scalars = [], []
    for half, offset in enumerate(local_offsets(jax.lax.axis_index(CONTEXT_AXIS), total, n)):
      qh = {name: x[:, half * c:(half + 1) * c] for name, x in zip(q_names, q_arrays)}  # [b, c, ...]
      out, s = core(qh, full, jnp.asarray(offset, jnp.int32), scal)
      outs.append(out)
      scalars.append(s)
    both = jax.tree.map(lambda a, b: (a + b) / 2, *scalars)
    # Every mesh axis splits the rows the scalars average over (batch, sequence, heads) evenly, or not at all.
    both = jax.tree.map(lambda x: jax.lax.pmean(x, tuple(mesh.axis_names)), both)
    return jnp.concatenate(outs, axis=1), both

  # out_specs is a pytree prefix: one P() covers whatever scalars the core returns.
  q_arrays = [queries[k][0] for k in q_names]
  k_arrays = [keys[k][0] for k in k_names]
  return jax.shard_map(local, in_specs=in_specs, out_specs=(out_spec, jax.sharding.PartitionSpec()))(
      q_arrays, k_arrays, scalars_in)
