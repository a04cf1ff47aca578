"""Public grouped matmul: validation on shapes and dtypes (before any tracing of a kernel), then dispatch.

`grouped_matmul(x [M, K], w [G, K, N], group_sizes [G] int32)` returns y [M, N] with
`y[r] = x[r] @ w[g(r)]`, g(r) the group whose run of rows holds r (groups take consecutive rows in order;
rows past sum(group_sizes) give 0) — `jax.lax.ragged_dot`'s function. Differentiable in x and w.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul import mosaic as _mosaic
from pallas_kernels.grouped_matmul import reference as _reference
from pallas_kernels.grouped_matmul import tiled as _tiled

IMPLEMENTATIONS = ("xla", "tiled", "mosaic", "tokamax", "reference")


def _check(x, w, group_sizes) -> None:
  for name, a, rank, layout in (("x", x, 2, "[M, K]"), ("w", w, 3, "[G, K, N]"), ("group_sizes", group_sizes, 1,
                                                                                    "[G]")):
    if not hasattr(a, "shape") or a.ndim != rank:
      raise ValueError(f"grouped_matmul: {name} must be {layout}, got {getattr(a, 'shape', type(a).__name__)}")
  if x.shape[1] != w.shape[1]:
    raise ValueError(f"grouped_matmul: x {x.shape} and w {w.shape} disagree on K (x[1] vs w[1])")
  if group_sizes.shape[0] != w.shape[0]:
    raise ValueError(f"grouped_matmul: group_sizes {group_sizes.shape} must have one entry per group of w "
                     f"{w.shape} (G = {w.shape[0]})")
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise TypeError(f"grouped_matmul: group_sizes must be integer, got {group_sizes.dtype}")


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, implementation: str = "xla",
                   preferred_element_type=None) -> jax.Array:
  """x: [M, K]; w: [G, K, N]; group_sizes: [G] -> [M, N] (preferred_element_type, default x.dtype).

  `tiled` (any backend; memory O(rows + weights) in both passes, where XLA's ragged_dot copies the rows per group
  on CPU and in its GPU backward) scans tiles of one group each. `mosaic` and `tokamax` need x and w in one dtype
  (cast w first); their products come out in that dtype and are cast afterwards, while `xla` accumulates straight
  into preferred_element_type.
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"grouped_matmul: implementation={implementation!r}, expected one of {IMPLEMENTATIONS}")
  _check(x, w, group_sizes)
  out = preferred_element_type or x.dtype
  group_sizes = group_sizes.astype(jnp.int32)
  if implementation == "xla":
    return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=out)
  if implementation == "reference":
    return _reference.grouped_matmul(x, w, group_sizes).astype(out)
  if implementation == "tiled":
    return _tiled.grouped_matmul(x, w, group_sizes).astype(out)
  if x.dtype != w.dtype:
    raise TypeError(f"grouped_matmul(implementation={implementation!r}): x {x.dtype} and w {w.dtype} must share "
                    "a dtype")
  if implementation == "mosaic":
    _mosaic.check_shapes(x.shape[0], x.shape[1], w.shape[2])
    return _mosaic.grouped_matmul(x, w, group_sizes).astype(out)
  try:
    import tokamax  # optional: not in requirements.lock (it brings xprof and pydantic)
  except ImportError as e:
    raise ImportError(f"grouped_matmul(implementation='tokamax') could not import tokamax ({e}); it needs the "
                      "tokamax package and its dependencies (pip install tokamax: xprof needs fire, among others); "
                      "'mosaic' uses the same kind of Hopper kernels from JAX itself") from e
  return tokamax.ragged_dot(x, w, group_sizes).astype(out)
