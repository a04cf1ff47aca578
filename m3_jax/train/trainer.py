"""The trainer: one readable file, in the order things happen (config, mesh, data, model, shard, step,
checkpoint, evals, loop). `train_and_evaluate`, `evaluate` and `export` are the three `--mode`s of m3_jax.main."""

from __future__ import annotations

import json
import math
import os
import signal
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from m3_jax.models.config import TextConfig, train_flops_per_token
from m3_jax.models.transformer import TextModel
from m3_jax.train import checkpoint as ckpt_lib
from m3_jax.train import config_lib, sharding
from m3_jax.train.metrics import MetricWriter, Progress, peak_flops
from m3_jax.train.optimizer import make_optimizer
from m3_jax.train.steps import TrainState, make_eval_step, make_train_step

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


def log(msg: str) -> None:
  if jax.process_index() == 0:
    print(msg, flush=True)


# ============================================================================================ model + sharding ==

def abstract_model(cfg: TextConfig):
  """(graphdef, abstract params, abstract rest) without allocating anything."""
  model = nnx.eval_shape(lambda: TextModel(cfg, rngs=nnx.Rngs(0)))
  return nnx.split(model, nnx.Param, ...)


def param_shardings(cfg: TextConfig, mesh) -> tuple[Any, Any, Any]:
  graphdef, params, rest = abstract_model(cfg)
  p_sh = sharding.state_shardings(params, mesh)
  r_sh = sharding.state_shardings(rest, mesh)
  return graphdef, (params, rest), (p_sh, r_sh)


def make_init_fn(cfg: TextConfig, tx):
  """key -> a fresh TrainState; jitted with out_shardings it builds the state directly on the mesh."""

  def init(key):
    model = TextModel(cfg, rngs=nnx.Rngs(params=key))
    _, p, r = nnx.split(model, nnx.Param, ...)
    return TrainState(step=jnp.zeros((), jnp.int32), params=p, rest=r, opt_state=tx.init(p),
                      rng=jax.random.fold_in(key, 1))

  return init


def init_state(cfg: TextConfig, tx, mesh, seed: int) -> tuple[Any, TrainState, Any]:
  """Creates the train state already sharded: jit(init, out_shardings=...) so no host ever holds it whole."""
  graphdef, (params, rest), (p_sh, r_sh) = param_shardings(cfg, mesh)

  init = make_init_fn(cfg, tx)
  abstract = jax.eval_shape(init, jax.random.key(seed))
  state_sh = state_shardings_for(abstract, p_sh, r_sh, mesh)
  with jax.set_mesh(mesh):
    state = jax.jit(init, out_shardings=state_sh)(jax.random.key(seed))
  return graphdef, state, state_sh


def state_shardings_for(abstract: TrainState, p_sh, r_sh, mesh) -> TrainState:
  """Optimizer moments shard like their parameters; scalars (counts, step, rng) are replicated."""
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  p_struct = jax.tree.structure(abstract.params)

  def is_param_tree(x) -> bool:  # optax keeps mu/nu as pytrees with exactly the params' structure
    return jax.tree.structure(x) == p_struct

  opt_sh = jax.tree.map(lambda x: p_sh if is_param_tree(x) else replicated, abstract.opt_state,
                        is_leaf=is_param_tree)
  return TrainState(step=replicated, params=p_sh, rest=r_sh, opt_state=opt_sh, rng=replicated)


def init_from_export(state: TrainState, path: str, mesh) -> TrainState:
  """Warm start from an export (e.g. dense -> MSA, the paper's MSA-CPT): every parameter the export has is
  copied (same path, same shape); the rest (MSA index projections and norms) keep their fresh initialisation.
  The optimizer starts fresh at step 0."""
  if not ckpt_lib.is_export(path):
    raise FileNotFoundError(f"init_from={path!r} is not an export directory (made by --mode=export)")
  src_cfg = TextConfig.from_dict(ckpt_lib.load_export_config(path))
  _, (params, rest), (p_sh, r_sh) = param_shardings(src_cfg, mesh)
  src = ckpt_lib.restore_params(path, ckpt_lib.abstract_like({"params": params, "rest": rest},
                                                             {"params": p_sh, "rest": r_sh}))
  src_map = {**dict(nnx.to_flat_state(src["params"])), **dict(nnx.to_flat_state(src["rest"]))}
  copied, fresh = 0, []

  def take(tree):
    nonlocal copied
    out = []
    for key, var in nnx.to_flat_state(tree):
      if key in src_map:
        new = src_map[key].get_value()
        if new.shape != var.get_value().shape:
          raise ValueError(f"init_from: {'/'.join(map(str, key))} has shape {new.shape} in {path}, "
                           f"{var.get_value().shape} in this model")
        out.append((key, var.replace(new.astype(var.get_value().dtype))))
        copied += 1
      else:
        fresh.append("/".join(map(str, key)))
        out.append((key, var))
    return nnx.from_flat_state(out)

  state = state.replace(params=take(state.params), rest=take(state.rest))
  log(f"initialised {copied} tensors from {path}; fresh: {fresh if len(fresh) < 12 else fresh[:12] + ['...']}")
  return state


