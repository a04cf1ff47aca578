r"""Plots a run's metrics.jsonl: train loss, held-out loss per source, learning rate, for MSA runs the KL and the
selection's attention-mass recall against a random selection, and for MoE runs the max/mean expert load per layer. Writes WORKDIR/plots.png. Several runs (NAME=DIR)
share the loss, learning-rate and gradient-norm panels, e.g. dense beside MSA over the same steps.

  python -m experiments.plot_run workdirs/tiny_lm
  python -m experiments.plot_run workdirs/tiny_msa --out=/tmp/msa.png
  python -m experiments.plot_run dense=workdirs/small_dense msa=workdirs/small_msa --out=/tmp/dense_vs_msa.png
"""

import argparse
import os

import matplotlib

matplotlib.use("Agg")  # files only: no display on CI or the GPU box
import matplotlib.pyplot as plt  # noqa: E402

from experiments.lib import metrics  # noqa: E402

MOE_LOAD = "moe/max_over_mean/"  # + layer{i}: the train step's per-layer load metric


def series(rows, key):
  """(steps, values) of `key`, by step (the last row of a step wins, None values left out)."""
  pts = metrics.by_step(rows, key, keep_none=False)
  return [s for s, _ in pts], [v for _, v in pts]


def plot(workdir: str | dict[str, str], out: str | None = None) -> str:
  """workdir: one run's directory, or {label: directory} for several runs in the same panels."""
  runs = {"": workdir} if isinstance(workdir, str) else dict(workdir)
  rows_of = {}
  for name, d in runs.items():
    rows_of[name] = metrics.read(d)
    if not rows_of[name]:
      raise SystemExit(f"{d}: no metrics.jsonl")
  prefix = lambda name: f"{name} " if name else ""  # noqa: E731
  keys = set().union(*(set().union(*rows) for rows in rows_of.values()))
  msa_layers = sorted({k.split("/")[1] for k in keys if k.startswith("msa/layer")})
  moe_panel = 3 + (2 if msa_layers else 0)
  panels = moe_panel + (1 if any(k.startswith(MOE_LOAD) for k in keys) else 0)
  fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.4))
  for name, rows in rows_of.items():
    run_keys = set().union(*rows)
    sources = sorted({k.split("/")[1] for k in run_keys
                      if k.startswith("eval/") and k.endswith("/loss") and k.count("/") == 2})
    axes[0].plot(*series(rows, "loss"), label=f"{prefix(name)}train")
    for s in sources:
      axes[0].plot(*series(rows, f"eval/{s}/loss"), marker="o", ms=3, label=f"{prefix(name)}held-out {s}")
    axes[1].plot(*series(rows, "lr"), label=name or None)
    axes[2].plot(*series(rows, "grad_norm"), label=name or None)
    run_layers = sorted({k.split("/")[1] for k in run_keys if k.startswith("msa/layer")})
    if run_layers:
      axes[3].plot(*series(rows, "kl_loss"), label=name or None)
      for layer in run_layers:
        line, = axes[4].plot(*series(rows, f"msa/{layer}/mass_recall"), label=f"{prefix(name)}{layer} learned")
        axes[4].plot(*series(rows, f"msa/{layer}/random_mass_recall"), ls="--", color=line.get_color(),
                     label=f"{prefix(name)}{layer} random")
    for key in sorted((k for k in run_keys if k.startswith(MOE_LOAD)), key=lambda k: int(k.rsplit("layer", 1)[1])):
      axes[moe_panel].plot(*series(rows, key), lw=1, label=f"{prefix(name)}{key[len(MOE_LOAD):]}")
  axes[0].set(title="loss (nats/token)", xlabel="step")
  axes[0].legend(fontsize=7)
  axes[1].set(title="learning rate", xlabel="step")
  axes[2].set(title="gradient norm", xlabel="step")
  if len(runs) > 1:
    axes[2].legend(fontsize=7)
  if msa_layers:
    axes[3].set(title="KL(teacher || indexer), summed", xlabel="step")
    axes[4].set(title="attention mass in selected blocks", xlabel="step", ylim=(0, 1))
    axes[4].legend(fontsize=6, ncol=2 if len(msa_layers) > 4 else 1)
  if panels > moe_panel:
    axes[moe_panel].axhline(1.0, color="gray", lw=0.5)
    axes[moe_panel].set(title="max / mean expert load (1 = balanced)", xlabel="step")
    axes[moe_panel].legend(fontsize=6)
  fig.suptitle("  ".join(f"{prefix(n)}{os.path.abspath(d)}" for n, d in runs.items()), fontsize=8)
  fig.tight_layout()
  out = out or os.path.join(next(iter(runs.values())), "plots.png")
  fig.savefig(out, dpi=110)
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("workdir", nargs="+", help="a run's directory, or several as NAME=DIR")
  ap.add_argument("--out")
  args = ap.parse_args()
  if len(args.workdir) == 1 and "=" not in args.workdir[0]:
    target = args.workdir[0]
  else:
    target = dict(w.partition("=")[::2] if "=" in w else (os.path.basename(w.rstrip("/")), w) for w in args.workdir)
  print(f"wrote {plot(target, args.out)}")


if __name__ == "__main__":
  main()
