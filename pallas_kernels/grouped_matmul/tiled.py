"""A grouped matmul (rows sorted by group, one weight matrix per group) whose memory stays O(rows + weights) in the
forward and the backward on every backend (`implementation="tiled"`).

Why not `jax.lax.ragged_dot`: on CPU it always lowers to a dense masked product (jax's fallback: a [G, M, K] copy
of the rows, 48 GiB per device for one M3 MoE layer on the fake mesh), and on the GPU its backward does the same
(BENCHMARKS.md: 97.7 GiB of temporaries at 16 experts x 32K tokens). Here every group is padded to whole tiles of
`tile` rows, so each tile belongs to one group, and a `jax.lax.scan` multiplies one tile at a time by its group's
weights; tiles past the last group's are skipped (`lax.cond`), so the FLOPs are those of the real rows plus at
most one partial tile per group. The backward (custom VJP) is the same scan, accumulating each group's weight
gradient in place in an f32 carry.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
  return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _zeros(shape, dtype, *like: jax.Array) -> jax.Array:
  """Zeros that vary over the manual mesh axes `like` vary over: inside a shard_map (the expert-parallel MoE) the
  skipped branch of a cond and a scan's initial carry must match the computed values' type."""
  z = jnp.zeros(shape, dtype)
  for a in like:  # zeros_like keeps its operand's varying axes; one zero scalar of each gives z their union
    z = z + jnp.zeros_like(a[(0,) * a.ndim], dtype=dtype)
  return z


@jax.custom_vjp
def _tile_matmul(xt: jax.Array, w: jax.Array, tile_group: jax.Array) -> jax.Array:
  """xt: [T, tm, K] tiles; w: [G, K, N]; tile_group: [T] int32 (>= G: unused tile) -> [T, tm, N] f32."""
  g = w.shape[0]

  def body(_, args):
    x, gi = args  # [tm, K], []
    y = jax.lax.cond(gi < g, lambda: _dot(x, w[jnp.minimum(gi, g - 1)]),
                     lambda: _zeros((x.shape[0], w.shape[2]), jnp.float32, x, w))
    return None, y

  return jax.lax.scan(body, None, (xt, tile_group))[1]


def _tile_matmul_fwd(xt, w, tile_group):
  return _tile_matmul(xt, w, tile_group), (xt, w, tile_group)


def _tile_matmul_bwd(res, dy):
  """dy: [T, tm, N] f32 -> (dx [T, tm, K] in x's dtype, dw [G, K, N] in w's dtype, None)."""
  xt, w, tile_group = res
  g = w.shape[0]

  def body(dw, args):
    x, d, gi = args  # [tm, K], [tm, N], []

    def used(dw):
      gc = jnp.minimum(gi, g - 1)
      d_in = d.astype(x.dtype)
      dx = _dot(d_in, w[gc].T).astype(x.dtype)  # [tm, K]
      return dw.at[gc].add(_dot(x.T, d_in)), dx  # the carry is updated in place: no [G, K, N] per tile

    return jax.lax.cond(gi < g, used, lambda dw: (dw, _zeros(x.shape, x.dtype, x, d, w)), dw)

  dw, dx = jax.lax.scan(body, _zeros(w.shape, jnp.float32, xt, dy, w), (xt, dy, tile_group))
  return dx, dw.astype(w.dtype), None


_tile_matmul.defvjp(_tile_matmul_fwd, _tile_matmul_bwd)


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, tile: int = 512) -> jax.Array:
  """x: [M, K] rows sorted by group (group g's `group_sizes[g]` rows right after group g-1's; rows past the last
  group are ignored and give zero rows); w: [G, K, N]; group_sizes: [G] int -> [M, N] f32 (products in the inputs'
  dtype, f32 accumulation): row r of group g is x[r] @ w[g], as `jax.lax.ragged_dot` computes it."""
  m, k = x.shape
  g, k_w, n = w.shape
  if k_w != k or group_sizes.shape != (g,):
    raise ValueError(f"grouped_matmul: x {x.shape}, w {w.shape} and group_sizes {group_sizes.shape} do not fit "
                     "([M, K], [G, K, N], [G])")
  tm = max(1, min(int(tile), -(-m // 8) * 8))  # small inputs (tests) take one small tile
  n_tiles = -(-(m + g * (tm - 1)) // tm)  # enough for every group padded to whole tiles
  sizes = group_sizes.astype(jnp.int32)
  tiles_per = (sizes + tm - 1) // tm  # [G]
  tile_end = jnp.cumsum(tiles_per)  # [G]
  row_end = jnp.cumsum(sizes)  # [G]
  rows = jnp.arange(m, dtype=jnp.int32)
  row_group = jnp.searchsorted(row_end, rows, side="right")  # [M]; G: past the last group
  gc = jnp.minimum(row_group, g - 1)
  in_tile = rows - (row_end - sizes)[gc]  # row's rank inside its group
  slot = jnp.where(row_group < g, (tile_end - tiles_per)[gc] * tm + in_tile, n_tiles * tm)  # past the end: none
  xp = jnp.zeros((n_tiles * tm, k), x.dtype).at[slot].set(x, mode="drop")  # [T tm, K]
  tile_group = jnp.searchsorted(tile_end, jnp.arange(n_tiles, dtype=jnp.int32), side="right")  # [T]
  # Inside a shard_map the rows and the weights vary over different mesh axes (tokens over the batch axes, experts
  # over expert and tensor). The custom VJP must return cotangents of its inputs' types, so both enter varying over
  # the union: the additions' transposes outside it then sum the cotangents over the axes each input lacked (the
  # psums plain autodiff would insert).
  xt = _zeros((), xp.dtype, w) + xp.reshape(n_tiles, tm, k)  # [T, tm, K]
  w = _zeros((), w.dtype, xp) + w
  yp = _tile_matmul(xt, w, tile_group.astype(jnp.int32))  # [T, tm, N] f32
  return yp.reshape(n_tiles * tm, n).at[slot].get(mode="fill", fill_value=0.0)  # [M, N]
