"""The arm settings, their configs and the arms x seeds runs: each (setting, seed) trains in SWEEP_DIR/{setting}_s{seed}
(resuming), then is analysed into its analysis.json; results.json is rewritten after every finished run."""

from __future__ import annotations

import argparse
import os
import re

from configs import native_vs_cpt
from experiments.lib import sweep as lib_sweep
from experiments.lib import training
from experiments.lib.config import config_arg, load_config
from experiments.native_vs_cpt import analysis, report

TAG = "native_vs_cpt"
DEFAULT_ARMS = ("text_only", "native", "cpt_decay", "cpt_predecay_lr1.0", "cpt_predecay_lr0.3")
DEFAULT_SEEDS = {"micro": "0", "cpu": "0", "gpu": "0,1,2"}


def parse_setting(name: str) -> tuple[str, float]:
  """"cpt_predecay_lr0.3" -> ("cpt_predecay", 0.3); "native" -> ("native", 1.0)."""
  m = re.fullmatch(r"(cpt_predecay|text_only)_lr([0-9.]+)", name)
  arm, scale = (m.group(1), float(m.group(2))) if m else (name, 1.0)
  if arm not in native_vs_cpt.ARMS:
    raise SystemExit(f"--arms: {name!r} is not an arm setting; expected text_only, native, cpt_decay, "
                     "cpt_predecay_lr{S} or text_only_lr{S}")
  if arm == "cpt_predecay" and not m:
    raise SystemExit(f"--arms: {name!r} needs its LR scale, e.g. cpt_predecay_lr1.0")
  return arm, scale


def make_config(size: str, setting: str, seed: int, steps: int, data_dir: str, overrides: list[str],
                extra_arg: str = ""):
  """configs/native_vs_cpt.py for one arm setting and seed, with the driver's flags applied."""
  arm, scale = parse_setting(setting)
  arg = config_arg(f"arm={arm},lr_scale={scale},size={size},seed={seed}", f"steps={steps}" if steps else "",
                   extra_arg)
  return load_config("native_vs_cpt", arg, data_dir=data_dir, overrides=overrides)


def flags_config(a: argparse.Namespace, setting: str, seed: int):
  """make_config with the command line's size, steps, data, overrides and config arguments."""
  return make_config(a.size, setting, seed, a.steps, a.data_dir, a.override, a.config_arg)


def setting_summary(config) -> dict:
  """Where a run's vision and LR rescale start: the steps of its schedule and data mix."""
  o = training.schedule_points(config)
  d = config.data.mm
  return {"steps": int(config.train.steps), "warmup": o["warmup"], "decay_start": o["decay_start"],
          "vision_rows": int(d.vision_rows), "vision_start_step": int(d.vision_start_step) if d.vision_rows else None,
          "lr_scale": o["lr_scale"], "lr_scale_from": o["lr_scale_from"] if o["lr_scale"] != 1.0 else None}


def run_setting(a: argparse.Namespace, setting: str, seed: int, work: str, sweep_dir: str) -> dict:
  """Trains one (setting, seed) in `work` (resuming) and returns its analysis record; stops the sweep when the trainer
  returned before the last step (a SIGTERM: it saves and stops)."""
  cfg = flags_config(a, setting, seed)
  training.train(cfg, work)
  trained = training.trained_steps(cfg, work)
  lib_sweep.stop_if_cut_short(trained, int(cfg.train.steps), tag=TAG, what=f"{setting} seed {seed}", work=work)
  record = {"arm": setting, "seed": seed, "wall_s": 0.0, "setting": setting_summary(cfg)}
  record.update(analysis.analyse_run(cfg, work, os.path.join(sweep_dir, "attention_examples.json")))
  record["steps_trained"] = trained
  return record


def load_runs(sweep_dir: str, arms: list[str], seeds: list[int], steps: int = 0) -> dict[str, dict[int, dict]]:
  """Finished runs' analyses; with `steps`, a run that recorded fewer trained steps is left out (and said so)."""
  return lib_sweep.load_finished(sweep_dir, arms, seeds, tag=TAG, steps=steps)


def run_all(a: argparse.Namespace, arms: list[str], seeds: list[int], sweep_dir: str, meta: dict) -> None:
  """Every (setting, seed) not finished before, seed-major; results.json rewritten after each."""
  def run_one(setting: str, seed: int, work: str) -> dict:
    return run_setting(a, setting, seed, work, sweep_dir)

  def rewrite_results() -> None:
    report.write_results(sweep_dir, load_runs(sweep_dir, arms, seeds, meta["steps"]), meta)

  todo = [(s, seed) for seed in seeds for s in arms]
  lib_sweep.run_sweep(todo, sweep_dir, run_one, tag=TAG, after_each=rewrite_results)


def build_meta(a: argparse.Namespace, arms: list[str], seeds: list[int], sweep_dir: str) -> dict:
  """What results.json and report.md say about how the sweep was made."""
  config = flags_config(a, arms[0], seeds[0])
  return {"size": a.size, "arms": arms, "seeds": seeds, "steps": int(config.train.steps),
          "batch_size": int(config.train.batch_size), "seq_len": int(config.train.seq_len),
          "vision_rows": max(int(flags_config(a, s, seeds[0]).data.mm.vision_rows) for s in arms),
          "device": lib_sweep.device_description(sweep_dir, a.report_only), "note": a.note,
          "config_arg": a.config_arg, "overrides": a.override,
          "workdirs": [f"{s}_s{seed}" for seed in seeds for s in arms]}
