r"""Plots a run's metrics.jsonl: train loss, held-out loss per source, learning rate, and for MSA runs the KL and
the selection's attention-mass recall against a random selection. Writes WORKDIR/plots.png.

  python -m experiments.plot_run workdirs/tiny_lm
  python -m experiments.plot_run workdirs/tiny_msa --out=/tmp/msa.png
"""

import argparse
import os

import matplotlib

matplotlib.use("Agg")  # files only: no display on CI or the GPU box
import matplotlib.pyplot as plt  # noqa: E402

from experiments.lib import metrics  # noqa: E402


def series(rows, key):
  """(steps, values) of `key`, by step (the last row of a step wins, None values left out)."""
  pts = metrics.by_step(rows, key, keep_none=False)
  return [s for s, _ in pts], [v for _, v in pts]


def plot(workdir: str, out: str | None = None) -> str:
  rows = metrics.read(workdir)
  if not rows:
    raise SystemExit(f"{workdir}: no metrics.jsonl")
  keys = set().union(*rows)
  sources = sorted({k.split("/")[1] for k in keys
                    if k.startswith("eval/") and k.endswith("/loss") and k.count("/") == 2})
  msa_layers = sorted({k.split("/")[1] for k in keys if k.startswith("msa/layer")})
  panels = 3 + (2 if msa_layers else 0)
  fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.4))
  ax = axes[0]
  ax.plot(*series(rows, "loss"), label="train")
  for s in sources:
    ax.plot(*series(rows, f"eval/{s}/loss"), marker="o", ms=3, label=f"held-out {s}")
  ax.set(title="loss (nats/token)", xlabel="step")
  ax.legend(fontsize=7)
  axes[1].plot(*series(rows, "lr"))
  axes[1].set(title="learning rate", xlabel="step")
  axes[2].plot(*series(rows, "grad_norm"))
  axes[2].set(title="gradient norm", xlabel="step")
  if msa_layers:
    axes[3].plot(*series(rows, "kl_loss"))
    axes[3].set(title="KL(teacher || indexer), summed", xlabel="step")
    for layer in msa_layers:
      line, = axes[4].plot(*series(rows, f"msa/{layer}/mass_recall"), label=f"{layer} learned")
      axes[4].plot(*series(rows, f"msa/{layer}/random_mass_recall"), ls="--", color=line.get_color(),
                   label=f"{layer} random")
    axes[4].set(title="attention mass in selected blocks", xlabel="step", ylim=(0, 1))
    axes[4].legend(fontsize=7)
  fig.suptitle(os.path.abspath(workdir), fontsize=8)
  fig.tight_layout()
  out = out or os.path.join(workdir, "plots.png")
  fig.savefig(out, dpi=110)
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("workdir")
  ap.add_argument("--out")
  args = ap.parse_args()
  print(f"wrote {plot(args.workdir, args.out)}")


if __name__ == "__main__":
  main()
