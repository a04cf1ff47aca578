"""The report's plots: text loss over training (absolute and paired delta vs text_only), final text-loss deltas,
caption losses, text->visual attention mass per layer and the attention maps of a few held-out examples."""

from __future__ import annotations

import json
import math
import os
import statistics

import matplotlib

matplotlib.use("Agg")  # files only: no display on CI or the GPU box
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from experiments.native_vs_cpt.stats import REFERENCE, paired  # noqa: E402

PLOTS = ("text_loss.png", "text_delta.png", "caption_loss.png", "attention_mass.png", "attention_maps.png")
DPI = 80


def _band(ax, curves: list[list[tuple[int, float]]], label: str, color: str):
  """The mean of `curves` (over seeds) as a line, their min..max as a band when there are several."""
  n = min(len(c) for c in curves)
  x = np.array([p[0] for p in curves[0][:n]])
  y = np.array([[p[1] for p in c[:n]] for c in curves], np.float64)
  mean = y.mean(0)
  ax.plot(x, mean, color=color, label=label, lw=1.5)
  if len(curves) > 1:
    ax.fill_between(x, y.min(0), y.max(0), color=color, alpha=0.2, lw=0)


def _save(fig, sweep_dir: str, name: str) -> str:
  fig.tight_layout()
  path = os.path.join(sweep_dir, name)
  fig.savefig(path, dpi=DPI)
  plt.close(fig)
  return path


def plot_all(sweep_dir: str, summ: dict, runs: dict, arms: list[str]) -> list[str]:
  """Writes PLOTS into sweep_dir; returns their paths."""
  colors = {a: f"C{i}" for i, a in enumerate(arms)}
  text_sources = next(iter(next(iter(runs.values())).values()))["sources"]["text"]
  vstart = {a: next(iter(runs[a].values()))["setting"]["vision_start_step"] for a in arms}
  return [_save(plot_text_loss(summ, arms, colors, vstart), sweep_dir, "text_loss.png"),
          _save(plot_text_delta(summ, arms, colors, text_sources), sweep_dir, "text_delta.png"),
          _save(plot_captions(summ, arms, colors), sweep_dir, "caption_loss.png"),
          _save(plot_mass(summ, arms, colors), sweep_dir, "attention_mass.png"),
          plot_maps(sweep_dir, runs, arms)]


def plot_text_loss(summ: dict, arms: list[str], colors: dict, vstart: dict):
  """Text loss curves: absolute and paired delta vs text_only (band: min..max over seeds)."""
  ref = summ.get(REFERENCE, {})
  fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
  for a in arms:
    _band(axes[0], [summ[a][s]["curve"] for s in sorted(summ[a])], a, colors[a])
    if a != REFERENCE and ref:
      deltas = [[(p[0], p[1] - q[1]) for p, q in zip(summ[a][s]["curve"], ref[s]["curve"])]
                for s in sorted(summ[a]) if s in ref]
      if deltas:
        _band(axes[1], deltas, a, colors[a])
      if vstart[a] is not None:
        axes[1].axvline(vstart[a], color=colors[a], ls=":", lw=1)
  axes[0].set(title="held-out text loss (mean over text sources)", xlabel="step", ylabel="nats/token")
  finals = [v for a in arms for v in (p[1] for s in summ[a] for p in summ[a][s]["curve"][-1:])]
  if finals:
    axes[0].set_ylim(min(finals) - 0.3, min(finals) + 2.5)
  axes[1].axhline(0, color="grey", lw=1)
  axes[1].set(title="delta vs text_only (same seed); dotted: vision start", xlabel="step", ylabel="nats/token")
  axes[0].legend(fontsize=7)
  return fig


def plot_text_delta(summ: dict, arms: list[str], colors: dict, text_sources: list[str]):
  """Final text-loss delta per arm with error bars, overall and per source."""
  ref = summ.get(REFERENCE, {})
  others = [a for a in arms if a != REFERENCE]
  fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [1, 2]})
  if ref and others:
    for i, a in enumerate(others):
      p = paired({s: v["text"] for s, v in summ[a].items()}, {s: v["text"] for s, v in ref.items()})
      axes[0].bar(i, p["mean"], yerr=p["std"] or 0.0, color=colors[a], capsize=4)
      axes[0].plot([i] * len(p["per_seed"]), list(p["per_seed"].values()), "k.", ms=5)
      width = 0.8 / len(others)
      for j, s_name in enumerate(text_sources):
        q = paired({s: v["per_source"][s_name] for s, v in summ[a].items()},
                   {s: v["per_source"][s_name] for s, v in ref.items()})
        axes[1].bar(j + (i - (len(others) - 1) / 2) * width, q["mean"], width, yerr=q["std"] or 0.0,
                    color=colors[a], label=a if j == 0 else None, capsize=2)
    axes[0].set_xticks(range(len(others)))
    axes[0].set_xticklabels(others, rotation=20, fontsize=7)
    axes[1].set_xticks(range(len(text_sources)))
    axes[1].set_xticklabels(text_sources, fontsize=8)
    axes[1].legend(fontsize=7)
  for ax in axes:
    ax.axhline(0, color="grey", lw=1)
  axes[0].set(title="final text loss - text_only\n(bar: mean, error: std, dots: seeds)", ylabel="nats/token")
  axes[1].set(title="per text source")
  return fig