# ======================================================================================================= data ==

def parse_text_files(spec: str) -> dict[str, list[str]] | None:
  """"NAME=GLOB[,GLOB][;NAME=GLOB]" -> {NAME: [files]}; a glob matching nothing is an error, not a silent skip."""
  import glob  # noqa: PLC0415
  if not spec:
    return None
  out = {}
  for part in spec.split(";"):
    name, eq, globs = part.partition("=")
    if not eq or not name.strip():
      raise ValueError(f"data.text_files: {part!r} is not NAME=GLOB[,GLOB]")
    files = sorted(f for g in globs.split(",") for f in glob.glob(os.path.expanduser(g.strip())))
    if not files:
      raise FileNotFoundError(f"data.text_files: {globs!r} matches no file for source {name!r}")
    out[name.strip()] = files
  return out


def prepare_data(config: ml_collections.ConfigDict):
  """Idempotent: the first call builds data.dir (downloads, BPE, token files), later calls read the manifest."""
  from m3_jax.data import corpus  # noqa: PLC0415  (keeps `eval`/`export` free of the data deps)
  d = config.data
  if d.use_builtin:
    sources = tuple(d.sources) if d.sources else None  # None: the default built-in set
  else:
    sources = ()
  return corpus.prepare(d.dir, sources=sources, text_files=parse_text_files(d.text_files),
                        vocab_size=int(d.vocab_size), verbose=jax.process_index() == 0)


def train_iterator(config: ml_collections.ConfigDict):
  from m3_jax.data import pipeline  # noqa: PLC0415
  d, t = config.data, config.train
  ds = pipeline.make_train_dataset(d.dir, seq_len=int(t.seq_len), global_batch_size=int(t.batch_size),
                                   seed=int(t.seed), process_index=jax.process_index(),
                                   process_count=jax.process_count(), num_workers=int(d.num_workers))
  return iter(ds)


def eval_sets(config: ml_collections.ConfigDict) -> dict[str, list[dict]]:
  """Every prepared source's fixed held-out split (per-source loss and perplexity)."""
  from m3_jax.data import pipeline  # noqa: PLC0415
  d, t = config.data, config.train
  return {name: pipeline.make_eval_batches(d.dir, name, seq_len=int(t.seq_len),
                                           batch_size=int(config.eval.batch_size),
                                           max_batches=int(config.eval.max_batches))
          for name in pipeline.list_sources(d.dir)}


def to_global(batch: dict, mesh) -> dict:
  """Host-local numpy batch -> global jax.Arrays sharded over the batch axes."""
  sh = sharding.batch_sharding(mesh)
  return {k: jax.make_array_from_process_local_data(sh, np.asarray(batch[k])) for k in BATCH_KEYS}


# ================================================================================================== checks ==

def check_fits(cfg: TextConfig, config: ml_collections.ConfigDict, mesh) -> None:
  div = sharding.batch_divisor(mesh)
  bs = int(config.train.batch_size)
  if bs % div:
    raise ValueError(f"train.batch_size={bs} is not divisible by the batch-parallel mesh size {div} "
                     f"(data x fsdp x expert of mesh {dict(mesh.shape)})")
  if bs % jax.process_count():
    raise ValueError(f"train.batch_size={bs} is not divisible by the process count {jax.process_count()}")
  eb = int(config.eval.batch_size)
  if eb % div:
    raise ValueError(f"eval.batch_size={eb} is not divisible by the batch-parallel mesh size {div}")
  param_shardings(cfg, mesh)  # raises, naming the parameter, if a dim does not divide over its mesh axes


