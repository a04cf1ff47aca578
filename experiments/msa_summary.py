r"""Summarises an MSA training run's metrics.jsonl: KL at the start and end, and the selection quality
(attention-mass recall of the learned indexer vs a random selection with the same forced local blocks, block
recall vs the oracle top blocks) averaged over the last logged steps. Prints a table, writes JSON.

  python -m experiments.msa_summary workdirs/tiny_msa [--last=10]
"""

import argparse
import json
import os

import numpy as np

from experiments.lib import metrics


def summarise(workdir: str, last: int = 10) -> dict:
  by_step = metrics.rows_by_step(metrics.read(workdir), "kl_loss")  # a resumed run logs some steps twice
  if not by_step:
    raise SystemExit(f"{workdir}: no training rows in metrics.jsonl")
  rows = [by_step[s] for s in sorted(by_step)]
  layers = sorted({k.split("/")[1] for k in rows[0] if k.startswith("msa/layer")})
  tail = rows[-last:]
  out = {"workdir": workdir, "first_step": rows[0]["step"], "last_step": rows[-1]["step"],
         "kl_first": rows[0]["kl_loss"], "kl_last_mean": float(np.mean([r["kl_loss"] for r in tail])),
         "layers": {}}
  for layer in layers:
    get = lambda name: float(np.mean([r[f"msa/{layer}/{name}"] for r in tail]))  # noqa: E731
    out["layers"][layer] = {name: get(name) for name in ("kl", "mass_recall", "random_mass_recall",
                                                          "block_recall")}
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("workdir")
  ap.add_argument("--last", type=int, default=10, help="average over this many last logged steps")
  args = ap.parse_args()
  s = summarise(args.workdir, args.last)
  print(f"KL (sum over MSA layers): step {s['first_step']} {s['kl_first']:.4f} -> "
        f"mean of last {args.last} logged steps {s['kl_last_mean']:.4f} "
        f"({s['kl_last_mean'] / s['kl_first']:.1%} of the start)")
  print(f"{'layer':<8}{'KL':>8}{'mass recall':>13}{'random':>9}{'block recall':>14}")
  for layer, m in s["layers"].items():
    print(f"{layer:<8}{m['kl']:>8.4f}{m['mass_recall']:>13.3f}{m['random_mass_recall']:>9.3f}"
          f"{m['block_recall']:>14.3f}")
  path = os.path.join(args.workdir, "msa_summary.json")
  with open(path, "w") as f:
    json.dump(s, f, indent=2)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