def plot_captions(summ: dict, arms: list[str], colors: dict):
  """Caption losses: over training (image, video) and final bars."""
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
  for k, kind in enumerate(("image", "video")):
    for a in arms:
      curves = [[(x, y) for x, y in summ[a][s]["caption_curves"][kind] if y is not None] for s in sorted(summ[a])]
      if all(curves):
        _band(axes[k], curves, a, colors[a])
    axes[k].set(title=f"held-out {kind}-caption loss", xlabel="step", ylabel="nats/token")
  axes[0].legend(fontsize=7)
  for i, a in enumerate(arms):
    for j, kind in enumerate(("image", "video", "real")):
      vals = [summ[a][s][kind] for s in summ[a] if summ[a][s][kind] is not None]
      if vals:
        axes[2].bar(j + (i - (len(arms) - 1) / 2) * 0.8 / len(arms), statistics.fmean(vals), 0.8 / len(arms),
                    yerr=statistics.stdev(vals) if len(vals) > 1 else 0.0, color=colors[a], capsize=2)
  axes[2].set_xticks(range(3))
  axes[2].set_xticklabels(["image", "video (synthetic)", "real clips"])
  axes[2].set(title="final caption loss")
  return fig


def plot_mass(summ: dict, arms: list[str], colors: dict):
  """Text->visual attention mass per layer, per modality, against uniform attention."""
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
  for k, kind in enumerate(("image", "video")):
    for a in arms:
      per = np.array([summ[a][s]["mass"][kind] for s in sorted(summ[a]) if kind in summ[a][s]["mass"]])
      if per.size:
        axes[k].errorbar(np.arange(per.shape[1]), per.mean(0), yerr=per.std(0, ddof=1) if len(per) > 1 else None,
                         marker="o", color=colors[a], label=a, capsize=3)
    uni = [summ[a][s]["uniform"].get(kind) for a in arms for s in summ[a]]
    uni = [u for u in uni if u is not None]
    if uni:
      axes[k].axhline(statistics.fmean(uni), color="grey", ls="--", lw=1, label="uniform over visible tokens")
    axes[k].set(title=f"text->visual attention mass ({kind} captions)", xlabel="layer",
                ylabel="attention on visual tokens")
  axes[0].legend(fontsize=7)
  return fig


def plot_maps(sweep_dir: str, runs: dict, arms: list[str]) -> str:
  """Rows: (example, arm); columns: the example's pixels, then its caption's attention per layer."""
  seed = min(s for a in arms for s in runs[a])
  maps = {a: runs[a][seed]["maps"] for a in arms if seed in runs[a]}
  examples_path = os.path.join(sweep_dir, "attention_examples.json")
  pictures = json.load(open(examples_path)) if os.path.exists(examples_path) else []
  n_ex = min(len(m) for m in maps.values())
  n_layers = len(next(iter(maps.values()))[0]["layers"]) if n_ex else 0
  rows = [(e, a) for e in range(n_ex) for a in maps]
  fig, axes = plt.subplots(max(len(rows), 1), n_layers + 1, figsize=(1.9 * (n_layers + 1), 1.5 * max(len(rows), 1)),
                           squeeze=False)
  for e in range(n_ex):
    ex = maps[next(iter(maps))][e]
    frames = np.asarray(pictures[e]["frames"], np.uint8) if e < len(pictures) else None
    n_vis = len(ex["layers"][0])
    t = frames.shape[0] if frames is not None and ex["kind"] == "video" else 1
    side = int(round(math.sqrt(n_vis // t)))
    vmax = [max(max(maps[a][e]["layers"][layer]) for a in maps) for layer in range(n_layers)]
    for r, (ee, a) in enumerate(rows):
      if ee != e:
        continue
      ax = axes[r, 0]
      if frames is not None:
        ax.imshow(np.concatenate(list(frames), axis=1))
      ax.set_title(f"{a}\n{ex['source']}", fontsize=7)
      for layer in range(n_layers):
        g = np.asarray(maps[a][e]["layers"][layer]).reshape(t, side, side)  # merged tokens in (t, h, w) order
        axes[r, layer + 1].imshow(np.concatenate(list(g), axis=1), vmin=0, vmax=max(vmax[layer], 1e-9),
                                  cmap="magma")
        axes[r, layer + 1].set_title(f"layer {layer}: {maps[a][e]['mass'][layer]:.3f}", fontsize=7)
  for ax in axes.ravel():
    ax.set_xticks([])
    ax.set_yticks([])
  return _save(fig, sweep_dir, "attention_maps.png")
