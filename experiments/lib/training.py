"""Every call the experiment drivers make into the trainer, the data wiring and the models.

The drivers train, restore, evaluate and measure runs only through this module (and read metrics.jsonl through
experiments/lib/metrics.py): when the trainer (m3_jax/train: state, checks, steps, evaluation, checkpoint), the
config -> data wiring (m3_jax/data/inputs.py) or the models change their names, this one file follows them.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from m3_jax.core import sharding
from m3_jax.data import inputs, text_pipeline, vision_prepare
from m3_jax.data.vision_pipeline import EVAL_ONLY_SOURCES, SYNTHETIC_VIDEO
from m3_jax.models import flops, multimodal
from m3_jax.train import config_lib, evaluation, trainer
from m3_jax.train import state as state_lib
from m3_jax.train.checkpoint import make_checkpointer
from m3_jax.train.loop import Diverged  # noqa: F401  (what train() raises on a non-finite loss or state)
from m3_jax.train.optimizer import make_optimizer, wsd_decay_start
from m3_jax.train.steps import forward, make_train_step, to_global

Config = ml_collections.ConfigDict


# ================================================================================================ train a run ==

def prepare_data(config: Config) -> None:
  """Prepares config.data.dir (text corpus, and the vision sources of a VL config); a prepared one is reused."""
  inputs.prepare(config, vision=config_lib.is_multimodal(config))


def train(config: Config, workdir: str) -> None:
  """Trains `config` in `workdir`, resuming from its latest checkpoint (a finished run only evaluates again)."""
  trainer.train_and_evaluate(config, workdir)


def export(config: Config, workdir: str) -> str:
  """--mode=export of `workdir`'s latest checkpoint (to config.export.path, default WORKDIR/export); the path."""
  return evaluation.export(config, workdir)


def trained_steps(config: Config, workdir: str) -> int:
  """The step of the latest checkpoint in `workdir` (0: none)."""
  ckpt = make_checkpointer(config, workdir)
  step = ckpt.latest_step() or 0
  ckpt.close()
  return step


# ================================================================================================ the config ==

def model_config(config: Config):
  """The model config (TextConfig or VLConfig) of an experiment config."""
  return config_lib.model_config(config)


def schedule_points(config: Config) -> dict:
  """Where the LR schedule changes: {"warmup", "decay_start" (first WSD decay step), "lr_scale", "lr_scale_from"}."""
  o = config_lib.optim_config(config)
  return {"warmup": o.warmup_steps, "decay_start": wsd_decay_start(o), "lr_scale": o.lr_scale,
          "lr_scale_from": o.lr_scale_from}


def vision_flops(cfg, frames: int, height: int, width: int) -> float:
  """Vision tower + projector forward FLOPs per clip of `frames` x `height` x `width` pixels (closed form)."""
  return flops.vision_flops(cfg, frames, height, width)


# ================================================================================================ held-out data ==

def _vision_config(config: Config):
  """The VisionConfig the data pipeline shapes pixels for (None for a text config)."""
  return config_lib.vision_config(config_lib.model_config(config))


def source_kinds(config: Config) -> dict[str, list[str]]:
  """Held-out sets by kind: text sources, image-caption sources, synthetic video, real clips (evaluation only)."""
  evaluated = inputs.vl_eval_sources(config, _vision_config(config))
  images = vision_prepare.load_vision_manifest(config.data.dir).image_sources
  return {"text": text_pipeline.list_sources(config.data.dir),
          "image": [s for s in evaluated if s in images],
          "video": [s for s in evaluated if s == SYNTHETIC_VIDEO],
          "real": [s for s in evaluated if s in EVAL_ONLY_SOURCES]}


def eval_batches(config: Config, name: str) -> list[dict]:
  """The held-out host batches of the multimodal source `name` (as the trainer evaluates them)."""
  return inputs.vl_eval_batches(config, _vision_config(config), name)


def to_devices(host_batch: dict, mesh) -> dict:
  """A host batch as global arrays sharded over the batch axes of `mesh`."""
  return to_global(host_batch, mesh)


# ============================================================================================ trained models ==

def load_trained(config: Config, workdir: str) -> tuple:
  """(mesh, graphdef, params, rest) of the latest checkpoint of `workdir`."""
  mesh = sharding.make_mesh(dict(config.mesh))
  _, graphdef, params, rest, _ = evaluation.load_params(config, workdir, mesh)
  return mesh, graphdef, params, rest


def attention_capture(graphdef) -> Callable:
  """jitted (params, rest, batch) -> (text->visual attention mass [layers, heads] over the batch's text queries that
  see visual tokens, their count, head-mean attention of the batch's first row [layers, 1, T, T])."""

  @jax.jit
  def capture(params, rest, batch):
    _, aux = forward(graphdef, params, rest, batch, capture_attention=True)
    probs = jnp.stack([p.mean(axis=1) for p in aux["attention_probs"]])  # [layers, B, T, T]: mean over heads
    return aux["text_to_visual_attention"], aux["text_to_visual_queries"], probs[:, :1]

  return capture


def text_to_visual_mass(probs, is_visual, segment_ids):
  """(mass [..., heads] mean over the text queries that see visual tokens of their segment, number of those
  queries) of attention probabilities [B, heads, T, S] (m3_jax.models.multimodal.text_to_visual_mass)."""
  return multimodal.text_to_visual_mass(probs, is_visual, segment_ids)


def restored_train_step(config: Config, workdir: str) -> dict:
  """The trainer's train step, built as the trainer builds it (so the compilation cache serves it), the latest state
  of `workdir` and one real training batch on the devices: {"mesh", "graphdef", "step", "state", "batch"}."""
  config = config.copy_and_resolve_references()
  config.data.num_workers = 0  # one batch is enough
  cfg = config_lib.model_config(config)
  mesh = sharding.make_mesh(dict(config.mesh))
  tx, schedule = make_optimizer(config_lib.optim_config(config))
  graphdef, abstract, state_sh = state_lib.abstract_state(cfg, tx, mesh)
  ckpt = make_checkpointer(config, workdir)
  state = ckpt.restore(ckpt.latest_step(), abstract)
  ckpt.close()
  batch = to_global(next(inputs.train_iterator(config, config_lib.vision_config(cfg))), mesh)
  text_cfg = config_lib.text_config(cfg)
  step = jax.jit(make_train_step(graphdef, tx, schedule, moe_aux_coef=float(text_cfg.router_aux_loss_coef),
                                 kl_weight=text_cfg.kl_weight,
                                 router_bias_rate=float(text_cfg.router_bias_update_rate)),
                 in_shardings=(state_sh, sharding.batch_sharding(mesh)), out_shardings=(state_sh, None),
                 donate_argnums=(0,))
  return {"mesh": mesh, "graphdef": graphdef, "step": step, "state": state, "batch": batch}


def tower_forward(graphdef) -> Callable:
  """jitted (params, rest, videos) -> the VL model's visual embeddings (vision tower + projector forward)."""

  @jax.jit
  def tower(params, rest, videos):
    return nnx.merge(graphdef, params, rest).encode(videos)

  return tower
