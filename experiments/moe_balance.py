r"""Expert load balancing in tiny_lm's MoE layers: the balance loss vs aux-loss-free balancing (M3 / DeepSeek-V3's
router-bias sign step), over seeds, on a CPU.

  # both settings x 3 seeds (~15-20 min on 2 CPU cores), then the report:
  python -m experiments.moe_balance --data_dir=data --sweep_dir=workdirs/moe_balance
  # only the report from finished runs (e.g. after changing the analysis):
  python -m experiments.moe_balance --data_dir=data --sweep_dir=workdirs/moe_balance --report_only
  # then keep report.md, results.json and moe_balance.png in experiments/results/moe_balance_cpu_<date>/

Settings (configs/tiny_lm.py's `balance=`): `loss` trains with HF's `router_aux_loss_coef` (0.001) x the balance
loss and a frozen router bias, as the model trained before; `aux_free` has no balance loss and moves every MoE
layer's `e_score_correction_bias` by `--bias_rate` x sign(mean load - expert load) after each step. Each run logs
every step; the analysis reads per layer the max/mean expert load (1 = balanced; top-2 of 8 experts collapsed on
two experts is 4) and summarises the last `--window` steps: the mean over those steps (the target is <= 1.5) and
their largest value. Final held-out loss is the trainer's last eval (mean over the held-out sources); the loss
comparison is paired by seed (the same seed reads the same batches in both settings). Writes SWEEP_DIR/results.json,
SWEEP_DIR/report.md and SWEEP_DIR/moe_balance.png; the verdict in report.md is computed from the numbers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from experiments.lib import metrics, sweep
from experiments.lib import training
from experiments.lib.config import add_cache_flag, add_config_flags, config_arg, enable_compilation_cache, load_config

TAG = "moe_balance"
SETTINGS = ("loss", "aux_free")
MOE_LOAD = "moe/max_over_mean/"  # + layer{i}: the train step's per-layer load metric
TARGET = 1.5
# Small enough for 6 runs on 2 shared CPU cores; the routing statistics per step are still over 2048 slots.
SIZE_ARG = "batch_size=8,seq_len=128"
DEFAULT_STEPS = 300


def make_config(a: argparse.Namespace, setting: str, seed: int):
  """configs/tiny_lm.py (MoE) for one balancing setting and seed, logging every step, evaluating at the end."""
  steps = a.steps or DEFAULT_STEPS
  arg = config_arg(f"balance={setting},bias_rate={a.bias_rate},seed={seed},steps={steps}", SIZE_ARG, a.config_arg)
  c = load_config("tiny_lm", arg, data_dir=a.data_dir, overrides=a.override)
  c.train.log_every = 1  # the load of every step: the window statistics need them all
  c.train.eval_every = int(c.train.steps)  # step 0 and the end
  return c


def layer_keys(rows: list[dict]) -> list[str]:
  keys = {k for r in rows for k in r if k.startswith(MOE_LOAD)}
  return sorted(keys, key=lambda k: int(k.rsplit("layer", 1)[1]))


def analyse(workdir: str, steps: int, window: int) -> dict:
  """Per-layer max/mean load curves and their last-`window` statistics, train loss over the window, final eval."""
  rows = metrics.read(workdir)
  out = {"layers": {}, "curves": {}}
  for key in layer_keys(rows):
    curve = metrics.by_step(rows, key, keep_none=False)
    last = [v for s, v in curve if s > steps - window]
    name = key[len(MOE_LOAD):]
    out["curves"][name] = curve
    out["layers"][name] = {"window_mean": statistics.fmean(last), "window_max": max(last), "window_steps": len(last)}
  out["worst_window_mean"] = max(v["window_mean"] for v in out["layers"].values())
  out["worst_window_max"] = max(v["window_max"] for v in out["layers"].values())
  out["loss_curve"] = metrics.by_step(rows, "loss", keep_none=False)
  out["train_loss_window"] = statistics.fmean(v for s, v in out["loss_curve"] if s > steps - window)
  evals = metrics.evals(workdir)
  final = evals[-1]
  out["eval_step"] = final["step"]
  out["eval_loss"] = final["loss"]
  out["eval_mean_loss"] = metrics.by_step(rows, "eval/mean_loss")[-1][1]
  return out


def run_one(a: argparse.Namespace, setting: str, seed: int, work: str) -> dict:
  cfg = make_config(a, setting, seed)
  training.train(cfg, work)
  trained = training.trained_steps(cfg, work)
  sweep.stop_if_cut_short(trained, int(cfg.train.steps), tag=TAG, what=f"{setting} seed {seed}", work=work)
  record = {"setting": setting, "seed": seed, "steps_trained": trained,
            "router_aux_loss_coef": float(cfg.model.router_aux_loss_coef),
            "router_bias_update_rate": float(cfg.model.router_bias_update_rate)}
  record.update(analyse(work, int(cfg.train.steps), a.window))
  return record


def spread(xs: list[float]) -> dict:
  return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0,
          "min": min(xs), "max": max(xs), "n": len(xs)}


def aggregate(runs: dict[str, dict[int, dict]]) -> dict:
  """Per setting: the worst layer's window statistics and the final held-out loss over seeds; the loss difference
  aux_free - loss paired by seed."""
  out = {}
  for setting, by_seed in runs.items():
    recs = [by_seed[s] for s in sorted(by_seed)]
    out[setting] = {"seeds": sorted(by_seed), "router_aux_loss_coef": recs[0]["router_aux_loss_coef"],
                    "router_bias_update_rate": recs[0]["router_bias_update_rate"],
                    "worst_window_mean": spread([r["worst_window_mean"] for r in recs]),
                    "worst_window_max": spread([r["worst_window_max"] for r in recs]),
                    "eval_mean_loss": spread([r["eval_mean_loss"] for r in recs]),
                    "train_loss_window": spread([r["train_loss_window"] for r in recs]),
                    "per_layer_window_mean": {
                        layer: spread([r["layers"][layer]["window_mean"] for r in recs])
                        for layer in recs[0]["layers"]}}
  if all(s in runs for s in SETTINGS):
    common = sorted(set(runs["loss"]) & set(runs["aux_free"]))
    if common:
      diffs = [runs["aux_free"][s]["eval_mean_loss"] - runs["loss"][s]["eval_mean_loss"] for s in common]
      out["paired_eval_loss_diff"] = {**spread(diffs), "seeds": common, "per_seed": diffs}
  return out


def verdict(agg: dict, window: int) -> list[str]:
  lines = []
  if "aux_free" in agg:
    w = agg["aux_free"]["worst_window_mean"]
    holds = w["max"] <= TARGET
    peak = agg["aux_free"]["worst_window_max"]
    lines.append(f"Balance target (max/mean expert load averaged over the last {window} steps <= {TARGET}, worst "
                 f"layer, every seed) with aux-loss-free balancing: {'HOLDS' if holds else 'DOES NOT HOLD'} "
                 f"({w['mean']:.3f} mean over seeds, worst seed {w['max']:.3f}). Step by step it "
                 f"{'stays' if peak['max'] <= TARGET else 'does not stay'} under {TARGET}: the largest single step of "
                 f"the window is {peak['mean']:.3f} on average over seeds, {peak['max']:.3f} at most.")
  if "loss" in agg:
    w = agg["loss"]["worst_window_mean"]
    lines.append(f"With the balance loss (router_aux_loss_coef {agg['loss']['router_aux_loss_coef']:g}, bias frozen) "
                 f"the same statistic is {w['mean']:.3f} (worst seed {w['max']:.3f}).")
  d = agg.get("paired_eval_loss_diff")
  if d:
    se = d["std"] / d["n"] ** 0.5 if d["n"] > 1 else float("nan")
    worse = sum(x > 0 for x in d["per_seed"])
    if d["mean"] <= 0:
      word = "HOLDS: aux-loss-free is no worse on average"
    elif d["mean"] <= 2 * se:
      word = (f"DOES NOT HOLD on average, though within seed noise: aux-loss-free is worse by "
              f"{d['mean'] / se:.1f} standard errors, on {worse} of {d['n']} seeds")
    else:
      word = f"DOES NOT HOLD: aux-loss-free is worse by more than 2 standard errors, on {worse} of {d['n']} seeds"
    lines.append(f"Loss target (final held-out loss with aux-loss-free no worse than with the balance loss): {word}; "
                 f"aux_free - loss = {d['mean']:+.4f} +- {se:.4f} nats (s.e. over {d['n']} paired seeds; per seed "
                 + ", ".join(f"{x:+.4f}" for x in d["per_seed"]) + ").")
  return lines


def write_report(sweep_dir: str, runs: dict, agg: dict, meta: dict) -> None:
  w = meta["window"]
  lines = [f"# MoE load balancing in tiny_lm: balance loss vs aux-loss-free ({meta['device']})", "",
           f"{len(meta['seeds'])} seeds x {meta['steps']} steps, batch {meta['batch_size']} x {meta['seq_len']} tokens, "
           f"{meta['experts']} experts, top-{meta['top_k']}, MoE layers {meta['moe_layers']}; aux-loss-free rate "
           f"{meta['bias_rate']} per step. Sweep wall time {meta['wall_s'] / 60:.1f} min. Command: `{meta['command']}`.",
           "", "## Verdict", ""] + [f"- {x}" for x in verdict(agg, w)] + [
           "", f"## Numbers (mean +- std over seeds; load = max/mean expert load, 1 = balanced, {meta['top_k']}/"
           f"{meta['experts']} experts for all slots = {meta['experts'] / meta['top_k']:.0f})", "",
           f"| setting | load, last {w} steps, worst layer (mean) | (max over the window) | per layer (mean) "
           f"| held-out loss (final) | train loss (last {w}) |",
           "|---|---|---|---|---|---|"]
  for setting in SETTINGS:
    if setting not in agg:
      continue
    g = agg[setting]
    fmt = lambda s, p=3: f"{s['mean']:.{p}f} +- {s['std']:.{p}f}"  # noqa: E731
    per_layer = ", ".join(f"{k} {v['mean']:.2f}" for k, v in g["per_layer_window_mean"].items())
    lines.append(f"| {setting} | {fmt(g['worst_window_mean'])} | {fmt(g['worst_window_max'])} | {per_layer} | "
                 f"{fmt(g['eval_mean_loss'], 4)} | {fmt(g['train_loss_window'], 4)} |")
  lines += ["", "Per run:", "", "| setting | seed | load, worst layer (window mean / max) | held-out loss |",
            "|---|---|---|---|"]
  for setting in SETTINGS:
    for seed, r in sorted(runs.get(setting, {}).items()):
      lines.append(f"| {setting} | {seed} | {r['worst_window_mean']:.3f} / {r['worst_window_max']:.3f} | "
                   f"{r['eval_mean_loss']:.4f} |")
  lines += ["", "Plot: `moe_balance.png` (max/mean load per layer over training, mean over seeds; train loss; final "
            "held-out loss per seed).", ""]
  if meta.get("note"):
    lines += [meta["note"], ""]
  with open(os.path.join(sweep_dir, "report.md"), "w") as f:
    f.write("\n".join(lines))


def plot(sweep_dir: str, runs: dict, window: int, steps: int) -> str:
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
  colors = {"loss": "tab:red", "aux_free": "tab:blue"}
  names = {"loss": "balance loss", "aux_free": "aux-loss-free"}
  styles = ["-", "--", ":", "-."]
  for setting in SETTINGS:
    recs = list(runs.get(setting, {}).values())
    if not recs:
      continue
    for j, layer in enumerate(recs[0]["curves"]):
      curves = [dict(r["curves"][layer]) for r in recs]
      xs = sorted(set.intersection(*(set(c) for c in curves)))
      axes[0].plot(xs, [statistics.fmean(c[s] for c in curves) for s in xs], styles[j % len(styles)], lw=1,
                   color=colors[setting], label=f"{names[setting]} {layer}")
    losses = [dict(r["loss_curve"]) for r in recs]
    xs = sorted(set.intersection(*(set(c) for c in losses)))
    axes[1].plot(xs, [statistics.fmean(c[s] for c in losses) for s in xs], color=colors[setting], lw=1,
                 label=names[setting])
    ys = [r["eval_mean_loss"] for r in recs]
    axes[2].scatter([names[setting]] * len(ys), ys, color=colors[setting])
    axes[2].hlines(statistics.fmean(ys), SETTINGS.index(setting) - 0.2, SETTINGS.index(setting) + 0.2,
                   color=colors[setting])
  axes[0].axhline(TARGET, color="gray", lw=0.7, ls="--", label=f"target {TARGET}")
  axes[0].axvspan(steps - window, steps, color="gray", alpha=0.1)
  axes[0].set(title="max / mean expert load per layer (mean over seeds)", xlabel="step", ylim=(0.9, 4.1))
  axes[0].legend(fontsize=6, ncol=2)
  axes[1].set(title="train loss (mean over seeds)", xlabel="step", ylim=(None, None))
  axes[1].legend(fontsize=7)
  axes[2].set(title="final held-out loss per seed (mean: bar)")
  fig.tight_layout()
  out = os.path.join(sweep_dir, "moe_balance.png")
  fig.savefig(out, dpi=110)
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  add_config_flags(ap, TAG, config_arg_example="layers=6")
  add_cache_flag(ap, shared="the seeds of a setting share every program")
  ap.add_argument("--settings", default=",".join(SETTINGS))
  ap.add_argument("--seeds", default="0,1,2")
  ap.add_argument("--bias_rate", type=float, default=0.003, help="aux_free: bias step per train step")
  ap.add_argument("--window", type=int, default=100, help="the last WINDOW steps are summarised")
  ap.add_argument("--report_only", action="store_true")
  ap.add_argument("--note", default="")
  a = ap.parse_args()
  settings = [s for s in a.settings.split(",") if s]
  unknown = sorted(set(settings) - set(SETTINGS))
  if unknown:
    raise SystemExit(f"--settings: unknown {unknown}; expected some of {SETTINGS}")
  seeds = [int(s) for s in a.seeds.split(",") if s]
  os.makedirs(a.sweep_dir, exist_ok=True)
  enable_compilation_cache(a.compilation_cache, a.sweep_dir)
  cfg = make_config(a, settings[0], seeds[0])
  steps = int(cfg.train.steps)
  if a.window > steps:
    raise SystemExit(f"--window={a.window} is longer than the run ({steps} steps)")
  t0 = time.time()
  if not a.report_only:
    todo = [(s, seed) for seed in seeds for s in settings]
    sweep.run_sweep(todo, a.sweep_dir, lambda s, seed, work: run_one(a, s, seed, work), tag=TAG)
  runs = sweep.load_finished(a.sweep_dir, settings, seeds, tag=TAG, steps=steps)
  if not runs:
    raise SystemExit(f"no finished runs in {a.sweep_dir}")
  m = cfg.model
  meta = {"device": sweep.device_description(a.sweep_dir, a.report_only), "steps": steps, "seeds": seeds,
          "settings": settings, "batch_size": int(cfg.train.batch_size), "seq_len": int(cfg.train.seq_len),
          "experts": int(m.num_local_experts), "top_k": int(m.num_experts_per_tok),
          "moe_layers": [i for i, t in enumerate(m.mlp_layer_types) if t == "sparse"], "bias_rate": a.bias_rate,
          "window": a.window, "note": a.note,
          "wall_s": sum(r["wall_s"] for by in runs.values() for r in by.values()),
          "command": "python -m experiments.moe_balance " + " ".join(
              f"--{k}={v}" for k, v in (("steps", a.steps), ("bias_rate", a.bias_rate), ("seeds", a.seeds),
                                        ("window", a.window)) if v)}
  agg = aggregate(runs)
  slim = {s: {seed: {k: v for k, v in r.items() if k not in ("curves", "loss_curve")} for seed, r in by.items()}
          for s, by in runs.items()}
  rounded = lambda curve: [(step, round(v, 4)) for step, v in curve]  # noqa: E731  (a plot's precision)
  curves = {s: {seed: {"load": {k: rounded(c) for k, c in r["curves"].items()}, "loss": rounded(r["loss_curve"])}
                for seed, r in by.items()} for s, by in runs.items()}
  sweep.write_json(os.path.join(a.sweep_dir, "results.json"),
                   {"meta": meta, "aggregate": agg, "runs": slim, "curves": curves})
  write_report(a.sweep_dir, runs, agg, meta)
  print(f"wrote {plot(a.sweep_dir, runs, a.window, steps)}, report.md, results.json in {a.sweep_dir} "
        f"({time.time() - t0:.0f}s)")
  for line in verdict(agg, a.window):
    print(line)


if __name__ == "__main__":
  main()
