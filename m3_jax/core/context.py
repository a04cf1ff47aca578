"""Context parallelism's token layout: which slots of a sequence each device of the `context` mesh axis holds.

With n = size of `context`, a sequence of T slots is cut into 2n chunks of c = T / (2n) slots and device i holds
chunks i and 2n - 1 - i (the "zigzag" order), in that order. Causal attention costs a query in proportion to its
position, so contiguous slices would leave the last device about 2n - 1 times the work of the first; pairing an
early chunk with its mirror gives every device 2n c^2 (query, key) pairs (up to O(c)) of dense attention, and the
same index-scoring work for MSA (its sparse part costs every query the same fixed budget anyway). (Striping, slot t on device t mod n,
balances too, but the kernels take queries as one contiguous run at an offset: zigzag gives two runs per device.)

The trainer reorders every [B, T] batch array into this order on the host (`to_device_order`), so the dim of length
T split over `context` in ordinary block fashion puts chunks (i, 2n - 1 - i) on device i. Everything outside attention
is token-local and never notices; the attention layers all-gather keys (device order) and put them back in sequence
order with `gathered_to_sequence`. Positions and segment ids travel with the tokens, so RoPE and packing follow.
"""

from __future__ import annotations

import numpy as np

CONTEXT_AXIS = "context"


def chunk_size(length: int, shards: int) -> int:
  """c = length / (2 shards); ValueError when the sequence does not split into 2 x shards equal chunks."""
  if shards < 1:
    raise ValueError(f"context shards={shards}: expected >= 1")
  if length % (2 * shards):
    raise ValueError(f"sequence length {length} does not split into 2 x context = {2 * shards} equal chunks "
                     f"(context parallelism gives every device two chunks); use a multiple of {2 * shards}")
  return length // (2 * shards)


def device_order(length: int, shards: int) -> np.ndarray:
  """int [T]: the sequence slot held at each position of the device-ordered array (device i's 2c slots are
  positions [2 c i, 2 c (i + 1)): chunk i, then chunk 2 shards - 1 - i)."""
  c = chunk_size(length, shards)
  chunks = [j for i in range(shards) for j in (i, 2 * shards - 1 - i)]
  return np.concatenate([np.arange(j * c, (j + 1) * c) for j in chunks])


def to_device_order(x: np.ndarray, shards: int, axis: int = 1) -> np.ndarray:
  """Host array in sequence order -> device order along `axis` (identity for shards == 1)."""
  if shards == 1:
    return x
  return np.take(x, device_order(x.shape[axis], shards), axis=axis)


def to_sequence_order(x: np.ndarray, shards: int, axis: int = 1) -> np.ndarray:
  """Inverse of `to_device_order` (for per-token outputs brought back to the host)."""
  if shards == 1:
    return x
  return np.take(x, np.argsort(device_order(x.shape[axis], shards)), axis=axis)


def gathered_to_sequence(x, shards: int, axis: int = 1):
  """An all-gathered (tiled) device-ordered array -> sequence order along `axis`, as jnp reshapes (no gather op):
  the gathered array is [.., n, 2, c, ..] (device, its first / second chunk); sequence order is the first chunks of
  devices 0..n-1 followed by the second chunks of devices n-1..0."""
  import jax.numpy as jnp  # noqa: PLC0415  (core's numpy helpers above stay importable without jax)

  if shards == 1:
    return x
  length = x.shape[axis]
  c = chunk_size(length, shards)
  pairs = x.reshape(x.shape[:axis] + (shards, 2, c) + x.shape[axis + 1:])  # [.., n, 2, c, ..]
  first = jnp.take(pairs, 0, axis=axis + 1)  # [.., n, c, ..]: chunks 0..n-1
  second = jnp.flip(jnp.take(pairs, 1, axis=axis + 1), axis=axis)  # [.., n, c, ..]: chunks n..2n-1
  return jnp.concatenate([first, second], axis=axis).reshape(x.shape)  # [.., T, ..] in sequence order


def local_offsets(index, length: int, shards: int):
  """Sequence slots of the first slot of device `index`'s two chunks (index may be traced): (i c, (2n - 1 - i) c)."""
  c = chunk_size(length, shards)
  return index * c, (2 * shards - 1 - index) * c
