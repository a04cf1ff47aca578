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

Each product has its own tiles (`KernelTiles`): the three differ in which sizes they tile (the forward and dx
tile rows x output columns and contract over K or N; dw tiles K x N and contracts over the rows), and
`experiments/bench_moe.py --sweep` times candidates of each at the model's shapes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Tile sizes of one kernel: block_m x block_n output tiles, block_k the contracted chunk per pipeline step
  (ragged_dot: M rows x output columns over K; transposed_ragged_dot: K x N over the rows)."""
  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  max_concurrent_steps: int = 4
  grid_block_n: int = 1


@dataclasses.dataclass(frozen=True)
class KernelTiles:
  """The tiles of the three products: fwd (y = x @ w), dx (dy @ w^T) and dw (x^T @ dy per group)."""
  fwd: Tiles = Tiles()
  dx: Tiles = Tiles()
  dw: Tiles = Tiles()


# experiments/bench_moe.py --sweep on an H100 at small_lm's MoE shapes (49,152 x top-2 rows, d = I = 1024, 16 experts;
# BENCHMARKS.md 2026-12-07): summed over gate_up and down, fwd 1.35 ms, dx 1.04 ms (1.77 with the 128 x 128 tiles
# and no snake), dw 0.90 ms.
DEFAULT_TILES = KernelTiles(fwd=Tiles(block_m=64, block_n=256, grid_block_n=4),
                            dx=Tiles(grid_block_n=4),
                            dw=Tiles(max_concurrent_steps=6))


def check_shapes(m: int, k: int, n: int, tiles: KernelTiles = DEFAULT_TILES) -> None:
  """The kernels' divisibility needs, as a clear error before any lowering."""
  del m  # rows are ragged: any count works
  # fwd contracts K and tiles N; dx contracts N and tiles K; dw tiles K x N (its rows are the contraction). The
  # grid's snake (grid_block_n) takes a partial last strip, so only the tiles themselves must divide.
  needs = [("K (x's columns)", k, tiles.fwd.block_k, "fwd block_k"),
           ("N (w's columns)", n, tiles.fwd.block_n, "fwd block_n"),
           ("N (w's columns)", n, tiles.dx.block_k, "dx block_k"),
           ("K (x's columns)", k, tiles.dx.block_n, "dx block_n"),
           ("K (x's columns)", k, tiles.dw.block_m, "dw block_m"),
           ("N (w's columns)", n, tiles.dw.block_n, "dw block_n")]
  for name, size, tile, what in needs:
    if size % tile:
      raise ValueError(f"grouped_matmul(implementation='mosaic'): {name} = {size} must be a multiple of {tile} "
                       f"({what}, tiles {tiles}); pad the feature sizes or use implementation='xla'")


def _kernels():
  # Imported lazily: the Mosaic GPU modules need the CUDA jaxlib plugin only when called, but keep CPU imports light.
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
  return ragged_dot_mgpu.ragged_dot, transposed_ragged_dot_mgpu.transposed_ragged_dot


def _mask_rows(y: jax.Array, group_sizes: jax.Array) -> jax.Array:
  valid = jnp.arange(y.shape[0]) < jnp.sum(group_sizes)
  return jnp.where(valid[:, None], y, jnp.zeros((), y.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array,
                   tiles: KernelTiles = DEFAULT_TILES) -> jax.Array:
  """x: [M, K]; w: [G, K, N] (same dtype); group_sizes: [G] int32 -> [M, N] in x.dtype."""
  rd, _ = _kernels()
  return _mask_rows(rd(x, w, group_sizes=group_sizes, **dataclasses.asdict(tiles.fwd)), group_sizes)


def _fwd(x, w, group_sizes, tiles):
  return grouped_matmul(x, w, group_sizes, tiles), (x, w, group_sizes)


def _bwd(tiles, res, dy):
  x, w, group_sizes = res
  rd, trd = _kernels()
  dy = _mask_rows(dy.astype(x.dtype), group_sizes)
  dx = _mask_rows(rd(dy, w, group_sizes=group_sizes, transpose_rhs=True, **dataclasses.asdict(tiles.dx)),
                  group_sizes)  # [M, K]
  dw = trd(x, dy, group_sizes=group_sizes, **dataclasses.asdict(tiles.dw))  # [G, K, N]
  return dx, dw.astype(w.dtype), None


grouped_matmul.defvjp(_fwd, _bwd)
