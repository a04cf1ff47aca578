"""Helpers shared by the text and the vision data: progress lines, the held-out choice, seeds, memory maps.

Everything here is public because more than one module of `m3_jax.data` uses it; nothing here knows about a
particular source or pipeline.
"""
from __future__ import annotations

import json
import os
import zlib
from typing import Any

import numpy as np

__all__ = ["SPLITS", "check_seq_len", "heldout_indices", "log", "memmap", "mp_prefetch", "seed32", "write_json"]

# The splits every prepared source has (a source with a single document has an empty held-out split).
SPLITS = ("train", "heldout")


def log(verbose: bool, msg: str, *, tag: str = "m3_jax.data") -> None:
  """Prints one progress line `[tag] msg` (flushed, so it interleaves correctly with subprocess output)."""
  if verbose:
    print(f"[{tag}] {msg}", flush=True)


def heldout_indices(name: str, n: int, fraction: float, seed: int, *, min_items: int = 1,
                    max_items: int | None = None) -> np.ndarray:
  """Sorted int64 indices of the held-out items of a source of `n` items; depends only on the arguments.

  round(fraction * n) items, clipped to [min_items, max_items] and never all of them (at most n - 1); none when
  n < 2 or fraction <= 0. The text corpus holds out documents with the defaults (at least one); the image sources
  use min_items=16, max_items=2000 so that a small source still gives a usable eval set and a large one a bounded
  one. The generator is seeded by (seed, crc32(name)), so each source's choice is independent of the others.
  """
  if n < 2 or fraction <= 0:
    return np.zeros((0,), np.int64)
  k = round(fraction * n)
  if max_items is not None:
    k = min(max_items, k)
  k = int(min(n - 1, max(min_items, k)))
  rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
  return np.sort(rng.choice(n, size=k, replace=False)).astype(np.int64)


def seed32(*parts: int) -> int:
  """A 32-bit seed derived from integers (e.g. (seed, process_index, stream number)); distinct parts give
  statistically independent seeds."""
  return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


def check_seq_len(seq_len: int) -> None:
  if not isinstance(seq_len, (int, np.integer)) or seq_len < 2:
    raise ValueError(f"seq_len={seq_len!r}: expected an int >= 2 (a row holds seq_len input/target pairs)")


def memmap(path: str, dtype: np.dtype) -> np.ndarray:
  """Read-only memory map of a flat array file [size / itemsize]; an empty file gives an empty array (np.memmap
  refuses empty files)."""
  if os.path.getsize(path) == 0:
    return np.zeros((0,), dtype)
  return np.memmap(path, dtype=dtype, mode="r")


def mp_prefetch(ds: Any, num_workers: int) -> Any:
  """`ds.mp_prefetch` over `num_workers` worker processes (a grain IterDataset in, one out)."""
  import grain  # noqa: PLC0415  (grain is only needed by the pipelines, not by preparation)
  from absl import flags  # noqa: PLC0415
  # grain's workers read absl flags; a script without absl.app.run never parsed them.
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  return ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=int(num_workers)))


def write_json(path: str, obj: Any) -> None:
  """Writes `obj` as indented JSON through a temporary file, so a reader never sees half a manifest."""
  with open(path + ".tmp", "w") as f:
    json.dump(obj, f, indent=1)
  os.replace(path + ".tmp", path)
