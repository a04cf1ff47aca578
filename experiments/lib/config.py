"""A driver's config: configs/{name}.py get_config(arg) with the data directory and dotted command-line overrides;
the flags every sweep driver shares; the persistent compilation cache."""

from __future__ import annotations

import argparse
import importlib
import os

import jax
import ml_collections

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def config_arg(*parts: str) -> str:
  """get_config argument pieces joined by commas, empty ones left out: ("size=cpu,seed=0", "", "attn=cudnn")."""
  return ",".join(p for p in parts if p)


def apply_overrides(config: ml_collections.ConfigDict, overrides: list[str]) -> ml_collections.ConfigDict:
  """Sets each "a.b.c=VALUE" of `overrides` on `config` (in place), converted to the type of the value it replaces
  (a bool from 1/true/yes, anything else false). Returns `config`."""
  for item in overrides:
    key, eq, value = item.partition("=")
    if not eq:
      raise SystemExit(f"--override {item!r}: expected KEY=VALUE, e.g. train.steps=100")
    node = config
    *path, last = key.split(".")
    for p in path:
      node = node[p]
    old = node[last]
    node[last] = type(old)(value) if not isinstance(old, bool) else value.lower() in ("1", "true", "yes")
  return config


def load_config(name: str, arg: str, *, data_dir: str, overrides: list[str]) -> ml_collections.ConfigDict:
  """configs/{name}.py's get_config(arg) reading data from `data_dir`, with the --override items applied."""
  c = importlib.import_module(f"configs.{name}").get_config(arg)
  c.data.dir = data_dir
  return apply_overrides(c, overrides)


def add_config_flags(ap: argparse.ArgumentParser, name: str, *, config_arg_example: str) -> None:
  """--steps, --data_dir, --sweep_dir (default workdirs/{name}), --config_arg and --override."""
  ap.add_argument("--steps", type=int, default=0, help="train steps (0: the size's default)")
  ap.add_argument("--data_dir", default=os.path.join(REPO, "data"))
  ap.add_argument("--sweep_dir", default=os.path.join(REPO, "workdirs", name))
  ap.add_argument("--config_arg", default="", help=f"more configs/{name}.py arguments, e.g. {config_arg_example}")
  ap.add_argument("--override", action="append", default=[], help="KEY=VALUE on the config, e.g. train.steps=50")


def add_cache_flag(ap: argparse.ArgumentParser, *, shared: str) -> None:
  """--compilation_cache; `shared` says which programs the runs of the sweep share through it."""
  ap.add_argument("--compilation_cache", default="",
                  help=f"persistent XLA cache directory ('' = SWEEP_DIR/.jax_cache, 'none' = off): {shared}")


def enable_compilation_cache(flag: str, sweep_dir: str) -> str | None:
  """Turns on JAX's persistent compilation cache in `flag` ('' = SWEEP_DIR/.jax_cache; 'none' = off), for every
  program however quick to compile (the runs of a sweep compile the same init and eval programs). Returns the
  directory or None."""
  if flag == "none":
    return None
  path = flag or os.path.join(sweep_dir, ".jax_cache")
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  return path