def check_vocab(cfg: TextConfig, manifest) -> None:
  vocab = int(getattr(manifest, "vocab_size", None) or manifest["vocab_size"])
  if vocab > cfg.vocab_size:
    raise ValueError(f"the tokenizer has {vocab} tokens but model.vocab_size={cfg.vocab_size}")


def _param_shapes(model: dict) -> dict[str, tuple]:
  import dataclasses  # noqa: PLC0415
  known = {f.name for f in dataclasses.fields(TextConfig)}
  cfg = TextConfig.from_dict({k: v for k, v in model.items() if k in known})
  _, params, rest = abstract_model(cfg)
  return {"/".join(map(str, k)): tuple(v.get_value().shape)
          for tree in (params, rest) for k, v in nnx.to_flat_state(tree)}


def check_compatible(saved: dict | None, current: dict, workdir: str) -> None:
  """A checkpoint restores into the current model iff every parameter has the same path and shape; switches that
  do not change parameters (attention_impl, remat, dtype, MSA warmup, ...) may differ."""
  if not saved:
    return
  old, new = saved.get("model", {}), current["model"]
  if _param_shapes(old) == _param_shapes(new):
    return
  diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
  details = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in diff[:8])
  raise ValueError(f"workdir {workdir} holds a checkpoint of a different model ({details}); "
                   "use a fresh --workdir or the same model config")


# ===================================================================================================== train ==

def _compile(fn, *args):
  t0 = time.time()
  compiled = fn.lower(*args).compile()
  mem = compiled.memory_analysis()
  if mem is not None:
    gib = lambda b: b / 2**30  # noqa: E731
    log(f"compiled in {time.time() - t0:.1f}s; per-device memory: args {gib(mem.argument_size_in_bytes):.3f} GiB, "
        f"outputs {gib(mem.output_size_in_bytes):.3f} GiB, temps {gib(mem.temp_size_in_bytes):.3f} GiB")
  return compiled


def evaluate_sets(eval_fn, params, rest, sets: dict[str, list[dict]], mesh) -> dict[str, float]:
  out = {}
  for name, batches in sets.items():
    loss_sum = tokens = 0.0
    for b in batches:
      m = jax.device_get(eval_fn(params, rest, to_global(b, mesh)))
      loss_sum += float(m["loss_sum"])
      tokens += float(m["tokens"])
    loss = loss_sum / max(tokens, 1.0)
    out[f"eval/{name}/loss"] = loss
    out[f"eval/{name}/perplexity"] = float(math.exp(min(loss, 50.0)))
    out[f"eval/{name}/tokens"] = tokens
  if out:
    losses = [v for k, v in out.items() if k.endswith("/loss")]
    out["eval/mean_loss"] = float(np.mean(losses))
  return out


