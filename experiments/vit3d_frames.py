r"""The max_frames sweep of configs/vit3d_frames.py: held-out caption quality vs vision cost per ViT segment length.

  # GPU box (H200), the four settings one after another (~2-3 min each), then the report:
  python -m experiments.vit3d_frames --size=gpu --data_dir=data --sweep_dir=workdirs/vit3d_frames
  # one setting per command (each resumes or reuses a finished run), then only the report:
  python -m experiments.vit3d_frames --size=gpu --data_dir=data --sweep_dir=workdirs/vit3d_frames --settings=4
  python -m experiments.vit3d_frames --size=gpu --data_dir=data --sweep_dir=workdirs/vit3d_frames --report_only
  # then keep report.md, results.json and vit3d_frames.png (the workdirs hold checkpoints) in experiments/results/
  # data for a machine without network: prepare here, copy DATA_DIR without raw/ (~30 MB)
  python -m experiments.vit3d_frames --size=gpu --data_dir=data --prepare_only
  # CPU smoke (tests/test_vlm_train.py runs this at size=micro):
  python -m experiments.vit3d_frames --size=micro --settings=1,2 --data_dir=/tmp/d --sweep_dir=/tmp/vit3d

Each setting trains in its own workdir (SWEEP_DIR/mf{N}[_s{seed}]) and is evaluated on held-out synthetic clips
(sprites from the held-out split). Per setting the report gives:

* quality: caption loss and token accuracy (teacher-forced argmax) over the held-out captions, and the accuracy
  on the caption tokens that need temporal information: the direction words (`direction`, 4-way) and the object
  names, whose order is the order of appearance (`object`); the standard error is binomial over those tokens
  (or across seeds when several are run);
* cost: vision-tower + projector forward FLOPs per clip in closed form (m3_jax.models.multimodal.vision_flops:
  the attention part grows linearly with max_frames), the measured time of one compiled train step and of the
  tower's forward on one batch (median of --time_steps, inputs already on the device), and the wall time per
  training step from the run's log (which includes the host input pipeline).

Writes SWEEP_DIR/results.json, SWEEP_DIR/report.md and SWEEP_DIR/vit3d_frames.png. The motion is synthetic (real
images moved along straight lines by code); the verdict in report.md is computed from the numbers, not assumed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import jax

from experiments.lib import metrics, sweep, timing, training
from experiments.lib.config import add_cache_flag, add_config_flags, config_arg, enable_compilation_cache, load_config

SOURCE = "synthetic_video"
QUALITY = ("loss", "accuracy", "direction_accuracy", "object_accuracy", "direction_loss", "object_loss")


def make_config(size: str, max_frames: int, seed: int, steps: int, data_dir: str, overrides: list[str],
                extra_arg: str = ""):
  """configs/vit3d_frames.py at one max_frames setting and seed, with the driver's flags applied."""
  arg = config_arg(f"max_frames={max_frames},size={size},seed={seed}", f"steps={steps}" if steps else "", extra_arg)
  return load_config("vit3d_frames", arg, data_dir=data_dir, overrides=overrides)


def direction_curve(workdir: str) -> list[tuple[int, float]]:
  """(step, held-out direction accuracy) at every evaluation of the run."""
  return metrics.by_step(metrics.read(workdir), f"eval/{SOURCE}/direction_accuracy")


def steps_to(curve: list[tuple[int, float]], level: float) -> int | None:
  """First evaluated step whose direction accuracy reaches `level` (None: never)."""
  return next((s for s, acc in curve if acc >= level), None)


def train_wall_ms(workdir: str, config) -> float | None:
  """Median wall time per step over the logged intervals after the first (data pipeline included)."""
  rows = [r for r in metrics.read(workdir) if r.get("tokens_per_sec")]
  rows = rows[1:] if len(rows) > 1 else rows
  if not rows:
    return None
  tokens = float(config.train.batch_size) * float(config.train.seq_len)
  return 1e3 * statistics.median(tokens / r["tokens_per_sec"] for r in rows)


