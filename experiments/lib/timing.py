"""Wall time of jitted calls: warm-up calls first (compilation, autotuning), then the median of timed ones, each
waiting for its results."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax


def timeit(fn: Callable, *args, warmup: int = 2, repeat: int = 5) -> float:
  """Median seconds of `repeat` calls fn(*args) after `warmup` untimed ones."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeat):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)
