"""Held-out evaluation and export: the per-source metrics the trainer logs (`evaluate_sets`), and the `--mode=eval`
and `--mode=export` paths of m3_jax.main (params from a train checkpoint or an export directory)."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Callable

import jax
import ml_collections
import numpy as np

from m3_jax.core import sharding
from m3_jax.data import inputs
from m3_jax.train import checkpoint as ckpt_lib
from m3_jax.train import checks, config_lib
from m3_jax.train.metrics import log
from m3_jax.train.optimizer import make_optimizer
from m3_jax.train.state import ModelConfig, abstract_state, param_shardings
from m3_jax.train.steps import make_eval_step, to_global


def evaluate_sets(eval_fn: Callable, params, rest, sets: dict[str, list[dict]],
                  mesh: jax.sharding.Mesh) -> dict[str, float]:
  """Per source: loss and perplexity over every target token with loss_mask (text only in a VL batch), the
  teacher-forced next-token accuracy, and both again over each extra mask of the set (`eval/synthetic_video/
  direction_loss`, `.../direction_accuracy`: the caption tokens that need the clip's temporal order)."""
  out = {}
  for name, batches in sets.items():
    sums: dict[str, float] = {}
    for b in batches:
      for k, v in jax.device_get(eval_fn(params, rest, to_global(b, mesh))).items():
        sums[k] = sums.get(k, 0.0) + float(v)
    loss = sums["loss_sum"] / max(sums["tokens"], 1.0)
    out[f"eval/{name}/loss"] = loss
    out[f"eval/{name}/perplexity"] = float(math.exp(min(loss, 50.0)))
    out[f"eval/{name}/accuracy"] = sums["correct"] / max(sums["tokens"], 1.0)
    out[f"eval/{name}/tokens"] = sums["tokens"]
    for k in sorted(sums):
      if k.endswith("/tokens"):
        sub = k[:-len("/tokens")]
        n = max(sums[k], 1.0)
        out[f"eval/{name}/{sub}_loss"] = sums[f"{sub}/loss_sum"] / n
        out[f"eval/{name}/{sub}_accuracy"] = sums[f"{sub}/correct"] / n
        out[f"eval/{name}/{sub}_tokens"] = sums[k]
  if out:
    losses = [v for k, v in out.items() if k.endswith("/loss")]
    out["eval/mean_loss"] = float(np.mean(losses))
  return out


def load_params(config: ml_collections.ConfigDict, workdir: str, mesh: jax.sharding.Mesh,
                checkpoint: str | None = None) -> tuple[ModelConfig, Any, Any, Any, str]:
  """(model config, graphdef, params, rest, what was loaded) from an export directory (params-only) or the latest
  train checkpoint of `workdir`."""
  path = checkpoint or config.get("eval_checkpoint", "") or ""
  if path and ckpt_lib.is_export(path):
    cfg = config_lib.model_config_from_export(ckpt_lib.load_export_config(path))
    graphdef, (params, rest), (p_sh, r_sh) = param_shardings(cfg, mesh)
    both = ckpt_lib.restore_params(path, ckpt_lib.abstract_like({"params": params, "rest": rest},
                                                                {"params": p_sh, "rest": r_sh}))
    return cfg, graphdef, both["params"], both["rest"], f"export {path}"
  cfg = config_lib.model_config(config)
  ocfg = config_lib.optim_config(config)
  tx, _ = make_optimizer(ocfg)
  ckpt = ckpt_lib.make_checkpointer(config, path or workdir)
  step = ckpt.latest_intact_step()  # a corrupt newer step is skipped with a warning (the trainer moves it aside)
  if step is None:
    raise FileNotFoundError(f"no intact checkpoint in {ckpt.directory} and no export directory given")
  checks.check_compatible(ckpt.saved_config(step), config_lib.to_jsonable(config), workdir)
  graphdef, abstract, _ = abstract_state(cfg, tx, mesh)
  state, step = ckpt.restore_latest(abstract)
  ckpt.close()
  if state is None:
    raise FileNotFoundError(f"no intact checkpoint in {ckpt.directory} and no export directory given")
  return cfg, graphdef, state.params, state.rest, f"checkpoint step {step} of {ckpt.directory}"


def evaluate(config: ml_collections.ConfigDict, workdir: str, checkpoint: str | None = None) -> dict:
  """--mode=eval: every held-out set of `config` on the params `load_params` finds; writes
  WORKDIR/eval_results.json and returns the metrics."""
  mesh = sharding.make_mesh(dict(config.mesh))
  cfg, graphdef, params, rest, what = load_params(config, workdir, mesh, checkpoint)
  inputs.prepare(config, vision=config_lib.is_multimodal(config))
  # The sets are shaped by the config's model (as in training); the batches are checked against the loaded one.
  evals = inputs.eval_sets(config, config_lib.vision_config(config_lib.model_config(config)))
  checks.check_eval_sets(evals, cfg)
  p_sh = jax.tree.map(lambda x: x.sharding, params)
  r_sh = jax.tree.map(lambda x: x.sharding, rest)
  eval_step = jax.jit(make_eval_step(graphdef, int(config.train.get("loss_chunk", 0))),
                      in_shardings=(p_sh, r_sh, sharding.batch_sharding(mesh)))
  with jax.set_mesh(mesh):
    ev = evaluate_sets(eval_step, params, rest, evals, mesh)
  log(f"evaluated {what}:")
  for k, v in ev.items():
    log(f"  {k} = {v:.4f}")
  path = os.path.join(workdir, "eval_results.json")
  if jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
    with open(path, "w") as f:
      json.dump({"source": what, **ev}, f, indent=2)
  log(f"wrote {path}")
  return ev


def export(config: ml_collections.ConfigDict, workdir: str) -> str:
  """--mode=export: the params of WORKDIR's latest checkpoint (in `export.dtype`) and their model config, to
  `export.path` (default WORKDIR/export); returns the path."""
  mesh = sharding.make_mesh(dict(config.mesh))
  cfg, _, params, rest, what = load_params(config, workdir, mesh)
  out = config.export.get("path") or os.path.join(workdir, "export")
  dtype = config.export.get("dtype") or None
  ckpt_lib.export_params(out, {"params": params, "rest": rest}, cfg.to_dict(), dtype=dtype)
  log(f"exported params of {what} ({dtype or 'original dtype'}) to {out}")
  return out
