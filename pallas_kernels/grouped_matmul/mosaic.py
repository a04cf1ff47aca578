"""Hopper grouped matmul: JAX's Mosaic GPU ragged-dot kernels (`jax.experimental.pallas.ops.gpu`: wgmma, TMA,
one persistent program per SM) for the forward and both gradients, joined by our custom VJP.

Why not `jax.lax.ragged_dot` on the GPU: XLA lowers it (and its transpose) to per-group dense work, whose
temporaries grow with groups x rows (97.7 GiB at 16 experts x 32K tokens, BENCHMARKS.md). The three products here
each read every row once:

  y  = x @ w[g]          ragged_dot(x, w)                        [M, K] x [G, K, N] -> [M, N]
  dx = dy @ w[g]^T       ragged_dot(dy, w, transpose_rhs=True)   [M, N] x [G, K, N] -> [M, K]
  dw[g] = x_g^T @ dy_g   transposed_ragged_dot(x, dy)            [M, K] x [M, N]    -> [G, K, N]

The kernels write only the rows that belong to a group: rows past sum(group_sizes) are set to 0 here, so the
function equals `ragged_dot`'s. Outputs are in the input dtype (f32 accumulation inside).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Tile sizes of the kernels (block_k must divide every contracted size; block_m/block_n the output's columns)."""
  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  max_concurrent_steps: int = 4
  grid_block_n: int = 1


DEFAULT_TILES = Tiles()


def check_shapes(m: int, k: int, n: int, tiles: Tiles = DEFAULT_TILES) -> None:
  """The kernels' divisibility needs, as a clear error before any lowering."""
  # K is contracted (forward), an output column (dx) and an output row of dw; N likewise the other way round.
  needs = [("K (x's columns)", k, t) for t in (tiles.block_k, tiles.block_m, tiles.block_n)]
  needs += [("N (w's columns)", n, t) for t in (tiles.block_k, tiles.block_n)]
  for name, size, tile in needs:
    if size % tile:
      raise ValueError(f"grouped_matmul(implementation='mosaic'): {name} = {size} must be a multiple of {tile} "
                       f"(tiles {tiles}); pad the feature sizes or use implementation='xla'")


def _kernels():
  # Imported lazily: the Mosaic GPU modules need the CUDA jaxlib plugin only when called, but keep CPU imports light.
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
  return ragged_dot_mgpu.ragged_dot, transposed_ragged_dot_mgpu.transposed_ragged_dot


def _mask_rows(y: jax.Array, group_sizes: jax.Array) -> jax.Array:
  valid = jnp.arange(y.shape[0]) < jnp.sum(group_sizes)
  return jnp.where(valid[:, None], y, jnp.zeros((), y.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, tiles: Tiles = DEFAULT_TILES) -> jax.Array:
  """x: [M, K]; w: [G, K, N] (same dtype); group_sizes: [G] int32 -> [M, N] in x.dtype."""
  rd, _ = _kernels()
  return _mask_rows(rd(x, w, group_sizes=group_sizes, **dataclasses.asdict(tiles)), group_sizes)


def _fwd(x, w, group_sizes, tiles):
  return grouped_matmul(x, w, group_sizes, tiles), (x, w, group_sizes)


def _bwd(tiles, res, dy):
  x, w, group_sizes = res
  rd, trd = _kernels()
  dy = _mask_rows(dy.astype(x.dtype), group_sizes)
  dx = _mask_rows(rd(dy, w, group_sizes=group_sizes, transpose_rhs=True, **dataclasses.asdict(tiles)), group_sizes)
  dw = trd(x, dy, group_sizes=group_sizes, **dataclasses.asdict(tiles))  # [G, K, N]
  return dx, dw.astype(w.dtype), None


grouped_matmul.defvjp(_fwd, _bwd)
