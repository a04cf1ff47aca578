"""The trainer, in the order things happen: config, mesh, checkpoint compatibility, data, model and state, compile,
loop, final eval. `train_and_evaluate` is `--mode=train` of m3_jax.main (eval and export: train/evaluation.py).

One trainer for both model kinds: a config with a `vision` section (configs/tiny_vlm.py) trains the VLModel on
interleaved text / image-caption / video-caption batches (the contract of m3_jax/models/multimodal.py); any other
config trains the TextModel on packed text. The pieces live beside it: train/state.py (the model kind, the state
born sharded), train/checks.py (everything refused before compilation), m3_jax/data/inputs.py (config -> batches),
train/steps.py (the pure steps), train/loop.py (what happens around each step), train/evaluation.py."""

from __future__ import annotations

import os

import jax
import ml_collections

from m3_jax.core import sharding
from m3_jax.data import inputs
from m3_jax.models.config import VLConfig
from m3_jax.train import checkpoint as ckpt_lib
from m3_jax.train import checks, config_lib, evaluation, loop
from m3_jax.train import state as state_lib
from m3_jax.train.metrics import log
from m3_jax.train.optimizer import make_optimizer
from m3_jax.train.steps import make_eval_step, make_train_step, to_global


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains `config` in `workdir` (resuming from its newest intact checkpoint) and returns the final eval metrics.
  The workdir is locked for the run: a second trainer on it is refused, naming the one that holds it."""
  # ============================================================================================== config ==
  config_lib.check_train_config(config)
  cfg = config_lib.model_config(config)
  # ============================================================================= workdir (one trainer only) ==
  os.makedirs(workdir, exist_ok=True)
  with ckpt_lib.WorkdirLock(workdir), ckpt_lib.short_library_errors():
    return _train_and_evaluate(config, cfg, workdir)


def _train_and_evaluate(config: ml_collections.ConfigDict, cfg: state_lib.ModelConfig, workdir: str) -> dict:
  text_cfg = config_lib.text_config(cfg)
  run_config = config_lib.to_jsonable(config)
  steps = int(config.train.steps)

  # ================================================================================================ mesh ==
  mesh = sharding.make_mesh(dict(config.mesh))
  checks.check_fits(cfg, config, mesh)
  log(f"mesh {dict(mesh.shape)} on {jax.device_count()} {jax.devices()[0].platform} device(s), "
      f"{jax.process_count()} process(es)")

  # ======================================================== checkpoint compatibility (before any data work) ==
  # The writer removes interrupted saves' temporaries; the newest intact step has passed its digest (broken newer
  # steps are moved aside with a warning).
  ckpt = ckpt_lib.make_checkpointer(config, workdir, writer=True)
  latest = ckpt.latest_intact_step()
  checks.check_compatible(ckpt.saved_config(latest) if latest is not None else None, run_config, workdir)

  # ================================================================================================ data ==
  checks.check_vocab(cfg, inputs.prepare(config, vision=config_lib.is_multimodal(config)))
  data_iter = inputs.train_iterator(config, config_lib.vision_config(cfg))
  evals = inputs.eval_sets(config, config_lib.vision_config(cfg))
  checks.check_eval_sets(evals, cfg)

  # ============================== model, optimizer, state born sharded (or restored: then nothing is initialised) ==
  tx, schedule = make_optimizer(config_lib.optim_config(config))
  graphdef, abstract, state_sh = state_lib.abstract_state(cfg, tx, mesh)
  n_params = sum(x.size for x in jax.tree.leaves(abstract.params))
  log(f"model: {n_params / 1e6:.2f}M parameters, layers {text_cfg.layer_types} / {text_cfg.mlp_layer_types}"
      + (f"; vision tower {cfg.vision.num_hidden_layers} x {cfg.vision.hidden_size}, max_frames "
         f"{cfg.vision.max_frames}" if isinstance(cfg, VLConfig) else ""))
  state = None
  if latest is not None:
    state, latest = ckpt.restore_latest(abstract, data_iter)  # intact, restorable and finite
    if state is not None:
      log(f"resumed from step {latest} in {workdir}")
  start = int(jax.device_get(state.step)) if state is not None else 0
  data_start = data_iter.get_state() if state is None else None  # for the fresh run's step-0 checkpoint
  # The first batch is checked before anything is compiled: a bad batch is a clear error here, not minutes later
  # (or a shape error inside the compiled step).
  host_batch = next(data_iter) if start < steps else None
  if host_batch is not None:
    checks.check_host_batch(host_batch, cfg, f"train batch {start + 1}")
  if state is None:
    graphdef, state, state_sh = state_lib.init_state(cfg, tx, mesh, int(config.train.seed))
    if config.get("init_from"):
      state = state_lib.init_from_export(state, config.init_from, mesh, cfg)

  # ============================================================================= compile (ahead of time) ==
  train_step = jax.jit(make_train_step(graphdef, tx, schedule, moe_aux_coef=float(text_cfg.router_aux_loss_coef),
                                       kl_weight=text_cfg.kl_weight,
                                       router_bias_rate=float(text_cfg.router_bias_update_rate),
                                       loss_chunk=int(config.train.loss_chunk)),
                       in_shardings=(state_sh, sharding.batch_sharding(mesh)),
                       out_shardings=(state_sh, None), donate_argnums=(0,))
  eval_step = jax.jit(make_eval_step(graphdef, int(config.train.loss_chunk)),
                      in_shardings=(state_sh.params, state_sh.rest, sharding.batch_sharding(mesh)))
  batch = to_global(host_batch, mesh) if host_batch is not None else None
  with jax.set_mesh(mesh):
    compiled = loop.compile_step(train_step, state, batch) if batch is not None else None

  # ================================================================================================ loop ==
  run = loop.Loop(config, workdir, ckpt=ckpt, data_iter=data_iter, run_config=run_config, start=start,
                  last_saved=latest, flops_per_step=loop.train_flops_per_step(cfg, config, host_batch),
                  evaluate=lambda s: evaluation.evaluate_sets(eval_step, s.params, s.rest, evals, mesh))
  if data_start is not None:
    run.save_initial(state, data_start)
  state, step = _train(run, compiled, state, batch, data_iter, cfg, mesh)

  # ========================================================================================== final eval ==
  final_eval = run.final_eval
  if not final_eval and steps <= start:
    final_eval = evaluation.evaluate_sets(eval_step, state.params, state.rest, evals, mesh)
  if run.first_eval and final_eval:
    log(f"held-out mean loss over {len(evals)} sources: {run.first_eval['eval/mean_loss']:.3f} (step 0) -> "
        f"{final_eval['eval/mean_loss']:.3f} (step {step})")
  log(f"done: {workdir} holds checkpoints/ (step {ckpt.last_good}), metrics.jsonl and tb/")
  return final_eval


def _train(run: loop.Loop, train_step, state: state_lib.TrainState, batch: dict | None, data_iter,
           cfg: state_lib.ModelConfig, mesh: jax.sharding.Mesh) -> tuple[state_lib.TrainState, int]:
  """The loop from `run.start` to `run.steps`: an eval at step 0 (the starting point, so a run shows how far
  held-out loss fell), then step, log / save / eval as due, the next batch checked on the host. The state is
  saved at the end, on SIGTERM (then the loop stops cleanly) and on Ctrl-C; never one that failed the divergence
  check."""
  step = run.start
  failed = True
  try:
    with jax.set_mesh(mesh):
      if run.start == 0 and run.eval_every > 0:
        run.first_eval = run.evaluate(0, state)
      while step < run.steps:
        run.before_step(step + 1)
        state, metrics = train_step(state, batch)
        step += 1
        run.after_step(step, state, metrics)
        if run.stop_requested:
          run.message(f"SIGTERM: saving step {step} and stopping")
          run.save(step, state, force=True)
          break
        if step < run.steps:
          host_batch = next(data_iter)
          checks.check_host_batch(host_batch, cfg, f"train batch {step + 1}")
          batch = to_global(host_batch, mesh)
      else:
        if run.last_saved != step:
          run.save(step, state, force=True)
    failed = False
  except KeyboardInterrupt:
    run.message(f"interrupted: saving step {step}")
    run.save(step, state, force=True)
    failed = False
    raise
  finally:
    run.close(failed=failed)
  return state, step
