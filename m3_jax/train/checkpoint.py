"""Orbax checkpoints: the train state, the grain iterator state and the run config saved together; restore onto
any mesh (the abstract target carries the shardings of the mesh restored onto); params-only export."""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

try:
  import grain
  _GRAIN_SAVE, _GRAIN_RESTORE = grain.checkpoint.CheckpointSave, grain.checkpoint.CheckpointRestore
except (ImportError, AttributeError):  # the export/eval path needs no grain
  _GRAIN_SAVE = _GRAIN_RESTORE = None


class Checkpointer:
  """Periodic saves with keep-N under WORKDIR/checkpoints."""

  def __init__(self, directory: str, *, every: int, keep: int, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    self.every = every
    options = ocp.CheckpointManagerOptions(
        save_decision_policy=policies.FixedIntervalPolicy(max(every, 1)),
        preservation_policy=policies.LatestN(max(keep, 1)),
        enable_async_checkpointing=async_save,
        create=True,
    )
    self.manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def saved_config(self, step: int | None = None) -> dict | None:
    step = self.latest_step() if step is None else step
    if step is None:
      return None
    path = os.path.join(self.directory, str(step), "config", "metadata")
    if os.path.exists(path):
      with open(path) as f:
        return json.load(f)
    restored = self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
    return restored["config"]

  def save(self, step: int, state: Any, data_iter: Any, config: dict, *, force: bool = False) -> bool:
    items = {"state": ocp.args.StandardSave(state), "config": ocp.args.JsonSave(config)}
    if data_iter is not None and _GRAIN_SAVE is not None:
      items["data"] = _GRAIN_SAVE(data_iter)
    return self.manager.save(step, args=ocp.args.Composite(**items), force=force)

  def restore(self, step: int, abstract_state: Any, data_iter: Any = None) -> Any:
    """abstract_state: a pytree of jax.ShapeDtypeStruct with the target (possibly different) mesh's shardings.
    data_iter: a grain iterator whose position is restored in place."""
    items = {"state": ocp.args.StandardRestore(abstract_state)}
    if data_iter is not None and _GRAIN_RESTORE is not None:
      items["data"] = _GRAIN_RESTORE(data_iter)
    restored = self.manager.restore(step, args=ocp.args.Composite(**items))
    return restored["state"]

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def make_checkpointer(config, workdir: str) -> Checkpointer:
  """The experiment config's `checkpoint` section -> the Checkpointer of WORKDIR/checkpoints."""
  c = config.checkpoint
  return Checkpointer(os.path.join(workdir, "checkpoints"), every=int(c.every), keep=int(c.keep),
                      async_save=bool(c.get("async_save", True)))


def abstract_like(tree: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


# ---- params-only export ---------------------------------------------------------------------------------------

def export_params(path: str, params: Any, model_config: dict, *, dtype: str | None = None) -> str:
  """Writes PATH/params (orbax) + PATH/model_config.json; loadable without the optimizer."""
  path = os.path.abspath(path)
  if dtype is not None:
    target = jnp.dtype(dtype)
    params = jax.tree.map(lambda x: x.astype(target) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(os.path.join(path, "params"), params, force=True)
  ckptr.wait_until_finished()
  if jax.process_index() == 0:
    with open(os.path.join(path, "model_config.json"), "w") as f:
      json.dump(model_config, f, indent=2, sort_keys=True)
  return path


def is_export(path: str) -> bool:
  return os.path.exists(os.path.join(path, "model_config.json")) and os.path.isdir(os.path.join(path, "params"))


def load_export_config(path: str) -> dict:
  with open(os.path.join(path, "model_config.json")) as f:
    return json.load(f)


def restore_params(path: str, abstract_params: Any) -> Any:
  """Restores exported params onto `abstract_params`' shardings, casting to its dtypes (an export may be bf16)."""
  path = os.path.abspath(path)  # orbax refuses relative paths
  ckptr = ocp.StandardCheckpointer()
  meta = ckptr.metadata(os.path.join(path, "params"))
  stored = getattr(meta, "item_metadata", meta)
  # Restore in the stored dtype, then cast: orbax would otherwise refuse or silently reinterpret.
  try:
    stored_tree = jax.tree.map(lambda m: m.dtype, stored.tree if hasattr(stored, "tree") else stored)
    target = jax.tree.map(lambda a, dt: jax.ShapeDtypeStruct(a.shape, dt, sharding=a.sharding), abstract_params,
                          stored_tree)
  except Exception:  # structure mismatch: let orbax name the missing/unexpected keys
    target = abstract_params
  params = ckptr.restore(os.path.join(path, "params"), target)
  return jax.tree.map(lambda x, a: x.astype(a.dtype), params, abstract_params)
