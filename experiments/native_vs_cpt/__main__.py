"""`python -m experiments.native_vs_cpt`: arms x seeds of configs/native_vs_cpt.py, then results.json, report.md and
the plots (the package docstring has the commands)."""

from __future__ import annotations

import argparse
import os
import time

import experiments.native_vs_cpt as package
from experiments.lib import training
from experiments.lib.config import add_cache_flag, add_config_flags, enable_compilation_cache
from experiments.native_vs_cpt import report, sweep


def parse_args(argv=None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(prog="python -m experiments.native_vs_cpt", description=package.__doc__.split("\n")[0])
  ap.add_argument("--size", default="cpu", help="micro | cpu | gpu (configs/native_vs_cpt.py SIZES)")
  ap.add_argument("--arms", default=",".join(sweep.DEFAULT_ARMS),
                  help="arm settings: text_only, native, cpt_decay, cpt_predecay_lr{S}, text_only_lr{S}")
  ap.add_argument("--seeds", default="", help="comma-separated seeds (default: 0 on cpu/micro, 0,1,2 on gpu)")
  add_config_flags(ap, "native_vs_cpt", config_arg_example="attn=cudnn")
  ap.add_argument("--report_only", action="store_true", help="only read finished runs and write the report")
  ap.add_argument("--prepare_only", action="store_true", help="only prepare DATA_DIR (text corpus + vision data)")
  ap.add_argument("--note", default="", help="a sentence for the report on how the runs were made")
  add_cache_flag(ap, shared="the arms share their init, eval and (same shapes) train programs")
  return ap.parse_args(argv)


def write_outputs(sweep_dir: str, arms: list[str], seeds: list[int], meta: dict) -> dict:
  """results.json, report.md and the plots from the finished runs (those not finished are named and left out)."""
  runs = sweep.load_runs(sweep_dir, arms, seeds, meta["steps"])
  missing = [f"{s}_s{seed}" for seed in seeds for s in arms if seed not in runs.get(s, {})]
  if missing:
    print(f"[native_vs_cpt] not finished (left out of the report): {', '.join(missing)}", flush=True)
  if not runs:
    raise SystemExit(f"no finished run in {sweep_dir} for arms {arms} and seeds {seeds}")
  js = report.write_results(sweep_dir, runs, meta)
  md, pngs = report.write_report(sweep_dir, runs, meta)
  print(open(md).read())
  print(f"[native_vs_cpt] wrote {js}, {md}, " + ", ".join(pngs))
  return runs


def main(argv=None):
  a = parse_args(argv)
  arms = [s.strip() for s in a.arms.split(",") if s.strip()]
  for s in arms:
    sweep.parse_setting(s)
  seeds = [int(s) for s in (a.seeds or sweep.DEFAULT_SEEDS.get(a.size, "0")).split(",") if s.strip()]
  sweep_dir = os.path.abspath(a.sweep_dir)
  if a.prepare_only:
    training.prepare_data(sweep.flags_config(a, arms[0], seeds[0]))
    return None
  enable_compilation_cache(a.compilation_cache, sweep_dir)
  os.makedirs(sweep_dir, exist_ok=True)
  meta = sweep.build_meta(a, arms, seeds, sweep_dir)
  t_sweep = time.time()
  if not a.report_only:
    sweep.run_all(a, arms, seeds, sweep_dir, meta)
  meta["wall_s_this_command"] = time.time() - t_sweep
  return write_outputs(sweep_dir, arms, seeds, meta)


if __name__ == "__main__":
  main()
