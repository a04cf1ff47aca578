"""The arms, their configs (configs/small_msa.py, and a tiny CPU size defined here) and the arms x seeds runs."""

from __future__ import annotations

import argparse
import json
import os

from configs.small_msa import LAYERS
from experiments.lib import sweep as lib_sweep
from experiments.lib import training
from experiments.lib.config import apply_overrides, config_arg, load_config
from experiments.long_context import analysis, report

TAG = "long_context"
ARMS = ("dense", "msa_per_group", "msa_shared", "msa_block16", "msa_block64", "msa_no_detach", "dense_to_msa")
# The claims rest on these three: they get 3 seeds by default, the single-variable ablations 1.
MAIN_ARMS = ("dense", "msa_per_group", "msa_shared")
# configs/small_msa.py arguments of each arm, per size. The CPU size keeps the GPU's granularity ratios around its
# own 16 x 4 budget (GPU: 128 x 16 -> 16 x 128 and 64 x 32).
ARM_ARGS = {
    "gpu": {"dense": "attention=dense", "msa_per_group": "", "msa_shared": "selection=shared",
            "msa_block16": "block_size=16,topk=128", "msa_block64": "block_size=64,topk=32",
            "msa_no_detach": "detach=False", "dense_to_msa": ""},
    "cpu": {"dense": "attention=dense", "msa_per_group": "", "msa_shared": "selection=shared",
            "msa_block16": "block_size=2,topk=32", "msa_block64": "block_size=8,topk=8",
            "msa_no_detach": "detach=False", "dense_to_msa": ""},
}
SIZE_ARGS = {
    "gpu": "",
    # XLA attention and selection (no cuDNN or Pallas on a CPU), no remat, the diagnostics on every logged step
    "cpu": "heads=4/2,seq_len=256,steps=20,block_size=16,topk=4,msa_impl=xla,attention_impl=xla,remat=False,"
           "metrics_every=2",
}
# 2 layers of width 64: a run of a few steps trains, exports and evaluates in seconds on 2 cores.
CPU_MODEL = {"hidden_size": 64, "num_hidden_layers": 2, "head_dim": 16, "rotary_dim": 8, "dense_intermediate_size": 128,
             "index_head_dim": 16, "dtype": "float32"}


def cpu_model(spec: str) -> dict:
  """CPU_MODEL with --cpu_model's "KEY=VALUE,..." fields (keys of CPU_MODEL, values of their types), e.g.
  "hidden_size=128,num_hidden_layers=4": --override cannot change the depth, since layer_types is cut to it first."""
  out = dict(CPU_MODEL)
  for item in (x.strip() for x in spec.split(",") if x.strip()):
    key, eq, value = item.partition("=")
    if not eq or key not in CPU_MODEL:
      raise SystemExit(f"--cpu_model: {item!r} is not KEY=VALUE with KEY one of {', '.join(CPU_MODEL)}")
    out[key] = type(CPU_MODEL[key])(value)
  if not 1 <= out["num_hidden_layers"] <= LAYERS:
    raise SystemExit(f"--cpu_model: num_hidden_layers={out['num_hidden_layers']}; expected 1 to {LAYERS} "
                     "(configs/small_msa.py's layers)")
  return out


def seeds_of(arm: str, spec: str) -> list[int]:
  """--seeds (the same for every arm), or 0,1,2 for the main arms and 0 for the others."""
  if spec:
    return [int(s) for s in spec.split(",") if s.strip()]
  return [0, 1, 2] if arm in MAIN_ARMS else [0]


