"""Shared pytest setup: the markers of the test tiers and session fixtures for the expensive things tests share.

Markers: `slow` marks a test that takes over ~20 s on a 2-core CPU machine; `network` marks a test that downloads
packages (PyPI, Debian) when its cache is cold. The fast tier deselects both: `pytest -m "not slow and not network"`.

Directories come from pytest's tmp dirs, never from fixed /tmp paths. Data built per session goes under the
session's basetemp (`tmp_path_factory.mktemp`). The download caches, which make a second run offline and fast,
live in pytest's temp root beside its numbered session dirs (pytest rotates only those `pytest-N` dirs, so the
caches survive), or where $M3_DATA_DIR / $M3_VISION_TEST_DIR point. With an explicit --basetemp they live inside it
(pytest empties a given basetemp at start: such a run downloads again).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

import pytest

MARKERS = {
    "slow": "takes over ~20 s on a 2-core CPU machine; deselected by the fast tier (-m 'not slow and not network')",
    "network": "downloads packages (PyPI, Debian) when its cache is cold; deselected by the fast tier",
}


def pytest_configure(config: pytest.Config) -> None:
  for name, meaning in MARKERS.items():
    config.addinivalue_line("markers", f"{name}: {meaning}")
  # One persistent XLA compilation cache for the session, this process and the trainer / CLI subprocesses the
  # tests start (they inherit the variable): the same tiny programs are compiled again by many tests (each trainer
  # run, each resume). Fresh per session and removed after it, so no test ever reads another session's entries.
  # Set before any test module imports jax; an explicit JAX_COMPILATION_CACHE_DIR is left alone.
  # XLA:CPU's LLVM optimisation off for the session and the subprocesses that inherit XLA_FLAGS: the test programs
  # run for milliseconds but compile for seconds (the whole suite: 16.3 -> 13.0 min on 2 cores, every test passing
  # at unchanged tolerances; buffer assignment, which the memory tests read, is decided before LLVM).
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_backend_optimization_level" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_backend_optimization_level=0").strip()
  if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    cache = tempfile.mkdtemp(prefix="m3_jax_test_xla_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = cache
    config.add_cleanup(lambda: shutil.rmtree(cache, ignore_errors=True))


def _cache_root(tmp_path_factory: pytest.TempPathFactory, config: pytest.Config) -> pathlib.Path:
  """pytest's temp root (e.g. /tmp/pytest-of-<user>), which outlives a session; the basetemp itself if given."""
  base = tmp_path_factory.getbasetemp()
  return base if config.option.basetemp else base.parent


def _cache_dir(env: str, name: str, tmp_path_factory: pytest.TempPathFactory, config: pytest.Config) -> str:
  d = os.environ.get(env) or str(_cache_root(tmp_path_factory, config) / name)
  os.makedirs(d, exist_ok=True)
  return d


@pytest.fixture(scope="session")
def data_cache_dir(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> str:
  """Data directory of the real packaged text sources, kept across sessions: $M3_DATA_DIR, else
  <pytest temp root>/m3_jax_test_data. Its `raw/` subdirectory is the shared download cache."""
  return _cache_dir("M3_DATA_DIR", "m3_jax_test_data", tmp_path_factory, pytestconfig)


@pytest.fixture(scope="session")
def download_cache(data_cache_dir: str) -> str:
  """The package-download cache shared by every data-preparing test (<data_cache_dir>/raw): link it as `raw` into
  a per-session data directory so that its preparation downloads nothing already fetched."""
  raw = os.path.join(data_cache_dir, "raw")
  os.makedirs(raw, exist_ok=True)
  return raw


@pytest.fixture(scope="session")
def vision_cache_dir(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> str:
  """Data directory of the prepared image/video sources, kept across sessions: $M3_VISION_TEST_DIR, else
  <pytest temp root>/m3_jax_test_vision."""
  return _cache_dir("M3_VISION_TEST_DIR", "m3_jax_test_vision", tmp_path_factory, pytestconfig)


# Fixtures whose first use downloads packages; a test that uses one (directly or through another fixture) is a
# `network` test without having to say so.
_NETWORK_FIXTURES = {"data_cache_dir", "download_cache", "vision_cache_dir"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
  for item in items:
    if _NETWORK_FIXTURES & set(getattr(item, "fixturenames", ())):
      item.add_marker(pytest.mark.network)