class _Stop:
  """Turns SIGTERM into a clean stop between steps (the checkpoint is saved, nothing is lost)."""

  def __init__(self):
    self.requested = False
    try:
      signal.signal(signal.SIGTERM, self._handler)
    except ValueError:  # not the main thread
      pass

  def _handler(self, *_):
    self.requested = True


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains `config` in `workdir` (resuming from its latest checkpoint) and returns the final eval metrics."""
  # ---- config -------------------------------------------------------------------------------------------------
  config_lib.check_train_config(config)
  cfg = config_lib.model_config(config)
  ocfg = config_lib.optim_config(config)
  run_config = config_lib.to_jsonable(config)
  os.makedirs(workdir, exist_ok=True)
  steps = int(config.train.steps)

  # ---- mesh -------------------------------------------------------------------------------------------------------
  mesh = sharding.make_mesh(dict(config.mesh))
  check_fits(cfg, config, mesh)
  log(f"mesh {dict(mesh.shape)} on {jax.device_count()} {jax.devices()[0].platform} device(s), "
      f"{jax.process_count()} process(es)")

  # ---- checkpoint compatibility (before any data work or compilation) -------------------------------------------
  ckpt = make_checkpointer(config, workdir)
  latest = ckpt.latest_step()
  check_compatible(ckpt.saved_config(latest) if latest is not None else None, run_config, workdir)

  # ---- data -------------------------------------------------------------------------------------------------------
  manifest = prepare_data(config)
  check_vocab(cfg, manifest)
  data_iter = train_iterator(config)
  evals = eval_sets(config)

  # ---- model, optimizer, state born sharded ------------------------------------------------------------------------
  tx, schedule = make_optimizer(ocfg)
  graphdef, state, state_sh = init_state(cfg, tx, mesh, int(config.train.seed))
  n_params = sum(x.size for x in jax.tree.leaves(state.params))
  log(f"model: {n_params / 1e6:.2f}M parameters, layers {cfg.layer_types} / {cfg.mlp_layer_types}")
  if latest is not None:
    abstract = ckpt_lib.abstract_like(state, state_sh)
    del state
    state = ckpt.restore(latest, abstract, data_iter)
    log(f"resumed from step {latest} in {workdir}")
  elif config.get("init_from"):
    state = init_from_export(state, config.init_from, mesh)
  start = int(jax.device_get(state.step))

  # ---- steps, compiled ahead of time -------------------------------------------------------------------------------
  train_step = jax.jit(make_train_step(graphdef, tx, schedule, moe_aux_coef=float(config.train.moe_aux_coef),
                                       kl_weight=cfg.kl_weight),
                       in_shardings=(state_sh, sharding.batch_sharding(mesh)),
                       out_shardings=(state_sh, None), donate_argnums=(0,))
  eval_step = jax.jit(make_eval_step(graphdef),
                      in_shardings=(state_sh.params, state_sh.rest, sharding.batch_sharding(mesh)))
  batch = to_global(next(data_iter), mesh) if start < steps else None
  with jax.set_mesh(mesh):
    compiled = _compile(train_step, state, batch) if batch is not None else None

  # ---- loop -------------------------------------------------------------------------------------------------------
  writer = MetricWriter(workdir, process_index=jax.process_index())
  flops_tok = train_flops_per_token(cfg, int(config.train.seq_len))
  peak = peak_flops(jax.devices()[0])
  log_every, eval_every = int(config.train.log_every), int(config.train.eval_every)
  progress = Progress(steps, start, quiet=jax.process_index() != 0)
  stopper = _Stop()
  final_eval: dict = {}
  first_eval: dict = {}
  t_last, tok_last, last_saved = time.time(), 0.0, latest
  step = start

  def save(step: int, force: bool = False):
    nonlocal last_saved
    if ckpt.save(step, state, data_iter, run_config, force=force):
      last_saved = step

  try:
    with jax.set_mesh(mesh):
      if start == 0 and eval_every > 0:  # the starting point, so a run shows how far held-out loss fell
        ev = evaluate_sets(eval_step, state.params, state.rest, evals, mesh)
        writer.write(0, ev)
        first_eval = ev
        progress.message("step 0: " + ", ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in ev.items()
                                                if k.endswith("/loss") and k.count("/") == 2))
        t_last = time.time()
      while step < steps:
        state, metrics = compiled(state, batch)
        step += 1
        tok_last += float(config.train.batch_size) * float(config.train.seq_len)
        is_log = step % log_every == 0 or step == steps or step == start + 1
        saving = ckpt.every > 0 and step % ckpt.every == 0
        if is_log or saving:
          m = jax.device_get(metrics)
          if not np.isfinite(m["loss"]) or not np.isfinite(m["grad_norm"]):
            raise FloatingPointError(
                f"non-finite loss/grad at step {step} (loss={m['loss']}, grad_norm={m['grad_norm']}); stopping "
                f"without saving this state: the last good checkpoint is step {last_saved} in {ckpt.directory}")
          if is_log:
            dt = time.time() - t_last
            tps = tok_last / max(dt, 1e-9)
            m = {k: v for k, v in m.items() if k != "tokens"}
            m["tokens_per_sec"] = tps
            m["mfu"] = (tps * flops_tok / (peak * jax.device_count())) if peak else None
            writer.write(step, m)
            progress.update(step, f"loss {float(m['loss']):.4f} lr {float(m['lr']):.2e} "
                            f"gnorm {float(m['grad_norm']):.3f} {tps:,.0f} tok/s")
            t_last, tok_last = time.time(), 0.0
        if saving:
          save(step)
        if eval_every > 0 and (step % eval_every == 0 or step == steps):
          ev = evaluate_sets(eval_step, state.params, state.rest, evals, mesh)
          writer.write(step, ev)
          progress.message(f"step {step}: " + ", ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in ev.items()
                                                           if k.endswith("/loss") and k.count("/") == 2))
          final_eval = ev
          t_last = time.time()
        if stopper.requested:
          progress.message(f"SIGTERM: saving step {step} and stopping")
          save(step, force=True)
          break
        if step < steps:
          batch = to_global(next(data_iter), mesh)
      else:
        if last_saved != step:
          save(step, force=True)
  except KeyboardInterrupt:
    progress.message(f"interrupted: saving step {step}")
    save(step, force=True)
    raise
  finally:
    progress.close()
    ckpt.close()
    writer.close()
  if not final_eval and steps <= start:
    final_eval = evaluate_sets(eval_step, state.params, state.rest, evals, mesh)
  if first_eval and final_eval:
    log(f"held-out mean loss over {len(evals)} sources: {first_eval['eval/mean_loss']:.3f} (step 0) -> "
        f"{final_eval['eval/mean_loss']:.3f} (step {step})")
  log(f"done: {workdir} holds checkpoints/ (step {last_saved}), metrics.jsonl and tb/")
  return final_eval


def make_checkpointer(config, workdir) -> ckpt_lib.Checkpointer:
  c = config.checkpoint
  return ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), every=int(c.every), keep=int(c.keep),
                               async_save=bool(c.get("async_save", True)))


# ============================================================================================ eval and export ==

def load_params(config: ml_collections.ConfigDict, workdir: str, mesh, checkpoint: str | None = None):
  """Params from an export directory (params-only) or the latest train checkpoint of `workdir`."""
  path = checkpoint or config.get("eval_checkpoint", "") or ""
  if path and ckpt_lib.is_export(path):
    cfg = TextConfig.from_dict(ckpt_lib.load_export_config(path))
    graphdef, (params, rest), (p_sh, r_sh) = param_shardings(cfg, mesh)
    both = ckpt_lib.restore_params(path, ckpt_lib.abstract_like({"params": params, "rest": rest},
                                                                {"params": p_sh, "rest": r_sh}))
    return cfg, graphdef, both["params"], both["rest"], f"export {path}"
  cfg = config_lib.model_config(config)
  ocfg = config_lib.optim_config(config)
  tx, _ = make_optimizer(ocfg)
  ckpt = make_checkpointer(config, path or workdir)
  step = ckpt.latest_step()
  if step is None:
    raise FileNotFoundError(f"no checkpoint in {ckpt.directory} and no export directory given")
  check_compatible(ckpt.saved_config(step), config_lib.to_jsonable(config), workdir)
  graphdef, (params, rest), (p_sh, r_sh) = param_shardings(cfg, mesh)

  init = make_init_fn(cfg, tx)
  abstract = jax.eval_shape(init, jax.random.key(0))
  state_sh = state_shardings_for(abstract, p_sh, r_sh, mesh)
  state = ckpt.restore(step, ckpt_lib.abstract_like(abstract, state_sh))
  ckpt.close()
  return cfg, graphdef, state.params, state.rest, f"checkpoint step {step} of {ckpt.directory}"


def evaluate(config: ml_collections.ConfigDict, workdir: str, checkpoint: str | None = None) -> dict:
  mesh = sharding.make_mesh(dict(config.mesh))
  cfg, graphdef, params, rest, what = load_params(config, workdir, mesh, checkpoint)
  prepare_data(config)
  evals = eval_sets(config)
  p_sh = jax.tree.map(lambda x: x.sharding, params)
  r_sh = jax.tree.map(lambda x: x.sharding, rest)
  eval_step = jax.jit(make_eval_step(graphdef), in_shardings=(p_sh, r_sh, sharding.batch_sharding(mesh)))
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
  mesh = sharding.make_mesh(dict(config.mesh))
  cfg, _, params, rest, what = load_params(config, workdir, mesh)
  out = config.export.get("path") or os.path.join(workdir, "export")
  dtype = config.export.get("dtype") or None
  ckpt_lib.export_params(out, {"params": params, "rest": rest}, cfg.to_dict(), dtype=dtype)
  log(f"exported params of {what} ({dtype or 'original dtype'}) to {out}")
  return out
