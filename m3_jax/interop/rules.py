"""One tensor's mapping between our parameter tree and an HF checkpoint, shared by the text (hf.py) and the vision
(hf_vision.py) loaders: a `Rule` per tensor, the usual layout transforms, and path access into
`nnx.to_pure_dict(state)` trees.

Transforms come in (to_ours, to_hf) pairs of numpy views (reshape / transpose only), so slicing a transformed
tensor reads only that slice of the memory-mapped file, and load and save are exact inverses.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

Transform = Callable[[np.ndarray], np.ndarray]


@dataclasses.dataclass(frozen=True)
class Rule:
  ours: tuple  # path in nnx.to_pure_dict(state)
  hf: str  # HF's name (the canonical `hf` layout for the text tower, HF's in-memory name for the vision tower)
  to_ours: Transform
  to_hf: Transform
  hf_shape: tuple[int, ...] | None = None  # None: the loader checks shapes after to_ours (hf_vision)
  # Row of the leading layer axis of `ours` when the tensor is one layer of a scanned stack (TextConfig.scan_layers);
  # None: `ours` is the tensor itself.
  row: int | None = None


def same() -> tuple[Transform, Transform]:
  return (lambda w: w), (lambda w: w)


def transpose_last2() -> tuple[Transform, Transform]:
  return (lambda w: np.swapaxes(w, -1, -2)), (lambda w: np.swapaxes(w, -1, -2))


def linear(d_in: int, *out: int) -> tuple[Transform, Transform]:
  """HF Linear [prod(out), d_in] <-> ours [d_in, *out] (projections into heads, MLP inputs)."""
  return (lambda w: w.T.reshape(d_in, *out)), (lambda w: w.reshape(d_in, -1).T)


def linear_out(*ours: int) -> tuple[Transform, Transform]:
  """HF Linear [ours[-1], prod(ours[:-1])] <-> ours [*in_dims, out] (projections out of heads, merges)."""
  return (lambda w: w.T.reshape(ours)), (lambda w: w.reshape(-1, ours[-1]).T)


def get_path(tree: dict, path: tuple) -> Any:
  """tree[path[0]][path[1]]...: a Rule's `ours` in a pure-dict state."""
  for k in path:
    tree = tree[k]
  return tree


def set_path(tree: dict, path: tuple, value: Any) -> None:
  """Sets tree[path[0]]...[path[-1]] = value in place."""
  for k in path[:-1]:
    tree = tree[k]
  tree[path[-1]] = value
