"""`python -m experiments.long_context`: the arms x seeds of issue 19's MSA study, then results.json, report.md and
the plots (the package docstring has the commands)."""

from __future__ import annotations

import argparse
import os
import time

import experiments.long_context as package
from experiments.lib import training
from experiments.lib.config import add_cache_flag, add_config_flags, enable_compilation_cache
from experiments.long_context import report, sweep


def parse_args(argv=None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(prog="python -m experiments.long_context", description=package.__doc__.split("\n")[0])
  ap.add_argument("--size", default="cpu", help="gpu (configs/small_msa.py) | cpu (2 layers, width 64, 256 tokens)")
  ap.add_argument("--cpu_model", default="", help="--size=cpu: KEY=VALUE,... of its model (sweep.CPU_MODEL), e.g. "
                  "hidden_size=128,num_hidden_layers=4,head_dim=32,rotary_dim=32,dense_intermediate_size=512")
  ap.add_argument("--arms", default=",".join(sweep.ARMS), help=f"any of {', '.join(sweep.ARMS)}")
  ap.add_argument("--seeds", default="", help="comma-separated seeds for every arm (default: 0,1,2 for "
                  f"{', '.join(sweep.MAIN_ARMS)}; 0 for the others)")
  ap.add_argument("--task_share", type=float, default=0.0, help="share of training rows that are task rows")
  ap.add_argument("--tasks", default="passkey,single_key,kv", help="task rows' tasks (with --task_share > 0)")
  ap.add_argument("--task_questions", type=int, default=1, help="questions per task row (data.tasks.questions)")
  ap.add_argument("--task_text_loss", action="store_true", help="task rows train on their haystack text too")
  ap.add_argument("--task_placement", default="end", help="end | interleaved: where a task row's questions go")
  ap.add_argument("--task_lengths", default="", help="example lengths packed into task rows, e.g. 512,2048,16384 "
                  "(each its own segment: pair with --config_arg=document_mask=True)")
  ap.add_argument("--eval_tasks", default="passkey,single_key,kv", help="retrieval tasks evaluated")
  ap.add_argument("--lengths", default="", help="evaluation lengths (default: training length, 2x, 4x)")
  ap.add_argument("--depths", default="0,0.25,0.5,0.75,1")
  ap.add_argument("--samples", type=int, default=4, help="examples per (task, length, depth)")
  ap.add_argument("--eval_batch", type=int, default=8)
  ap.add_argument("--prefill_chunk", type=int, default=4096)
  ap.add_argument("--loss_length", type=int, default=0, help="loss by position: tokens (0: longest length, -1: off)")
  ap.add_argument("--convert_at", type=float, default=0.5, help="dense_to_msa: share of the steps trained dense")
  ap.add_argument("--convert_warmup", type=float, default=0.25,
                  help="dense_to_msa: indexer warmup as a share of the MSA phase's steps")
  add_config_flags(ap, "long_context", config_arg_example="loss_chunk=4096")
  ap.add_argument("--report_only", action="store_true", help="only read finished runs and write the report")
  ap.add_argument("--shard", default="0/1", help="I/N: run only every N-th (arm, seed) from the I-th, so N processes "
                  "share one GPU (each with XLA_PYTHON_CLIENT_MEM_FRACTION < 1/N); then --report_only once")
  ap.add_argument("--granularity_json", default="", help="experiments.bench_msa --granularity JSON: its kernel times "
                  "per selection granularity go into the report (claim b)")
  ap.add_argument("--note", default="", help="a sentence for the report on how the runs were made")
  add_cache_flag(ap, shared="the MSA arms of one granularity share their programs")
  return ap.parse_args(argv)


def parse_shard(spec: str) -> tuple[int, int]:
  try:
    i, n = (int(x) for x in spec.split("/"))
  except ValueError:
    raise SystemExit(f"--shard={spec!r}: expected I/N with integers, e.g. 0/4") from None
  if not 0 <= i < n:
    raise SystemExit(f"--shard={spec!r}: expected 0 <= I < N")
  return i, n


def write_outputs(a: argparse.Namespace, arms: list[str], sweep_dir: str, meta: dict) -> dict:
  runs = sweep.load_runs(sweep_dir, arms, a.seeds, meta["steps"])
  missing = [f"{arm}_s{s}" for arm, s in sweep.todo(arms, a.seeds) if s not in runs.get(arm, {})]
  if missing:
    print(f"[long_context] not finished (left out of the report): {', '.join(missing)}", flush=True)
  if not runs:
    raise SystemExit(f"no finished run in {sweep_dir} for arms {arms}")
  js = report.write_results(sweep_dir, runs, meta)
  md, pngs = report.write_report(sweep_dir, runs, meta, missing)
  print(open(md).read())
  print(f"[long_context] wrote {js}, {md}, " + ", ".join(pngs), flush=True)
  return runs


def main(argv=None):
  a = parse_args(argv)
  arms = [s.strip() for s in a.arms.split(",") if s.strip()]
  shard = parse_shard(a.shard)
  for arm in arms:  # names checked first
    sweep.make_config(a.size, arm, 0, steps=a.steps, data_dir=a.data_dir, overrides=[], model=a.cpu_model)
  sweep_dir = os.path.abspath(a.sweep_dir)
  os.makedirs(sweep_dir, exist_ok=True)
  enable_compilation_cache(a.compilation_cache, sweep_dir)
  meta = sweep.build_meta(a, arms, sweep_dir)
  t0 = time.time()
  if not a.report_only:
    training.prepare_data(sweep.arm_config(a, arms[0], 0))
    sweep.run_all(a, arms, sweep_dir, meta, shard=shard)
  meta["wall_s_this_command"] = time.time() - t0
  if shard[1] > 1 and not a.report_only:
    print(f"[long_context] shard {shard[0]}/{shard[1]} done; once every shard has finished, the same command with "
          "--report_only writes the report", flush=True)
    return sweep.load_runs(sweep_dir, arms, a.seeds, meta["steps"])
  return write_outputs(a, arms, sweep_dir, meta)


if __name__ == "__main__":
  main()
