r"""Training throughput and MFU of a config on the current machine: runs `m3_jax.main` for N steps and
summarises tokens/s and MFU from metrics.jsonl (median over logged steps after the first, which includes
compilation). Prints a table and writes JSON.

  python -m experiments.bench_train --out=/tmp/bench.json \
      --run "dense=configs/small_lm.py:steps=120" --run "moe=configs/small_lm.py:moe=True,steps=80"
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from experiments.lib import metrics
from experiments.lib.config import REPO


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--run", action="append", required=True, help="NAME=CONFIG[:ARG] [extra flags after ' ']")
  ap.add_argument("--workroot", default="/tmp/bench_train")
  ap.add_argument("--out", default="bench_train.json")
  ap.add_argument("--run_timeout", type=float, default=None,
                  help="seconds per run; a run past it is killed and recorded with what it logged so far")
  args = ap.parse_args()
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)  # each run's log goes beside the JSON
  results = {}
  for spec in args.run:
    name, _, rest = spec.partition("=")
    config, *extra = rest.split()
    work = os.path.join(args.workroot, name)
    subprocess.run(["rm", "-rf", work], check=True)
    cmd = [sys.executable, "-m", "m3_jax.main", f"--config={config}", f"--workdir={work}",
           "--config.train.eval_every=0", "--config.checkpoint.every=0", *extra]
    t0 = time.time()
    try:
      proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.run_timeout)
      returncode, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
      returncode = "timeout"
      log = "".join(x.decode() if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
    wall = time.time() - t0
    with open(os.path.join(os.path.dirname(os.path.abspath(args.out)), f"{name}.log"), "w") as f:
      f.write(log)
    rows = [r for r in metrics.read(work) if "tokens_per_sec" in r]
    steady = rows[2:] if len(rows) > 3 else rows[1:]
    res = {"config": config, "extra": extra, "returncode": returncode, "wall_s": wall}
    if steady:
      res["tokens_per_sec"] = statistics.median(r["tokens_per_sec"] for r in steady)
      mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
      res["mfu"] = statistics.median(mfus) if mfus else None
      res["final_loss"] = rows[-1]["loss"]
      res["first_loss"] = rows[0]["loss"]
    compile_line = [l for l in log.splitlines() if l.startswith(("compiled in", "model:"))]
    res["notes"] = compile_line
    results[name] = res
    print(f"{name}: rc={returncode} " + json.dumps({k: v for k, v in res.items() if k != "notes"}), flush=True)
    if returncode:
      print(log[-3000:])
    # Written after every run so that a call cut short by its time limit keeps the runs that finished.
    with open(args.out, "w") as f:
      json.dump(results, f, indent=2)
  print(f"\n{'run':<12}{'tok/s':>12}{'MFU':>8}{'loss first->last':>22}")
  for name, r in results.items():
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
    print(f"{name:<12}{r.get('tokens_per_sec', 0):>12,.0f}{mfu:>8}"
          f"{r.get('first_loss', float('nan')):>11.3f} -> {r.get('final_loss', float('nan')):.3f}")
  with open(args.out, "w") as f:
    json.dump(results, f, indent=2)


if __name__ == "__main__":
  main()