def make_config(size: str, arm: str, seed: int, *, steps: int, data_dir: str, overrides: list[str],
                extra_arg: str = "", attention: str | None = None, model: str = ""):
  """configs/small_msa.py for one arm and seed (attention= forces dense or msa: the phases of dense_to_msa; model:
  --cpu_model's fields, CPU size only)."""
  if size not in SIZE_ARGS:
    raise SystemExit(f"--size={size!r}: expected gpu or cpu")
  if arm not in ARMS:
    raise SystemExit(f"--arms: {arm!r} is not an arm; expected one of {', '.join(ARMS)}")
  if model and size != "cpu":
    raise SystemExit(f"--cpu_model={model!r} is for --size=cpu (the gpu size is configs/small_msa.py's model)")
  arm_arg = ARM_ARGS[size][arm]
  if attention is not None:
    arm_arg = config_arg(arm_arg, f"attention={attention}")
  arg = config_arg(SIZE_ARGS[size], arm_arg, f"steps={steps}" if steps else "", extra_arg)
  c = load_config("small_msa", arg, data_dir=data_dir, overrides=[])
  c.train.seed = seed
  if size == "cpu":
    m = c.model
    for k, v in cpu_model(model).items():
      m[k] = v
    m.layer_types = tuple(m.layer_types[:m.num_hidden_layers])  # layer 0 dense, the rest as the arm says
    m.mlp_layer_types = ("dense",) * m.num_hidden_layers
    c.train.batch_size = 4
    c.train.log_every = 2
    c.optim.learning_rate = 3e-3
    c.optim.warmup_steps = 2
    c.checkpoint.async_save = False
    c.eval.batch_size = 4
    c.eval.max_batches = 1
  return apply_overrides(c, overrides)


def arm_config(a: argparse.Namespace, arm: str, seed: int, **kw):
  """make_config with the command line's size, steps, data, task mix, overrides and config arguments."""
  c = make_config(a.size, arm, seed, steps=a.steps, data_dir=a.data_dir, overrides=[], extra_arg=a.config_arg,
                  model=a.cpu_model, **kw)
  if a.task_share > 0:
    c.data.tasks.share = a.task_share
    c.data.tasks.names = a.tasks
    c.data.tasks.questions = a.task_questions
    c.data.tasks.text_loss = a.task_text_loss
    c.data.tasks.placement = a.task_placement
    c.data.tasks.lengths = a.task_lengths
  return apply_overrides(c, a.override)


def lengths_of(a: argparse.Namespace, seq_len: int) -> list[int]:
  """--lengths, or the training length, 2x and 4x."""
  if a.lengths:
    return [int(x) for x in a.lengths.split(",") if x.strip()]
  return [seq_len, 2 * seq_len, 4 * seq_len]


def _train(cfg, work: str, what: str) -> int:
  if int(cfg.train.eval_every) <= 0:
    # configs/small_msa.py evaluates never; the held-out loss per source needs one evaluation at the last step
    cfg.train.eval_every = int(cfg.train.steps)
  training.train(cfg, work)
  trained = training.trained_steps(cfg, work)
  lib_sweep.stop_if_cut_short(trained, int(cfg.train.steps), tag=TAG, what=what, work=work)
  return trained


def run_arm(a: argparse.Namespace, arm: str, seed: int, work: str) -> dict:
  """Trains one (arm, seed) in `work` (resuming), exports it, evaluates it; returns its analysis record."""
  cfg = arm_config(a, arm, seed)
  phases, offset = [], 0
  if arm == "dense_to_msa":
    total = int(cfg.train.steps)
    first = max(1, min(total - 1, round(total * a.convert_at)))
    dense = arm_config(a, arm, seed, attention="dense")
    dense.train.steps = first
    dense_work = os.path.join(work, "dense_phase")
    _train(dense, dense_work, f"{arm} seed {seed} (dense phase)")
    export = os.path.join(dense_work, "export")
    if not os.path.isdir(export):
      training.export(dense, dense_work)
    cfg.init_from = export
    cfg.train.steps = total - first
    cfg.model.warmup_steps = max(1, round((total - first) * a.convert_warmup))
    # The MSA phase is a fresh trainer run whose data stream starts at step 0 again: another data seed gives it
    # rows the dense phase has not seen (its init is the export, so the seed changes nothing else that matters).
    cfg.train.seed = seed + 1000
    phases.append({"workdir": dense_work, "steps": first, "attention": "dense"})
    offset = first
  try:
    trained = _train(cfg, work, f"{arm} seed {seed}")
  except training.Diverged as e:
    # Divergence is an outcome of this study (claim d), not a failure of the sweep: recorded, not evaluated.
    phases.append({"workdir": work, "steps": int(cfg.train.steps), "attention": "msa"})
    return {"arm": arm, "seed": seed, "phases": phases, "steps_trained": offset + int(cfg.train.steps),
            "diverged_message": str(e).splitlines()[0], **analysis.diverged_run(phases)}
  phases.append({"workdir": work, "steps": trained, "attention": "msa" if arm != "dense" else "dense",
                 "indexer_warmup": int(cfg.model.warmup_steps)})
  export = os.path.join(work, "export")
  if not os.path.isdir(export):
    training.export(cfg, work)
  record = {"arm": arm, "seed": seed, "phases": phases, "steps_trained": offset + trained}
  record.update(analysis.analyse_run(phases, export, data_dir=cfg.data.dir, tasks=a.eval_tasks,
                                     lengths=lengths_of(a, int(cfg.train.seq_len)), depths=a.depths,
                                     samples=a.samples, batch_size=a.eval_batch, prefill_chunk=a.prefill_chunk,
                                     loss_length=a.loss_length, out=os.path.join(work, "long_eval")))
  return record