def measure(config, workdir: str, n: int) -> dict:
  """Compiled train-step and tower-forward times on one real batch, from the trained state of `workdir` (the
  step is built as the trainer builds it, so the compilation cache serves it); median of n timed calls after one
  warm-up call."""
  run = training.restored_train_step(config, workdir)
  step, batch = run["step"], run["batch"]
  tower = training.tower_forward(run["graphdef"])
  with jax.set_mesh(run["mesh"]):
    holder = {"state": run["state"]}

    def one_step():
      holder["state"], m = step(holder["state"], batch)
      return m

    step_ms = 1e3 * timing.timeit(one_step, warmup=1, repeat=n)
    s = holder["state"]
    tower_ms = 1e3 * timing.timeit(lambda: tower(s.params, s.rest, batch["videos"]), warmup=1, repeat=n)
  return {"step_ms": step_ms, "tower_fwd_ms": tower_ms, "clips_per_batch": int(batch["videos"].shape[0] *
                                                                               batch["videos"].shape[1])}


def vision_cost(config) -> dict:
  cfg = training.model_config(config)
  d, v = config.data.mm, cfg.vision
  f, h, w = int(d.num_frames), int(d.height), int(d.width)
  total = training.vision_flops(cfg, f, h, w)
  t = f // v.temporal_patch_size
  mf = min(v.max_frames, t)
  return {"vision_gflops_per_clip": total / 1e9, "attention_share": _attention_flops(cfg, f, h, w, mf) / total,
          "temporal_patches": t, "segment_patches": mf * (h // v.patch_size) * (w // v.patch_size),
          "visual_tokens_per_clip": v.num_visual_tokens(f, h, w)}


def _attention_flops(cfg, f, h, w, max_frames) -> float:
  v = cfg.vision
  t, gh, gw = f // v.temporal_patch_size, h // v.patch_size, w // v.patch_size
  mf = min(max_frames, t)
  n_seg = -(-t // mf)
  return v.num_hidden_layers * 4.0 * n_seg * (mf * gh * gw) ** 2 * v.hidden_size


def aggregate(runs: list[dict]) -> dict:
  """Mean over seeds; standard error across seeds when there are several, else binomial over the tokens."""
  out = {"seeds": [r["seed"] for r in runs]}
  for key in QUALITY:
    vals = [r["eval"][key] for r in runs if key in r["eval"]]
    if not vals:
      continue
    out[key] = statistics.fmean(vals)
    if len(vals) > 1:
      out[key + "_se"] = statistics.stdev(vals) / math.sqrt(len(vals))
    elif key.endswith("accuracy"):
      tok = runs[0]["eval"].get(key.replace("accuracy", "tokens"), 0.0)
      p = out[key]
      out[key + "_se"] = math.sqrt(max(p * (1 - p), 1e-12) / tok) if tok else None
  for key in ("step_ms", "tower_fwd_ms", "train_wall_ms"):
    vals = [r[key] for r in runs if r.get(key) is not None]
    out[key] = statistics.median(vals) if vals else None
  out["direction_curves"] = [r["curve"] for r in runs]
  reached = [steps_to(r["curve"], 0.5) for r in runs]
  # median over seeds of the first step at 50% direction accuracy (twice the 4-way guess); None if a seed never did
  out["steps_to_half_direction"] = None if None in reached else statistics.median(reached)
  out.update(runs[0]["cost"])
  return out


def verdict(table: dict[int, dict]) -> list[str]:
  """Which max_frames is the best trade-off here, from the numbers: the cheapest setting whose direction and
  object accuracy are both within one standard error (of the difference) of the best setting's; no verdict when
  no setting learned the directions or the settings cannot be told apart."""
  settings = sorted(table)
  if not all("direction_accuracy" in table[s] for s in settings):
    return ["- no direction/object accuracy (the held-out set exposes no temporal masks): no verdict"]
  lines, best = [], {}
  for key in ("direction_accuracy", "object_accuracy"):
    best[key] = max(settings, key=lambda s: table[s][key])
    lines.append(f"- best {key.replace('_', ' ')}: max_frames={best[key]} ({table[best[key]][key]:.3f})")
  # A model that knows a direction word comes but not which one scores ln 4 nats on it (accuracy ~1/4).
  best_dir_loss = min(table[s].get("direction_loss", math.inf) for s in settings)
  if best_dir_loss > math.log(4) - 0.1:
    return lines + [f"- NO setting learned the directions (best direction loss {best_dir_loss:.3f} nats; a 4-way "
                    f"guess scores ln 4 = {math.log(4):.3f}): no verdict; train longer or larger"]
  reached = {s: table[s].get("steps_to_half_direction") for s in settings}
  lines.append("- steps to 50% held-out direction accuracy (sample efficiency): " + ", ".join(
      f"max_frames={s}: {'never' if v is None else v}" for s, v in reached.items()))
  spread = max(table[s]["direction_accuracy"] for s in settings) - min(table[s]["direction_accuracy"]
                                                                      for s in settings)
  two_se = 2 * max(table[s].get("direction_accuracy_se") or 0.0 for s in settings)
  if spread <= two_se:
    lines.append(f"- the direction accuracy spread across settings ({spread:.3f}) is within 2 standard errors "
                 f"({two_se:.3f}): the settings are not told apart, so the cheapest is the trade-off")

  def close(s, key):
    b = best[key]
    se = math.hypot(table[s].get(key + "_se") or 0.0, table[b].get(key + "_se") or 0.0)
    return table[b][key] - table[s][key] <= se

  ok = [s for s in settings if close(s, "direction_accuracy") and close(s, "object_accuracy")]
  cheapest = min(ok, key=lambda s: table[s]["vision_gflops_per_clip"])
  lines.append(f"- cheapest setting within one standard error of the best on both: max_frames={cheapest} "
               f"({table[cheapest]['vision_gflops_per_clip']:.3f} vision GFLOPs per clip)")
  if 4 in table:
    lines.append("- so 4 frames per segment IS the best trade-off in this run" if cheapest == 4 else
                 f"- so 4 frames per segment is NOT the best trade-off in this run (max_frames={cheapest} is)")
  return lines


def write_report(sweep_dir: str, size: str, table: dict[int, dict], meta: dict) -> tuple[str, str, str]:
  os.makedirs(sweep_dir, exist_ok=True)
  js = os.path.join(sweep_dir, "results.json")
  sweep.write_json(js, {"meta": meta, "settings": {str(k): v for k, v in sorted(table.items())}}, indent=2)

  def fmt(x, nd=3):
    return "-" if x is None else f"{x:.{nd}f}"

  def pm(row, key):
    se = row.get(key + "_se")
    return fmt(row.get(key)) + ("" if se is None else f" ± {se:.3f}")

  lines = [
      f"# ViT segment length (max_frames) sweep, size `{size}`", "",
      f"Task: captions of synthetic-motion clips ({meta['frames']} frames of {meta['height']}x{meta['width']}, "
      f"{meta['temporal_patches']} temporal patches; real images moved along straight lines by code, 1-3 objects "
      "appearing one after another). Held-out clips use held-out sprites. Direction words are a 4-way choice "
      "(chance 0.25 given the slot); object names carry the order of appearance.", "",
      f"Trained {meta['steps']} steps, batch {meta['batch_size']} x {meta['seq_len']} tokens, seeds {meta['seeds']}; "
      f"device: {meta['device']}." + (f" {meta['note']}" if meta.get("note") else ""), "",
      "| max_frames | segment patches | vision GFLOPs/clip | attention share | step ms | tower fwd ms | "
      "train wall ms/step | caption loss | token acc | direction acc | object (order) acc | steps to 50% dir. |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for s in sorted(table):
    r = table[s]
    lines.append(f"| {s} | {r['segment_patches']} | {r['vision_gflops_per_clip']:.4f} | "
                 f"{r['attention_share']:.3f} | {fmt(r['step_ms'], 2)} | {fmt(r['tower_fwd_ms'], 2)} | "
                 f"{fmt(r['train_wall_ms'], 1)} | {fmt(r['loss'])} | {fmt(r['accuracy'])} | "
                 f"{pm(r, 'direction_accuracy')} | {pm(r, 'object_accuracy')} | "
                 f"{r['steps_to_half_direction'] if r['steps_to_half_direction'] is not None else 'never'} |")
  lines += ["", "## Verdict (computed from the table)", "", *verdict(table), "",
            f"Workdirs: {', '.join(meta['workdirs'])}. Numbers: `results.json`; plot: `vit3d_frames.png`.", ""]
  md = os.path.join(sweep_dir, "report.md")
  with open(md, "w") as f:
    f.write("\n".join(lines))
  return js, md, plot(sweep_dir, table)


def plot(sweep_dir: str, table: dict[int, dict]) -> str:
  import matplotlib  # noqa: PLC0415
  import matplotlib.ticker  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  xs = sorted(table)
  fig, axes = plt.subplots(1, 4, figsize=(17, 3.6))
  ax = axes[0]
  for key, label in (("direction_accuracy", "direction words"), ("object_accuracy", "object names (order)"),
                     ("accuracy", "all caption tokens")):
    ys = [table[x].get(key) for x in xs]
    err = [table[x].get(key + "_se") or 0.0 for x in xs]
    if any(y is not None for y in ys):
      ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=label)
  ax.axhline(0.25, color="grey", ls=":", lw=1, label="4-way guess (directions)")
  ax.set(title="held-out accuracy", xlabel="max_frames (temporal patches per segment)")
  ax.legend(fontsize=8)
  ax = axes[1]
  ax.plot(xs, [table[x]["loss"] for x in xs], marker="o")
  ax.set(title="held-out caption loss (nats/token)", xlabel="max_frames")
  ax = axes[2]
  ax.plot(xs, [table[x]["vision_gflops_per_clip"] for x in xs], marker="o", color="C3", label="vision GFLOPs/clip")
  ax.set(title="cost", xlabel="max_frames", ylabel="GFLOPs per clip")
  ax2 = ax.twinx()
  for key, style in (("step_ms", "s-"), ("tower_fwd_ms", "^-")):
    ys = [table[x].get(key) for x in xs]
    if all(y is not None for y in ys):
      ax2.plot(xs, ys, style, color="C4" if key == "step_ms" else "C5", label=key)
  ax2.set_ylabel("ms")
  h1, l1 = ax.get_legend_handles_labels()
  h2, l2 = ax2.get_legend_handles_labels()
  ax.legend(h1 + h2, l1 + l2, fontsize=8)
  for a in axes[:3]:
    a.set_xscale("log", base=2)
    a.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    a.set_xticks(xs)
    a.set_xticklabels([str(x) for x in xs])
  ax = axes[3]
  for i, x in enumerate(xs):
    for j, curve in enumerate(table[x].get("direction_curves", [])):
      if curve:
        ax.plot(*zip(*curve), marker=".", color=f"C{i}", label=f"max_frames={x}" if j == 0 else None)
  ax.axhline(0.25, color="grey", ls=":", lw=1)
  ax.set(title="held-out direction accuracy during training", xlabel="step")
  ax.legend(fontsize=8)
  fig.tight_layout()
  out = os.path.join(sweep_dir, "vit3d_frames.png")
  fig.savefig(out, dpi=120)
  plt.close(fig)
  return out


def parse_args(argv=None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--size", default="cpu", help="micro | cpu | gpu (configs/vit3d_frames.py SIZES)")
  ap.add_argument("--settings", default="1,2,4,8", help="max_frames values")
  ap.add_argument("--seeds", default="0", help="comma-separated training seeds per setting")
  add_config_flags(ap, "vit3d_frames", config_arg_example="attn=cudnn,lr=3e-4")
  ap.add_argument("--time_steps", type=int, default=10, help="timed calls per setting (0: skip timing)")
  ap.add_argument("--report_only", action="store_true", help="only read finished workdirs and write the report")
  ap.add_argument("--prepare_only", action="store_true",
                  help="only prepare DATA_DIR (text corpus + the sprite sources), e.g. here before copying it (without "
                       "its raw/ downloads) to a machine without network")
  ap.add_argument("--note", default="", help="a sentence for the report on how the runs were made (e.g. concurrency)")
  add_cache_flag(ap, shared="the settings share the init and eval programs, and timing reuses each training step's")
  return ap.parse_args(argv)


def run_setting(a: argparse.Namespace, mf: int, seeds: list[int], sweep_dir: str, timings: dict) -> tuple[list, list]:
  """Trains (unless --report_only) and reads every seed of max_frames=mf, then times its step (the last seed's run)
  into `timings`. Returns (per-seed results, their workdirs relative to sweep_dir)."""
  results, workdirs = [], []
  for seed in seeds:
    config = make_config(a.size, mf, seed, a.steps, a.data_dir, a.override, a.config_arg)
    work = sweep.workdir(sweep_dir, f"mf{mf}", seed if len(seeds) > 1 else None)
    workdirs.append(os.path.relpath(work, sweep_dir))
    if not a.report_only:
      t0 = time.time()
      training.train(config, work)
      print(f"[vit3d_frames] max_frames={mf} seed={seed}: trained in {time.time() - t0:.0f}s -> {work}", flush=True)
    results.append({"seed": seed, "eval": metrics.last_eval(work, SOURCE), "cost": vision_cost(config),
                    "train_wall_ms": train_wall_ms(work, config), "curve": direction_curve(work)})
  if not a.report_only and a.time_steps > 0:
    timings[str(mf)] = measure(config, work, a.time_steps)
    os.makedirs(sweep_dir, exist_ok=True)
    sweep.write_json(os.path.join(sweep_dir, "timing.json"), timings, indent=2)
  for r in results:
    r.update(timings.get(str(mf), {}))
  return results, workdirs


def main(argv=None):
  a = parse_args(argv)
  settings = [int(s) for s in a.settings.split(",") if s.strip()]
  seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
  if a.prepare_only:
    training.prepare_data(make_config(a.size, settings[0], seeds[0], a.steps, a.data_dir, a.override, a.config_arg))
    return None
  sweep_dir = os.path.abspath(a.sweep_dir)
  enable_compilation_cache(a.compilation_cache, sweep_dir)
  timing_path = os.path.join(sweep_dir, "timing.json")
  timings = json.load(open(timing_path)) if os.path.exists(timing_path) else {}
  runs, workdirs = {}, []
  for mf in settings:
    runs[mf], dirs = run_setting(a, mf, seeds, sweep_dir, timings)
    workdirs += dirs
  table = {mf: aggregate(rs) for mf, rs in runs.items()}
  config = make_config(a.size, settings[-1], seeds[-1], a.steps, a.data_dir, a.override, a.config_arg)
  d = config.data.mm
  meta = {"size": a.size, "steps": int(config.train.steps), "batch_size": int(config.train.batch_size),
          "seq_len": int(config.train.seq_len), "frames": int(d.num_frames), "height": int(d.height),
          "width": int(d.width), "temporal_patches": table[settings[0]]["temporal_patches"], "seeds": seeds,
          "device": sweep.device_description(sweep_dir, a.report_only), "workdirs": workdirs,
          "config_arg": a.config_arg, "overrides": a.override, "note": a.note}
  js, md, png = write_report(sweep_dir, a.size, table, meta)
  print(open(md).read())
  print(f"[vit3d_frames] wrote {js}, {md}, {png}")
  return table


if __name__ == "__main__":
  main()
