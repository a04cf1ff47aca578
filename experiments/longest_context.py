r"""The longest context one device trains (issue 18, acceptance 2), per attention x head layout of
configs/small_msa.py (batch 1): compile one train step ahead of time (abstract state: nothing is allocated) at two
lengths, fit its bytes (arguments + temporaries + outputs not aliased to the donated state) as a line in the
sequence length, predict the longest length (a multiple of --granule) under the device's memory limit, compile
there to check (stepping down until it fits), and with --run train a few steps at it through `m3_jax.main` to
confirm, recording the peak memory and tokens/s. The per-token slope is the growing memory; --loss_chunk=N fits a
second line with `train.loss_chunk=N` beside each, and the difference of the two slopes is the logits' share of it.

  python3 -m experiments.longest_context --heads=8/2 --heads=16/1 --attention=dense,msa --fit=131072,262144 \
      --loss_chunk=4096 --run --data_dir=.gpudata --out=$OUT/longest_context_h200.json

The memory limit is the device's (`bytes_limit`: XLA_PYTHON_CLIENT_MEM_FRACTION of it, --mem_fraction sets that
for this process and the runs) unless --limit_gib names one (a CPU, or a prediction for another device of the same
architecture). Prints a table and writes JSON after every variant. --run_from trains the variants of earlier fits
(their JSON files), so that the compiles and the runs can go in separate calls:

  python3 -m experiments.longest_context --attention=msa --heads=8/2 --common_arg=loss_chunk=4096 --out=lc_msa_8.json
  python3 -m experiments.longest_context --run_from=lc_msa_8.json,lc_dense_8.json --run_steps=1 --data_dir=.gpudata

Run the fits one process at a time: XLA's GEMM autotuner allocates real device buffers while compiling (GiBs at
these lengths), and four compiles side by side ran out of memory on an H100.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--heads", action="append", help="Q/KV heads, e.g. 8/2 (default 8/2 and 16/1)")
ap.add_argument("--attention", default="dense,msa")
ap.add_argument("--fit", default="131072,262144", help="two sequence lengths the line is fitted to")
ap.add_argument("--granule", type=int, default=16384, help="the predicted length is a multiple of this")
ap.add_argument("--max_seq", type=int, default=1 << 22, help="no prediction beyond this (a flat fit on a CPU)")
ap.add_argument("--loss_chunk", type=int, default=0, help="also fit with train.loss_chunk=N (0: no)")
ap.add_argument("--common_arg", default="", help="configs/small_msa.py argument items for every variant")
ap.add_argument("--mem_fraction", type=float, default=0.9, help="XLA_PYTHON_CLIENT_MEM_FRACTION (GPU)")
ap.add_argument("--limit_gib", type=float, default=0.0, help="memory limit to predict for (default: the device's)")
ap.add_argument("--run", action="store_true", help="train --run_steps steps at each predicted length")
ap.add_argument("--run_from", default="", help="comma-separated JSON files of earlier fits: only train at their "
                "longest lengths (each variant's loss-chunked one where fitted) and write them together to --out")
ap.add_argument("--run_steps", type=int, default=3)
ap.add_argument("--run_timeout", type=int, default=900)
ap.add_argument("--data_dir", default="data")
ap.add_argument("--out", default="longest_context.json")

GIB = 2**30


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
  """(slope bytes/token, intercept bytes) through two (seq_len, bytes) points."""
  (t1, b1), (t2, b2) = sorted(points)
  if t1 == t2:
    raise ValueError(f"--fit needs two different lengths, got {t1} twice")
  slope = (b2 - b1) / (t2 - t1)
  return slope, b1 - slope * t1


def predict(slope: float, intercept: float, limit: float, granule: int) -> int:
  """The longest multiple of `granule` whose fitted bytes are within `limit` (0 when none is)."""
  if slope <= 0:
    raise ValueError(f"memory does not grow with the length (slope {slope:.1f} B/token): fit longer lengths")
  return max(0, int((limit - intercept) / slope) // granule * granule)


def compiled_bytes(arg: str, seq: int) -> dict:
  """One train step of configs/small_msa.py:ARG at `seq` tokens, compiled for this process's device."""
  from configs.small_msa import get_config  # noqa: PLC0415
  from m3_jax.train import aot  # noqa: PLC0415

  config = get_config(",".join(x for x in (arg, f"seq_len={seq}") if x))
  with tempfile.TemporaryDirectory() as work:
    r = aot.compile_report(config, work)
  total = (r["compiled_argument_bytes_per_device"] + r["compiled_temp_bytes_per_device"]
           + r["compiled_output_bytes_per_device"] - (r["compiled_alias_bytes_per_device"] or 0))
  return {"seq_len": seq, "bytes": total, "temp_bytes": r["compiled_temp_bytes_per_device"],
          "argument_bytes": r["compiled_argument_bytes_per_device"], "compile_s": r["compile_seconds"]}


