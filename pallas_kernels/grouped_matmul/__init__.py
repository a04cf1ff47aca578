"""Grouped (ragged) matmul for dropless MoE: rows sorted by group, each group times its own weight matrix.

`api.grouped_matmul` validates and dispatches on `implementation=`: `xla` (`jax.lax.ragged_dot`, every backend),
`tiled` (scanned one-group tiles under a custom VJP, `tiled.py`: memory bounded on every backend),
`mosaic` (Hopper: JAX's Mosaic GPU ragged-dot kernels under our VJP, `mosaic.py`), `tokamax` (tokamax's
`ragged_dot`, when that optional package is installed) and `reference` (a small-size oracle).
"""

from pallas_kernels.grouped_matmul.api import IMPLEMENTATIONS, grouped_matmul

__all__ = ["grouped_matmul", "IMPLEMENTATIONS"]