def todo(arms: list[str], seeds: str) -> list[tuple[str, int]]:
  """(arm, seed) pairs, seed-major: a sweep cut short has every arm of the first seeds."""
  pairs = [(arm, s) for arm in arms for s in seeds_of(arm, seeds)]
  return sorted(pairs, key=lambda p: (p[1], arms.index(p[0])))


def load_runs(sweep_dir: str, arms: list[str], seeds: str, steps: int) -> dict[str, dict[int, dict]]:
  all_seeds = sorted({s for arm in arms for s in seeds_of(arm, seeds)})
  return lib_sweep.load_finished(sweep_dir, arms, all_seeds, tag=TAG, steps=steps)


def run_all(a: argparse.Namespace, arms: list[str], sweep_dir: str, meta: dict,
            shard: tuple[int, int] = (0, 1)) -> None:
  """Runs the (arm, seed) pairs of this shard: every shard[1]-th pair of `todo` from the shard[0]-th."""
  def rewrite_results() -> None:
    report.write_results(sweep_dir, load_runs(sweep_dir, arms, a.seeds, meta["steps"]), meta)

  lib_sweep.run_sweep(todo(arms, a.seeds)[shard[0]::shard[1]], sweep_dir,
                      lambda arm, seed, work: run_arm(a, arm, seed, work), tag=TAG,
                      after_each=rewrite_results)


def build_meta(a: argparse.Namespace, arms: list[str], sweep_dir: str) -> dict:
  c = arm_config(a, arms[0], 0)
  return {"size": a.size, "arms": arms, "seeds": {arm: seeds_of(arm, a.seeds) for arm in arms},
          "steps": int(c.train.steps), "batch_size": int(c.train.batch_size), "seq_len": int(c.train.seq_len),
          "task_share": a.task_share, "train_tasks": a.tasks if a.task_share > 0 else "",
          "task_questions": a.task_questions, "task_text_loss": a.task_text_loss,
          "task_placement": a.task_placement, "task_lengths": a.task_lengths,
          "eval_tasks": a.eval_tasks, "lengths": lengths_of(a, int(c.train.seq_len)), "depths": a.depths,
          "samples": a.samples, "convert_at": a.convert_at, "convert_warmup": a.convert_warmup,
          "device": lib_sweep.device_description(sweep_dir, a.report_only), "note": a.note,
          "config_arg": a.config_arg, "cpu_model": a.cpu_model, "overrides": a.override,
          **_granularity(a.granularity_json)}


def _granularity(path: str) -> dict:
  """The kernel-time rows of an experiments.bench_msa --granularity JSON, and its device ({} without a path)."""
  if not path:
    return {}
  with open(path) as f:
    js = json.load(f)
  if not js.get("granularity"):
    raise SystemExit(f"--granularity_json={path}: no 'granularity' rows (run experiments.bench_msa --granularity=...)")
  return {"granularity": js["granularity"], "granularity_device": f"{js.get('device', '?')}, jax {js.get('jax', '?')}"}