def train_at(arg: str, seq: int, args) -> dict:
  """--run_steps steps of configs/small_msa.py:ARG at `seq` through m3_jax.main: return code, tokens/s, peak."""
  from experiments.lib import metrics  # noqa: PLC0415
  from experiments.lib.config import REPO  # noqa: PLC0415

  work = tempfile.mkdtemp(prefix="longest_")
  cmd = [sys.executable, "-m", "m3_jax.main",
         f"--config=configs/small_msa.py:{','.join(x for x in (arg, f'seq_len={seq}', f'steps={args.run_steps}') if x)}",
         f"--workdir={work}", f"--config.data.dir={args.data_dir}", "--config.train.log_every=1"]
  # Preallocated, as a training run is: on a growing (non-preallocated) allocator the step's one 65.9 GiB block of
  # temporaries did not fit under a 71.3 GiB limit on an H100 (fragmentation), though it fits preallocated.
  env = {**os.environ, "XLA_PYTHON_CLIENT_MEM_FRACTION": str(args.mem_fraction),
         "XLA_PYTHON_CLIENT_PREALLOCATE": "true"}
  t0 = time.time()
  try:
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.run_timeout)
    rc, log = proc.returncode, proc.stdout + proc.stderr
  except subprocess.TimeoutExpired:
    rc, log = "timeout", ""
  rows = [r for r in metrics.read(work) if "tokens_per_sec" in r]
  out = {"returncode": rc, "wall_s": time.time() - t0, "steps_done": len(rows)}
  if rows:
    out["tokens_per_sec"] = statistics.median(r["tokens_per_sec"] for r in rows[1:] or rows)
    peaks = [r["peak_memory_gib"] for r in rows if r.get("peak_memory_gib") is not None]
    out["peak_memory_gib"] = max(peaks) if peaks else None
  if rc:
    out["log_tail"] = [l for l in log.splitlines() if l.strip()][-4:]
  return out


def variant(arg: str, limit: float, args) -> dict:
  lengths = [int(x) for x in args.fit.split(",")]
  if len(lengths) != 2:
    raise SystemExit(f"--fit={args.fit!r}: expected two lengths, e.g. 131072,262144")
  res = {"config_arg": arg, "limit_bytes": limit}
  for name, extra in [("", "")] + ([("chunked_", f"loss_chunk={args.loss_chunk}")] if args.loss_chunk else []):
    a = ",".join(x for x in (arg, extra) if x)
    pts = [compiled_bytes(a, t) for t in lengths]
    slope, intercept = fit_line([(p["seq_len"], p["bytes"]) for p in pts])
    best = min(predict(slope, intercept, limit, args.granule), args.max_seq)
    checked = []
    while best > 0 and len(checked) < 4:  # the line is a model: compile at the prediction, step down if over
      c = compiled_bytes(a, best)
      checked.append(c)
      if c["bytes"] <= limit:
        break
      best -= args.granule
    res[f"{name}config_arg"] = a
    res[f"{name}fit"] = pts
    res[f"{name}bytes_per_token"] = slope
    res[f"{name}fixed_bytes"] = intercept
    res[f"{name}checked"] = checked
    fits = bool(checked) and checked[-1]["bytes"] <= limit
    res[f"{name}longest_seq_len"] = best if fits else None
    if args.run and fits:
      res[f"{name}run"] = train_at(a, best, args)
    print(f"  {a or '(defaults)'}: {slope / 1024:.1f} KiB/token + {intercept / GIB:.2f} GiB fixed -> longest "
          f"{res[f'{name}longest_seq_len']} tokens" + (f", run: {res[f'{name}run']}" if f"{name}run" in res else ""),
          flush=True)
  if args.loss_chunk:
    res["logits_bytes_per_token"] = res["bytes_per_token"] - res["chunked_bytes_per_token"]
  return res


def write(path: str, info: dict, entries: list[dict]):
  with open(path, "w") as f:
    json.dump({"info": info, "variants": entries}, f, indent=1)


def run_from(args):
  """--run_from: train each earlier variant at its longest length; one JSON with the fits and the runs."""
  info, entries = None, []
  for path in args.run_from.split(","):
    with open(path) as f:
      d = json.load(f)
    info = info or d["info"]
    entries += d["variants"]
  for e in entries:
    name = "chunked_" if e.get("chunked_longest_seq_len") else ""
    seq = e.get(f"{name}longest_seq_len")
    if not seq:
      print(f"  {e['config_arg']}: no length fits, nothing to run", flush=True)
      continue
    arg = e[f"{name}config_arg"]
    print(f"  {arg}: training {args.run_steps} steps at {seq:,} tokens ...", flush=True)
    e[f"{name}run"] = train_at(arg, seq, args)
    print(f"    {e[f'{name}run']}", flush=True)
    write(args.out, info, entries)
  print(f"wrote {args.out}")


def main():
  args = ap.parse_args()
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(args.mem_fraction))
  # This process only compiles (abstract state); preallocating would take the memory the runs' processes need.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  if args.run_from:
    return run_from(args)
  import jax  # noqa: PLC0415  (after the memory fraction is set)
  stats = jax.devices()[0].memory_stats() or {}
  limit = args.limit_gib * GIB or stats.get("bytes_limit")
  if not limit:
    raise SystemExit(f"{jax.devices()[0]} reports no memory limit: pass --limit_gib")
  info = {"device": str(jax.devices()[0]), "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
          "limit_gib": limit / GIB, "mem_fraction": args.mem_fraction, "fit": args.fit, "granule": args.granule}
  print(f"{info['device']}: limit {limit / GIB:.1f} GiB", flush=True)
  entries = []
  for heads in args.heads or ["8/2", "16/1"]:
    for attention in args.attention.split(","):
      arg = ",".join(x for x in (f"attention={attention}", f"heads={heads}", args.common_arg) if x)
      entries.append({"heads": heads, "attention": attention, **variant(arg, limit, args)})
      write(args.out, info, entries)  # after every variant: a later failure loses nothing
  print(f"\n{'heads':>6} {'attention':>9} {'KiB/token':>9} {'fixed GiB':>9} {'longest':>9} "
        f"{'logits KiB/token':>16} {'chunked longest':>15}")
  for e in entries:
    fmt = lambda v, f: f.format(v) if v is not None else "-"  # noqa: E731
    print(f"{e['heads']:>6} {e['attention']:>9} {e['bytes_per_token'] / 1024:>9.1f} {e['fixed_bytes'] / GIB:>9.2f} "
          f"{fmt(e['longest_seq_len'], '{:,}'):>9} "
          f"{fmt(e.get('logits_bytes_per_token') and e['logits_bytes_per_token'] / 1024, '{:.1f}'):>16} "
          f"{fmt(e.get('chunked_longest_seq_len'), '{:,}'):>15}")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
