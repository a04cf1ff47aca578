r"""Native vs continued-pretraining (CPT) multimodal training (configs/native_vs_cpt.py): arms x seeds, then a report.

  # what `make run` runs (2-core CPU, one seed, the five arm settings, ~10 min):
  python experiments/native_vs_cpt.py --size=cpu --data_dir=data --sweep_dir=workdirs/native_vs_cpt
  # GPU box (H200), 5 arm settings x 3 seeds, resumable: split over commands by seed, then only the report
  python experiments/native_vs_cpt.py --size=gpu --data_dir=data --sweep_dir=workdirs/nvc_gpu --seeds=0,1
  python experiments/native_vs_cpt.py --size=gpu --data_dir=data --sweep_dir=workdirs/nvc_gpu --seeds=2
  # the LR control of cpt_predecay_lr0.3 (same LR change, no vision), one process per (arm, seed) fits one H200
  python experiments/native_vs_cpt.py --size=gpu --data_dir=data --sweep_dir=workdirs/nvc_gpu --seeds=0 \
      --arms=text_only_lr0.3
  python experiments/native_vs_cpt.py --size=gpu --data_dir=data --sweep_dir=workdirs/nvc_gpu --seeds=0,1,2 \
      --arms=text_only,native,cpt_decay,cpt_predecay_lr1.0,cpt_predecay_lr0.3,text_only_lr0.3 --report_only
  # data for a machine without network: prepare here (text + vision), copy DATA_DIR without raw/
  python experiments/native_vs_cpt.py --size=gpu --data_dir=data --prepare_only

Arm settings (`--arms`): text_only, native, cpt_decay, cpt_predecay_lr{S} (vision half-way through the stable phase,
LR x S from then on; default S = 1.0 and 0.3) and, optionally, text_only_lr{S} (the same LR change without vision:
separates the LR effect from the vision effect of cpt_predecay_lr{S}). Every (arm setting, seed) trains in its own
workdir SWEEP_DIR/{setting}_s{seed}; a finished one (its analysis.json) is reused, an interrupted one resumes.

After each run the driver evaluates, from the final checkpoint, the text->visual attention mass per layer over
held-out image- and video-caption batches (for each text token that can see visual tokens, the attention probability
on them; mean over heads and those queries, `m3_jax.models.multimodal.text_to_visual_mass`), and the attention
maps of a few held-out examples (caption tokens -> each visual token, per layer). SWEEP_DIR/results.json is
rewritten after every finished run; at the end come report.md and the plots text_loss.png, text_delta.png,
caption_loss.png, attention_mass.png and attention_maps.png. The verdict in report.md is computed from the numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

DEFAULT_ARMS = ("text_only", "native", "cpt_decay", "cpt_predecay_lr1.0", "cpt_predecay_lr0.3")
DEFAULT_SEEDS = {"micro": "0", "cpu": "0", "gpu": "0,1,2"}
REFERENCE = "text_only"
# held-out batches per modality for the attention mass (each holds many examples)
ATTENTION_BATCHES = 2


# ============================================================================================ arms and configs ==

def parse_setting(name: str) -> tuple[str, float]:
  """"cpt_predecay_lr0.3" -> ("cpt_predecay", 0.3); "native" -> ("native", 1.0)."""
  from configs import native_vs_cpt  # noqa: PLC0415
  m = re.fullmatch(r"(cpt_predecay|text_only)_lr([0-9.]+)", name)
  arm, scale = (m.group(1), float(m.group(2))) if m else (name, 1.0)
  if arm not in native_vs_cpt.ARMS:
    raise SystemExit(f"--arms: {name!r} is not an arm setting; expected text_only, native, cpt_decay, "
                     "cpt_predecay_lr{S} or text_only_lr{S}")
  if arm == "cpt_predecay" and not m:
    raise SystemExit(f"--arms: {name!r} needs its LR scale, e.g. cpt_predecay_lr1.0")
  return arm, scale


def make_config(size: str, setting: str, seed: int, steps: int, data_dir: str, overrides: list[str],
                config_arg: str = ""):
  from configs import native_vs_cpt  # noqa: PLC0415
  arm, scale = parse_setting(setting)
  arg = f"arm={arm},lr_scale={scale},size={size},seed={seed}" + (f",steps={steps}" if steps else "")
  arg += f",{config_arg}" if config_arg else ""
  c = native_vs_cpt.get_config(arg)
  c.data.dir = data_dir
  for item in overrides:
    key, eq, value = item.partition("=")
    if not eq:
      raise SystemExit(f"--override {item!r}: expected KEY=VALUE, e.g. train.steps=100")
    node = c
    *path, last = key.split(".")
    for p in path:
      node = node[p]
    old = node[last]
    node[last] = type(old)(value) if not isinstance(old, bool) else value.lower() in ("1", "true", "yes")
  return c


def setting_summary(config) -> dict:
  from m3_jax.train import config_lib  # noqa: PLC0415
  from m3_jax.train.optimizer import wsd_decay_start  # noqa: PLC0415
  o = config_lib.optim_config(config)
  d = config.data.mm
  return {"steps": int(config.train.steps), "warmup": o.warmup_steps, "decay_start": wsd_decay_start(o),
          "vision_rows": int(d.vision_rows), "vision_start_step": int(d.vision_start_step) if d.vision_rows else None,
          "lr_scale": o.lr_scale, "lr_scale_from": o.lr_scale_from if o.lr_scale != 1.0 else None}


# ================================================================================================== analysis ==

def source_kinds(config) -> dict[str, list[str]]:
  """Held-out sets by kind: text sources, image-caption sources, synthetic video, real clips."""
  from m3_jax.data import pipeline, vision  # noqa: PLC0415
  from m3_jax.data.vision_pipeline import EVAL_ONLY_SOURCES, SYNTHETIC_VIDEO  # noqa: PLC0415
  from m3_jax.train import trainer  # noqa: PLC0415
  evaluated = trainer.vl_eval_sources(config)
  images = vision.load_vision_manifest(config.data.dir).image_sources
  return {"text": pipeline.list_sources(config.data.dir),
          "image": [s for s in evaluated if s in images],
          "video": [s for s in evaluated if s == SYNTHETIC_VIDEO],
          "real": [s for s in evaluated if s in EVAL_ONLY_SOURCES]}


def read_evals(workdir: str) -> list[dict]:
  """[{"step", "loss": {source: x}, "tokens": {source: n}}] for every evaluation of the run, by step."""
  from m3_jax.train.metrics import read_metrics  # noqa: PLC0415
  out = {}
  for r in read_metrics(workdir):
    if "eval/mean_loss" not in r:
      continue
    e = out.setdefault(r["step"], {"step": r["step"], "loss": {}, "tokens": {}})
    for k, v in r.items():
      parts = k.split("/")
      if len(parts) == 3 and parts[0] == "eval" and parts[2] in ("loss", "tokens"):
        e[parts[2]][parts[1]] = v
  return [out[s] for s in sorted(out)]


def read_text_stream(workdir: str) -> list[list]:
  """[[step, text tokens, text hash]] at every logged train step."""
  from m3_jax.train.metrics import read_metrics  # noqa: PLC0415
  out = {r["step"]: [r["step"], r["data/text_tokens"], r["data/text_hash"]] for r in read_metrics(workdir)
         if "data/text_hash" in r}
  return [out[s] for s in sorted(out)]


def reduce_mass(masses, counts) -> list[float]:
  """Per-batch text->visual attention mass [n_batches, layers, heads] (each the mean over that batch's text queries
  that see visual tokens) and their query counts [n_batches] -> mass per layer: the mean over all those queries of
  all batches (batches weighted by their query counts), then over heads. Batches without such queries add nothing."""
  import numpy as np  # noqa: PLC0415
  m = np.asarray(masses, np.float64)
  c = np.asarray(counts, np.float64)
  if m.ndim != 3 or c.shape != m.shape[:1]:
    raise ValueError(f"reduce_mass: masses {m.shape} must be [n_batches, layers, heads] and counts {c.shape} "
                     f"[n_batches]")
  if c.sum() <= 0:
    raise ValueError("reduce_mass: no text query sees a visual token in any batch")
  per_head = np.einsum("blh,b->lh", m, c) / c.sum()  # [layers, heads]
  return per_head.mean(axis=1).tolist()


def uniform_mass(inputs, segment_ids):
  """The text->visual mass [1] of attention spread evenly over each query's visible tokens (causal, same segment):
  the share of visual tokens in what each text query sees, the reference for the learned masses."""
  import numpy as np  # noqa: PLC0415

  from m3_jax.data.vision_pipeline import IMAGE, VIDEO  # noqa: PLC0415
  from m3_jax.models.multimodal import text_to_visual_mass  # noqa: PLC0415
  ids, seg = np.asarray(inputs), np.asarray(segment_ids)
  t = ids.shape[1]
  visible = np.tril(np.ones((t, t), bool))[None] & (seg[:, :, None] == seg[:, None, :])  # [B, T, S]
  probs = visible / visible.sum(-1, keepdims=True)
  mass, _ = text_to_visual_mass(probs[:, None].astype(np.float32), np.isin(ids, (IMAGE, VIDEO)), seg)
  return mass


def example_map(probs, inputs, segment_ids, row: int) -> dict | None:
  """The first visual span of `row` (its first segment holding one): its caption's attention over its visual tokens.

  probs: [layers, B, T, T] head-mean attention of a batch. Queries are the segment's tokens after the span's end
  marker (the caption and <|endoftext|>); returns {"kind", "layers": [layers][n_visual] mean over those queries,
  "mass": [layers] their total on the span} or None when the row has no visual span followed by text."""
  import numpy as np  # noqa: PLC0415
  from m3_jax.data.vision_pipeline import IMAGE, VIDEO  # noqa: PLC0415
  ids, seg = np.asarray(inputs[row]), np.asarray(segment_ids[row])
  for s in np.unique(seg[seg > 0]):
    idx = np.flatnonzero(seg == s)
    vis = idx[np.isin(ids[idx], (IMAGE, VIDEO))]
    if not vis.size:
      continue
    queries = idx[idx > vis[-1] + 1]  # after the end marker
    if not queries.size:
      continue
    p = np.asarray(probs[:, row], np.float64)[:, queries][:, :, vis]  # [layers, Q, n_visual]
    per_key = p.mean(axis=1)  # [layers, n_visual]
    return {"kind": "image" if ids[vis[0]] == IMAGE else "video", "layers": per_key.tolist(),
            "mass": per_key.sum(axis=1).tolist()}
  return None


def analyse_attention(config, workdir: str, sources: dict[str, list[str]], examples_path: str | None) -> dict:
  """Text->visual attention mass per layer (image and video batches) and attention maps of a few examples, from
  the final checkpoint of `workdir`. Writes the examples' pixels to `examples_path` (the same for every run)."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from m3_jax.core import sharding
  from m3_jax.train import trainer  # noqa: PLC0415
  from m3_jax.train.steps import forward  # noqa: PLC0415
  mesh = sharding.make_mesh(dict(config.mesh))
  _, graphdef, params, rest, _ = trainer.load_params(config, workdir, mesh)
  keys = trainer.BATCH_KEYS + ("images", "image_valid", "videos", "video_valid")

  @jax.jit
  def capture(params, rest, batch):
    _, aux = forward(graphdef, params, rest, batch, capture_attention=True)
    probs = jnp.stack([p.mean(axis=1) for p in aux["attention_probs"]])  # [layers, B, T, T]: mean over heads
    return aux["text_to_visual_attention"], aux["text_to_visual_queries"], probs[:, :1]

  out: dict = {"attention": {}, "maps": []}
  pictures = []
  with jax.set_mesh(mesh):
    for kind in ("image", "video"):
      masses, counts, uniform = [], [], []
      names = sources[kind] + (sources["real"] if kind == "video" else [])
      for name in names:
        batches = trainer.vl_eval_batches(config, name)[:ATTENTION_BATCHES]
        for i, b in enumerate(batches):
          host = {k: b[k] for k in keys if k in b}
          mass, n, probs = jax.device_get(capture(params, rest, trainer.to_global(host, mesh)))
          masses.append(mass)
          counts.append(float(n))
          uniform.append(np.asarray(uniform_mass(host["inputs"], host["segment_ids"]))[None])  # [1 layer, 1 head]
          # maps: the first example of the first batch of the first two image sources and of synthetic video
          want_map = i == 0 and name in (sources["image"][:2] + sources["video"][:1])
          if want_map:
            m = example_map(probs, host["inputs"], host["segment_ids"], 0)
            if m is not None:
              m["source"] = name
              out["maps"].append(m)
              pictures.append(_example_pixels(host, m["kind"]))
      if counts and sum(counts) > 0:
        out["attention"][kind] = {"layers": reduce_mass(masses, counts), "queries": sum(counts),
                                  "uniform": reduce_mass(uniform, counts)[0], "sources": names}
  if examples_path and pictures:
    with open(examples_path, "w") as f:
      json.dump([{"source": m["source"], "kind": m["kind"], "frames": p} for m, p in zip(out["maps"], pictures)], f)
  return out


def _example_pixels(batch: dict, kind: str) -> list:
  """uint8 frames of row 0's first item: [1, H, W, 3] for an image, one frame per temporal patch for a video."""
  import numpy as np  # noqa: PLC0415
  x = batch["images"][0, 0, :1] if kind == "image" else batch["videos"][0, 0, ::2]
  return np.clip(np.round((np.asarray(x) + 1.0) * 127.5), 0, 255).astype(np.uint8).tolist()


def run_analysis(config, workdir: str, setting: str, seed: int, wall_s: float, examples_path: str | None) -> dict:
  sources = source_kinds(config)
  out = {"arm": setting, "seed": seed, "wall_s": wall_s, "setting": setting_summary(config), "sources": sources,
         "evals": read_evals(workdir), "text_stream": read_text_stream(workdir)}
  out.update(analyse_attention(config, workdir, sources, examples_path))
  return out


# ================================================================================================ aggregation ==

def weighted(e: dict, names: list[str]) -> float | None:
  """Token-weighted mean held-out loss over `names` of one evaluation (None if none was evaluated)."""
  names = [n for n in names if n in e["loss"] and e["tokens"].get(n)]
  if not names:
    return None
  return sum(e["loss"][n] * e["tokens"][n] for n in names) / sum(e["tokens"][n] for n in names)


def text_mean(e: dict, text_sources: list[str]) -> float:
  """The text-capability measure: the mean over text sources (each source counts once) of held-out loss."""
  return statistics.fmean(e["loss"][s] for s in text_sources)


def summarise(run: dict) -> dict:
  """One run's numbers for the report: final text losses, caption losses, curves, attention per layer."""
  src = run["sources"]
  final = run["evals"][-1]
  curve = [(e["step"], text_mean(e, src["text"])) for e in run["evals"]]
  att = run.get("attention", {})
  layer_means = [statistics.fmean(v["layers"]) for v in att.values()]
  return {
      "text": text_mean(final, src["text"]),
      "per_source": {s: final["loss"][s] for s in src["text"]},
      "image": weighted(final, src["image"]), "video": weighted(final, src["video"]),
      "real": weighted(final, src["real"]),
      "curve": curve,
      "source_curves": {s: [(e["step"], e["loss"][s]) for e in run["evals"]] for s in src["text"]},
      "caption_curves": {k: [(e["step"], weighted(e, src[k])) for e in run["evals"]] for k in ("image", "video")},
      "mass": {k: v["layers"] for k, v in att.items()},
      "uniform": {k: v.get("uniform") for k, v in att.items()},
      "mass_mean": statistics.fmean(layer_means) if layer_means else None,
  }


def noise_floor(runs: dict[str, dict[int, dict]]) -> float | None:
  """Largest |text loss - text_only's| of a vision arm at an evaluation after step 0 and before its vision starts.
  Up to then the arm is text_only (its extra rows are padding: no loss, no gradient) except for the float rounding of
  a larger batch, which training amplifies: a difference of this size is noise even with many seeds."""
  ref = runs.get(REFERENCE, {})
  out = []
  for arm, per in runs.items():
    for seed, r in per.items():
      start = r["setting"]["vision_start_step"]
      if arm == REFERENCE or start is None or seed not in ref or r["setting"]["lr_scale_from"] is not None \
          and r["setting"]["lr_scale_from"] < start:
        continue
      mine = {e["step"]: text_mean(e, r["sources"]["text"]) for e in r["evals"]}
      for e in ref[seed]["evals"]:
        if 0 < e["step"] < start and e["step"] in mine:
          out.append(abs(mine[e["step"]] - text_mean(e, r["sources"]["text"])))
  return max(out) if out else None


def text_stream_check(runs: dict[str, dict[int, dict]]) -> tuple[bool, list[str]]:
  """Per seed: do all arms log the same (step, text tokens, text hash) sequence as the reference? Returns
  (all equal, report lines)."""
  lines, ok = [], True
  seeds = sorted({s for per in runs.values() for s in per})
  for seed in seeds:
    have = {arm: per[seed]["text_stream"] for arm, per in runs.items() if seed in per}
    ref_arm = REFERENCE if REFERENCE in have else sorted(have)[0]
    ref = have[ref_arm]
    same = [a for a, v in have.items() if v == ref]
    differ = [a for a, v in have.items() if v != ref]
    last = ref[-1] if ref else [None, None, None]
    if not ref:
      ok = False
      lines.append(f"- seed {seed}: no text-stream record (data/text_hash) in the metrics: NOT checked")
    elif differ:
      ok = False
      lines.append(f"- seed {seed}: the text stream DIFFERS from {ref_arm}'s in {', '.join(differ)} "
                   f"(same in {', '.join(same)})")
    else:
      lines.append(f"- seed {seed}: identical in all {len(same)} arm settings at all {len(ref)} logged steps: "
                   f"{last[1]:,} text target tokens, hash {last[2]} at step {last[0]}")
  return ok, lines


# ================================================================================================== statistics ==

def paired(a: dict[int, float], b: dict[int, float]) -> dict:
  """a - b over the seeds both have: mean, sample std, standard error, t = mean / se, the per-seed values."""
  seeds = sorted(set(a) & set(b))
  d = [a[s] - b[s] for s in seeds]
  n = len(d)
  mean = statistics.fmean(d) if d else float("nan")
  std = statistics.stdev(d) if n > 1 else None
  se = std / math.sqrt(n) if std is not None else None
  if se is None:
    t = None
  elif se > 0:
    t = mean / se
  else:
    t = math.copysign(math.inf, mean) if mean else 0.0
  return {"mean": mean, "std": std, "se": se, "t": t, "n": n, "per_seed": dict(zip(seeds, d))}


def strength(p: dict) -> str:
  """How far a paired difference stands out of the seed noise: 'clear' (|t| >= 3, every seed the same sign),
  'moderate' (|t| >= 2), 'within noise', or 'one seed' (no noise estimate)."""
  if p["n"] < 2 or p["t"] is None:
    return "one seed"
  same_sign = all(v > 0 for v in p["per_seed"].values()) or all(v < 0 for v in p["per_seed"].values())
  if abs(p["t"]) >= 3 and same_sign:
    return "clear"
  if abs(p["t"]) >= 2:
    return "moderate"
  return "within noise"


def _fmt_p(p: dict, unit: str = "nats") -> str:
  s = f"{p['mean']:+.4f} {unit}"
  if p["std"] is not None:
    s += f" (std {p['std']:.4f} over {p['n']} seeds, t = {p['t']:+.1f})"
  else:
    s += " (one seed)"
  return s


def verdict(table: dict) -> list[str]:
  """The seed claims, judged from the numbers. table: {"text_loss": {setting: {seed: final mean text loss}},
  "mass": {setting: {seed: mean text->visual attention mass}}, "seed_spread": std over seeds of the reference's
  text loss or None}. A claim 'REPRODUCES' when the paired (same-seed) difference has the claimed sign and stands out
  of the seed noise (|t| >= 2); with one seed there is no noise estimate and only the direction is reported."""
  text, mass = table["text_loss"], table.get("mass", {})
  spread, floor = table.get("seed_spread"), table.get("noise_floor")
  lines = []
  if REFERENCE not in text:
    return ["- no text_only run: no verdict (every claim is a difference to text_only)"]
  n_seeds = len(text[REFERENCE])
  if n_seeds < 2:
    lines.append("- ONE SEED: the seed noise cannot be estimated, so no difference below can be called real; the "
                 "signs are reported as observations only (the GPU sweep runs 3 seeds)")

  def vs_spread(p):
    out = ""
    if spread:
      out += f"; |delta| = {abs(p['mean']) / spread:.1f} x the seed-to-seed spread of text_only ({spread:.4f})"
    if floor:
      out += f"; {abs(p['mean']) / floor:.1f} x the numerical noise floor ({floor:.4f})"
    return out

  def below_floor(p):
    return floor is not None and abs(p["mean"]) <= floor

  deltas = {arm: paired(v, text[REFERENCE]) for arm, v in text.items() if arm != REFERENCE}
  # Claim 1: native mixing barely hurts text at the same text-token budget.
  if "native" in deltas:
    p, s = deltas["native"], strength(deltas["native"])
    if below_floor(p):
      word = "REPRODUCES (the difference is below the numerical noise floor)"
    elif s == "one seed":
      word = "observed only"
    elif s == "within noise" or p["mean"] <= 0:
      word = "REPRODUCES"
    elif "cpt_decay" in deltas and strength(paired(text["cpt_decay"], text["native"])) in ("clear", "moderate") \
        and paired(text["cpt_decay"], text["native"])["mean"] > 0:
      word = "PARTLY REPRODUCES (native costs text loss beyond noise, but less than cpt_decay)"
    else:
      word = "DOES NOT REPRODUCE"
    lines.append(f"- claim 'native (vision from step 0) keeps text capability': {word}. native - text_only held-out "
                 f"text loss = {_fmt_p(p)}, {s}{vs_spread(p)}")
  # Claim 2: vision added in the LR decay degrades text.
  if "cpt_decay" in deltas:
    p, s = deltas["cpt_decay"], strength(deltas["cpt_decay"])
    if below_floor(p):
      word = "DOES NOT REPRODUCE (below the numerical noise floor)"
    elif s == "one seed":
      word = "observed only"
    elif s in ("clear", "moderate"):
      word = "REPRODUCES" if p["mean"] > 0 else "CONTRADICTED (late vision improves text here)"
    else:
      word = "DOES NOT REPRODUCE (within noise)"
    lines.append(f"- claim 'vision added in the LR decay degrades text': {word}. cpt_decay - text_only = {_fmt_p(p)}, "
                 f"{s}{vs_spread(p)}")
    if "native" in text:
      q = paired(text["cpt_decay"], text["native"])
      sq = strength(q)
      order = ("native keeps text better than cpt_decay" if q["mean"] > 0 else
               "cpt_decay keeps text better than native")
      lines.append(f"- ordering: {order}: cpt_decay - native = {_fmt_p(q)}, {sq}")
  # Claim 3: vision before the decay is sensitive to the LR. lr_scale changes the text-only part of training too,
  # so where a text_only_lr{S} control ran, the claim is judged on vision's own effect at each LR
  # (cpt_predecay_lr{S} - text_only_lr{S}; at S = 1 the control is text_only itself) and how it differs across LRs.
  pre = sorted(a for a in text if a.startswith("cpt_predecay_lr"))

  def control_of(arm):
    scale = arm[len("cpt_predecay_lr"):]
    return REFERENCE if float(scale) == 1.0 else "text_only_lr" + scale

  vision_at = {}
  for arm in pre:
    p = deltas[arm]
    lines.append(f"- {arm} - text_only = {_fmt_p(p)}, {strength(p)}{vs_spread(p)}")
    control = control_of(arm)
    if control != REFERENCE and control in text:
      c = deltas[control]
      lines.append(f"  - the LR change alone ({control} - text_only) = {_fmt_p(c)}, {strength(c)}{vs_spread(c)}")
    if control in text:
      vision_at[arm] = paired(text[arm], text[control])
      q = vision_at[arm]
      if control != REFERENCE:  # at S = 1 it is the line above
        lines.append(f"  - vision's own effect at this LR ({arm} - {control}) = {_fmt_p(q)}, {strength(q)}"
                     f"{vs_spread(q)}")
  if len(pre) >= 2:
    a, b = pre[0], pre[-1]
    if a in vision_at and b in vision_at:
      # difference in differences: does vision cost more text at one LR than at the other?
      q = paired(vision_at[a]["per_seed"], vision_at[b]["per_seed"])
      what = f"vision's effect at {a} minus at {b} = {_fmt_p(q)}"
      both_small = below_floor(vision_at[a]) and below_floor(vision_at[b])
      controlled = True
    else:
      q = paired(text[a], text[b])
      what = f"{a} - {b} = {_fmt_p(q)}"
      both_small = controlled = False
    s = strength(q)
    signs = {v > 0 for v in q["per_seed"].values()}
    if below_floor(q) or both_small:
      word = f"NOT sensitive to this LR change (below the numerical noise floor): {what}"
    elif s == "one seed":
      word = f"observed only: {what}"
    elif len(signs) > 1 and not controlled:
      word = f"REPRODUCES in the seed talk's sense: which LR is better flips across seeds ({what})"
    elif s in ("clear", "moderate") and controlled:
      word = f"the LR matters here ({s}): vision costs more text at {a if q['mean'] > 0 else b}, {what}"
    elif s in ("clear", "moderate"):
      word = f"the LR matters here ({s}): {b if q['mean'] > 0 else a} keeps text better, {what}"
    else:
      word = f"NOT sensitive to this LR change at this scale (within noise): {what}"
    lines.append(f"- claim 'vision before the decay is sensitive to the LR': {word}")
    if controlled:
      lines.append("  - judged on vision's own effect (each predecay arm minus its text-only control at the same LR), "
                   "so the LR's effect on the text-only part of training is taken out")
    else:
      lines.append("  - caveat: lr_scale also changes the text-only part of training; this compares the predecay arms "
                   "directly, which mixes the LR's own effect with vision's (a text_only_lr{S} control arm, not run, "
                   "separates them)")
  if len(pre) == 1:
    lines.append(f"- claim 'vision before the decay is sensitive to the LR': NOT TESTED (only {pre[0]} finished; "
                 "it needs cpt_predecay at two LRs)")
  # Claim 4: attention. Native models' text tokens attend to visual tokens; CPT-style ones barely.
  if "native" in mass and "cpt_decay" in mass:
    q = paired(mass["native"], mass["cpt_decay"])
    s = strength(q)
    ratio = statistics.fmean(mass["native"].values()) / max(statistics.fmean(mass["cpt_decay"].values()), 1e-12)
    if s == "one seed":
      word = "observed only"
    elif s in ("clear", "moderate"):
      word = "REPRODUCES" if q["mean"] > 0 else "CONTRADICTED (cpt_decay's text attends more to visual tokens)"
    else:
      word = "DOES NOT REPRODUCE (within noise)"
    lines.append(f"- claim 'native text tokens attend to visual tokens more than CPT-style ones': {word}. "
                 f"native - cpt_decay mean text->visual attention mass = {_fmt_p(q, 'of the attention')}, {s}; "
                 f"native / cpt_decay = {ratio:.2f}x")
  return lines


# ===================================================================================================== report ==

def _ms(values: list[float], nd: int = 4) -> str:
  if not values:
    return "-"
  if len(values) == 1:
    return f"{values[0]:.{nd}f}"
  return f"{statistics.fmean(values):.{nd}f} ± {statistics.stdev(values):.{nd}f}"


def build_tables(runs: dict[str, dict[int, dict]]) -> tuple[dict, dict]:
  """(summaries {setting: {seed: summary}}, the verdict table)."""
  summ = {arm: {seed: summarise(r) for seed, r in per.items()} for arm, per in runs.items()}
  text = {arm: {seed: s["text"] for seed, s in per.items()} for arm, per in summ.items()}
  mass = {arm: {seed: s["mass_mean"] for seed, s in per.items() if s["mass_mean"] is not None}
          for arm, per in summ.items()}
  ref = list(text.get(REFERENCE, {}).values())
  table = {"text_loss": text, "mass": {a: v for a, v in mass.items() if v},
           "seed_spread": statistics.stdev(ref) if len(ref) > 1 else None, "noise_floor": noise_floor(runs)}
  return summ, table


def write_results(sweep_dir: str, runs: dict[str, dict[int, dict]], meta: dict) -> str:
  os.makedirs(sweep_dir, exist_ok=True)
  path = os.path.join(sweep_dir, "results.json")
  summ, table = build_tables(runs) if runs else ({}, {})
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump({"meta": meta, "runs": {f"{a}/s{s}": r for a, per in runs.items() for s, r in per.items()},
               "summary": {a: {str(s): v for s, v in per.items()} for a, per in summ.items()},
               "verdict_table": {k: ({a: {str(s): x for s, x in v.items()} for a, v in t.items()}
                                     if isinstance(t, dict) else t) for k, t in table.items()}}, f)
  os.replace(tmp, path)
  return path


def write_report(sweep_dir: str, runs: dict[str, dict[int, dict]], meta: dict) -> tuple[str, list[str]]:
  summ, table = build_tables(runs)
  arms = [a for a in meta["arms"] if a in runs]
  seeds = sorted({s for per in runs.values() for s in per})
  any_run = next(iter(next(iter(runs.values())).values()))
  src = any_run["sources"]
  st = any_run["setting"]
  ok, stream_lines = text_stream_check(runs)
  ref = summ.get(REFERENCE, {})

  def col(arm, key):
    return [summ[arm][s][key] for s in sorted(summ[arm]) if summ[arm][s][key] is not None]

  lines = [
      f"# Native vs CPT multimodal training, size `{meta['size']}`", "",
      "One VL model (ViT + projector + dense M3-shaped text tower), one WSD schedule "
      f"({st['steps']} steps: warmup {st['warmup']}, stable to step {st['decay_start']}, then linear decay to 0.1x), "
      f"the same text rows for every arm of a seed ({meta['batch_size']} rows x {meta['seq_len']} tokens per step). "
      f"Vision is extra: arms with vision append {meta['vision_rows']} image/video-caption rows to every batch from "
      "their vision start on (padding rows before). Images are real (Fashion-MNIST, digits, clip art, emoji); "
      "training videos are real images moved by code (synthetic motion); real clips are evaluation only.", "",
      f"Seeds: {seeds}; device: {meta['device']}; wall time per run (train + evals + attention analysis): "
      + ", ".join(f"{a} {statistics.fmean(r['wall_s'] for r in runs[a].values()):.0f}s" for a in arms)
      + (f". {meta['note']}" if meta.get("note") else "."), "",
  ]
  unfinished = [f"{a}_s{seed}" for seed in meta["seeds"] for a in meta["arms"] if seed not in runs.get(a, {})]
  if unfinished:
    lines += [f"**Not finished, left out of every table and claim below:** {', '.join(unfinished)}.", ""]
  lines += ["| arm setting | vision rows from step | LR x scale from step |", "|---|---|---|"]
  for a in arms:
    s = next(iter(runs[a].values()))["setting"]
    vis = "-" if s["vision_start_step"] is None else str(s["vision_start_step"])
    lr = "-" if s["lr_scale_from"] is None else f"x{s['lr_scale']} from {s['lr_scale_from']}"
    lines.append(f"| {a} | {vis} | {lr} |")

  lines += ["", "## Same text for every arm", "",
            "Each run logs the running count of text-row target tokens (`data/text_tokens`) and a sha256 chain over "
            "the text rows' inputs (`data/text_hash`) at every logged step; compared per seed:", "", *stream_lines, "",
            "All arms saw exactly the same text tokens in the same order." if ok else
            "**The text streams are NOT all identical: the comparison below is not at an equal text budget.**"]

  lines += ["", "## Held-out text loss at the end", "",
            "Mean over the text sources of held-out loss (nats/token), mean ± std over seeds; delta = arm - text_only "
            "paired by seed (seeds share the text stream and the initialisation).", "",
            "| arm setting | text loss | delta vs text_only | per-seed deltas | "
            + " | ".join(f"delta {s}" for s in src["text"]) + " |",
            "|---|---|---|---|" + "---|" * len(src["text"])]
  for a in arms:
    if a == REFERENCE or not ref:
      lines.append(f"| {a} | {_ms(col(a, 'text'))} | - | - |" + " - |" * len(src["text"]))
      continue
    p = paired(table["text_loss"][a], table["text_loss"][REFERENCE])
    per_src = []
    for s in src["text"]:
      q = paired({k: v["per_source"][s] for k, v in summ[a].items()},
                 {k: v["per_source"][s] for k, v in ref.items()})
      per_src.append(f"{q['mean']:+.4f}" + (f" ± {q['std']:.4f}" if q["std"] is not None else ""))
    lines.append(f"| {a} | {_ms(col(a, 'text'))} | {p['mean']:+.4f}"
                 + (f" ± {p['std']:.4f}" if p["std"] is not None else "") + " | "
                 + ", ".join(f"s{k}: {v:+.4f}" for k, v in p["per_seed"].items()) + " | " + " | ".join(per_src) + " |")
  if table.get("seed_spread"):
    lines.append(f"\nSeed-to-seed spread (std) of text_only's text loss: {table['seed_spread']:.4f} nats.")
  if table.get("noise_floor") is not None:
    lines.append(f"\nNumerical noise floor: {table['noise_floor']:.4f} nats, the largest text-loss difference to "
                 "text_only of a vision arm at an evaluation before its vision starts (up to then it trains exactly "
                 "text_only's model on text_only's rows, plus padding rows without loss; only the float rounding of "
                 "the larger batch differs, and training amplifies it). Smaller differences are noise whatever the "
                 "number of seeds.")

  steps = [s for s, _ in next(iter(summ[arms[0]].values()))["curve"]]
  lines += ["", "## Held-out text loss over training", "",
            "Mean text loss (mean over seeds) at each evaluation; `text_loss.png` plots it with seed bands and the "
            "paired delta vs text_only.", "",
            "| step | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms)]
  for i, step in enumerate(steps):
    vals = []
    for a in arms:
      pts = [summ[a][s]["curve"][i][1] for s in summ[a] if len(summ[a][s]["curve"]) > i]
      vals.append(f"{statistics.fmean(pts):.4f}" if pts else "-")
    lines.append(f"| {step} | " + " | ".join(vals) + " |")

  lines += ["", "## Caption losses (held-out)", "",
            f"Image: token-weighted over {', '.join(src['image'])}; video: {', '.join(src['video']) or '-'} "
            f"(synthetic motion, held-out sprites); real clips: {', '.join(src['real']) or '-'} (evaluation only). "
            "text_only never trains on captions (its ViT stays at its initialisation): its numbers are the floor of "
            "no vision training.", "",
            "| arm setting | image caption loss | video caption loss | real-clip caption loss |", "|---|---|---|---|"]
  for a in arms:
    lines.append(f"| {a} | {_ms(col(a, 'image'))} | {_ms(col(a, 'video'))} | {_ms(col(a, 'real'))} |")

  n_layers = len(next(iter(next(iter(summ.values())).values()))["mass"].get("image", []))
  lines += ["", "## Text->visual attention mass per layer", "",
            "For every text token of a held-out caption example that can see visual tokens (causal, same example): "
            "the attention probability it puts on the visual tokens; mean over heads and those queries "
            f"({ATTENTION_BATCHES} held-out batches per source), mean ± std over seeds. Uniform attention over the "
            "visible tokens would give the `uniform` column (the visual share of what each query sees).", "",
            "| arm setting | modality | " + " | ".join(f"layer {i}" for i in range(n_layers)) + " | mean | uniform |",
            "|---|---|" + "---|" * (n_layers + 2)]
  for a in arms:
    for kind in ("image", "video"):
      per = [summ[a][s]["mass"][kind] for s in sorted(summ[a]) if kind in summ[a][s]["mass"]]
      if not per:
        continue
      cells = [_ms([p[i] for p in per], 3) for i in range(n_layers)]
      uni = [summ[a][s]["uniform"].get(kind) for s in sorted(summ[a])]
      lines.append(f"| {a} | {kind} | " + " | ".join(cells) + f" | {_ms([statistics.fmean(p) for p in per], 3)} | "
                   f"{_ms([u for u in uni if u is not None], 3)} |")

  lines += ["", "## Attention maps", "",
            "`attention_maps.png`: for the first held-out example of "
            + ", ".join(dict.fromkeys(m["source"] for m in any_run["maps"]))
            + " (seed " + str(seeds[0]) + "), the attention of its caption tokens on each visual token (mean over "
            "heads and caption tokens), per layer (columns) and arm (rows); one colour scale per example and layer, "
            "so arms compare directly. Each map's total (its text->visual mass) is in its title.", "",
            "## Verdict (computed from the numbers)", "", *verdict(table), "",
            "Notes: the loss is the mean over all loss tokens of a batch, so in vision arms the caption tokens share "
            "the gradient with the (identical) text tokens; before an arm's vision start its extra rows are padding "
            "(no loss, no gradient; AdamW's decoupled weight decay still shrinks the idle ViT). Scale is tiny "
            "compared with the seed talk's models; a claim that does not reproduce here may still hold at scale.", "",
            f"Numbers: `results.json`; plots: {', '.join(f'`{p}`' for p in PLOTS)}. Workdirs: "
            f"{', '.join(meta['workdirs'])}.", ""]
  path = os.path.join(sweep_dir, "report.md")
  with open(path, "w") as f:
    f.write("\n".join(lines))
  return path, plot_all(sweep_dir, summ, runs, arms)


# ====================================================================================================== plots ==

PLOTS = ("text_loss.png", "text_delta.png", "caption_loss.png", "attention_mass.png", "attention_maps.png")
DPI = 80


def _band(ax, curves: list[list[tuple[int, float]]], label: str, color: str):
  import numpy as np  # noqa: PLC0415
  n = min(len(c) for c in curves)
  x = np.array([p[0] for p in curves[0][:n]])
  y = np.array([[p[1] for p in c[:n]] for c in curves], np.float64)
  mean = y.mean(0)
  ax.plot(x, mean, color=color, label=label, lw=1.5)
  if len(curves) > 1:
    ax.fill_between(x, y.min(0), y.max(0), color=color, alpha=0.2, lw=0)


def plot_all(sweep_dir: str, summ: dict, runs: dict, arms: list[str]) -> list[str]:
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  colors = {a: f"C{i}" for i, a in enumerate(arms)}
  out = []
  ref = summ.get(REFERENCE, {})
  any_run = next(iter(next(iter(runs.values())).values()))
  text_sources = any_run["sources"]["text"]

  def vstart(a):
    return next(iter(runs[a].values()))["setting"]["vision_start_step"]

  # 1. text loss curves: absolute and paired delta vs text_only (band: min..max over seeds)
  fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
  for a in arms:
    _band(axes[0], [summ[a][s]["curve"] for s in sorted(summ[a])], a, colors[a])
    if a != REFERENCE and ref:
      deltas = [[(p[0], p[1] - q[1]) for p, q in zip(summ[a][s]["curve"], ref[s]["curve"])]
                for s in sorted(summ[a]) if s in ref]
      if deltas:
        _band(axes[1], deltas, a, colors[a])
      if vstart(a) is not None:
        axes[1].axvline(vstart(a), color=colors[a], ls=":", lw=1)
  axes[0].set(title="held-out text loss (mean over text sources)", xlabel="step", ylabel="nats/token")
  finals = [v for a in arms for v in (p[1] for s in summ[a] for p in summ[a][s]["curve"][-1:])]
  if finals:
    axes[0].set_ylim(min(finals) - 0.3, min(finals) + 2.5)
  axes[1].axhline(0, color="grey", lw=1)
  axes[1].set(title="delta vs text_only (same seed); dotted: vision start", xlabel="step", ylabel="nats/token")
  axes[0].legend(fontsize=7)
  fig.tight_layout()
  out.append(os.path.join(sweep_dir, "text_loss.png"))
  fig.savefig(out[-1], dpi=DPI)
  plt.close(fig)

  # 2. final text-loss delta per arm with error bars, overall and per source
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
  fig.tight_layout()
  out.append(os.path.join(sweep_dir, "text_delta.png"))
  fig.savefig(out[-1], dpi=DPI)
  plt.close(fig)

  # 3. caption losses: over training (image, video) and final bars
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
  fig.tight_layout()
  out.append(os.path.join(sweep_dir, "caption_loss.png"))
  fig.savefig(out[-1], dpi=DPI)
  plt.close(fig)

  # 4. attention mass per layer
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
  fig.tight_layout()
  out.append(os.path.join(sweep_dir, "attention_mass.png"))
  fig.savefig(out[-1], dpi=DPI)
  plt.close(fig)

  out.append(plot_maps(sweep_dir, runs, arms))
  return out


def plot_maps(sweep_dir: str, runs: dict, arms: list[str]) -> str:
  """Rows: (example, arm); columns: the example's pixels, then its caption's attention per layer."""
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  seed = min(s for a in arms for s in runs[a])
  maps = {a: runs[a][seed]["maps"] for a in arms if seed in runs[a]}
  examples_path = os.path.join(sweep_dir, "attention_examples.json")
  pictures = json.load(open(examples_path)) if os.path.exists(examples_path) else []
  n_ex = min(len(m) for m in maps.values())
  n_layers = len(next(iter(maps.values()))[0]["layers"]) if n_ex else 0
  rows = [(e, a) for e in range(n_ex) for a in maps]
  fig, axes = plt.subplots(max(len(rows), 1), n_layers + 1, figsize=(1.9 * (n_layers + 1), 1.5 * max(len(rows), 1)),
                           squeeze=False)
  side = None
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
  fig.tight_layout()
  path = os.path.join(sweep_dir, "attention_maps.png")
  fig.savefig(path, dpi=DPI)
  plt.close(fig)
  return path


# ======================================================================================================= main ==

def load_runs(sweep_dir: str, arms: list[str], seeds: list[int], steps: int = 0) -> dict[str, dict[int, dict]]:
  """Finished runs' analyses; with `steps`, a run that recorded fewer trained steps is left out (and said so)."""
  runs: dict[str, dict[int, dict]] = {}
  for arm in arms:
    for seed in seeds:
      path = os.path.join(sweep_dir, f"{arm}_s{seed}", "analysis.json")
      if os.path.exists(path):
        with open(path) as f:
          analysis = json.load(f)
        if steps and analysis.get("steps_trained", steps) < steps:
          print(f"[native_vs_cpt] {arm}_s{seed} trained {analysis['steps_trained']} of {steps} steps: left out",
                flush=True)
          continue
        runs.setdefault(arm, {})[seed] = analysis
  return runs


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--size", default="cpu", help="micro | cpu | gpu (configs/native_vs_cpt.py SIZES)")
  ap.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                  help="arm settings: text_only, native, cpt_decay, cpt_predecay_lr{S}, text_only_lr{S}")
  ap.add_argument("--seeds", default="", help="comma-separated seeds (default: 0 on cpu/micro, 0,1,2 on gpu)")
  ap.add_argument("--steps", type=int, default=0, help="train steps (0: the size's default)")
  ap.add_argument("--data_dir", default=os.path.join(REPO, "data"))
  ap.add_argument("--sweep_dir", default=os.path.join(REPO, "workdirs", "native_vs_cpt"))
  ap.add_argument("--config_arg", default="", help="more configs/native_vs_cpt.py arguments, e.g. attn=cudnn")
  ap.add_argument("--override", action="append", default=[], help="KEY=VALUE on the config, e.g. train.steps=50")
  ap.add_argument("--report_only", action="store_true", help="only read finished runs and write the report")
  ap.add_argument("--prepare_only", action="store_true", help="only prepare DATA_DIR (text corpus + vision data)")
  ap.add_argument("--note", default="", help="a sentence for the report on how the runs were made")
  ap.add_argument("--compilation_cache", default="",
                  help="persistent XLA cache directory ('' = SWEEP_DIR/.jax_cache, 'none' = off): the arms share "
                       "their init, eval and (same shapes) train programs")
  a = ap.parse_args(argv)

  arms = [s.strip() for s in a.arms.split(",") if s.strip()]
  for s in arms:
    parse_setting(s)
  seeds = [int(s) for s in (a.seeds or DEFAULT_SEEDS.get(a.size, "0")).split(",") if s.strip()]
  sweep_dir = os.path.abspath(a.sweep_dir)
  import jax  # noqa: PLC0415
  from m3_jax.train import trainer  # noqa: PLC0415
  if a.prepare_only:
    trainer.prepare_data(make_config(a.size, arms[0], seeds[0], a.steps, a.data_dir, a.override, a.config_arg))
    return None
  if a.compilation_cache != "none":
    jax.config.update("jax_compilation_cache_dir", a.compilation_cache or os.path.join(sweep_dir, ".jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  os.makedirs(sweep_dir, exist_ok=True)
  config = make_config(a.size, arms[0], seeds[0], a.steps, a.data_dir, a.override, a.config_arg)
  old_results = os.path.join(sweep_dir, "results.json")
  device = f"{jax.device_count()} x {jax.devices()[0].device_kind}"
  if a.report_only and os.path.exists(old_results):
    # the report is often rewritten on another machine than the one that trained: keep the training device
    device = json.load(open(old_results))["meta"].get("device", device)
  meta = {"size": a.size, "arms": arms, "seeds": seeds, "steps": int(config.train.steps),
          "batch_size": int(config.train.batch_size), "seq_len": int(config.train.seq_len),
          "vision_rows": max(int(make_config(a.size, s, seeds[0], a.steps, a.data_dir, a.override, a.config_arg)
                                 .data.mm.vision_rows) for s in arms),
          "device": device, "note": a.note, "config_arg": a.config_arg, "overrides": a.override,
          "workdirs": [f"{s}_s{seed}" for seed in seeds for s in arms]}

  todo = [(s, seed) for seed in seeds for s in arms]
  t_sweep, done_here = time.time(), []
  if not a.report_only:
    for i, (setting, seed) in enumerate(todo):
      work = os.path.join(sweep_dir, f"{setting}_s{seed}")
      done_path = os.path.join(work, "analysis.json")
      if os.path.exists(done_path):
        print(f"[native_vs_cpt] run {i + 1}/{len(todo)}: {setting} seed {seed}: finished before, reused", flush=True)
        continue
      elapsed = time.time() - t_sweep
      eta = (f", sweep ETA {statistics.fmean(done_here) * (len(todo) - i):.0f}s" if done_here else "")
      print(f"[native_vs_cpt] run {i + 1}/{len(todo)}: {setting} seed {seed} -> {work} (elapsed {elapsed:.0f}s{eta})",
            flush=True)
      cfg = make_config(a.size, setting, seed, a.steps, a.data_dir, a.override, a.config_arg)
      t0 = time.time()
      trainer.train_and_evaluate(cfg, work)
      # The trainer returns normally after a SIGTERM (it saves and stops): such a run must not be analysed and
      # reported as finished, and the sweep must stop rather than start the next run on a machine being taken away.
      ckpt = trainer.make_checkpointer(cfg, work)
      trained = ckpt.latest_step() or 0
      ckpt.close()
      if trained < int(cfg.train.steps):
        raise SystemExit(f"[native_vs_cpt] {setting} seed {seed} stopped at step {trained} of {int(cfg.train.steps)} "
                         f"(interrupted); the same command resumes it from {work}")
      analysis = run_analysis(cfg, work, setting, seed, 0.0, os.path.join(sweep_dir, "attention_examples.json"))
      analysis["wall_s"] = time.time() - t0
      analysis["steps_trained"] = trained
      with open(done_path + ".tmp", "w") as f:
        json.dump(analysis, f)
      os.replace(done_path + ".tmp", done_path)
      done_here.append(time.time() - t0)
      write_results(sweep_dir, load_runs(sweep_dir, arms, seeds, meta["steps"]), meta)
      print(f"[native_vs_cpt] run {i + 1}/{len(todo)}: {setting} seed {seed} done in {done_here[-1]:.0f}s "
            f"(elapsed {time.time() - t_sweep:.0f}s)", flush=True)
  runs = load_runs(sweep_dir, arms, seeds, meta["steps"])
  missing = [f"{s}_s{seed}" for s, seed in todo if seed not in runs.get(s, {})]
  if missing:
    print(f"[native_vs_cpt] not finished (left out of the report): {', '.join(missing)}", flush=True)
  if not runs:
    raise SystemExit(f"no finished run in {sweep_dir} for arms {arms} and seeds {seeds}")
  meta["wall_s_this_command"] = time.time() - t_sweep
  js = write_results(sweep_dir, runs, meta)
  md, pngs = write_report(sweep_dir, runs, meta)
  print(open(md).read())
  print(f"[native_vs_cpt] wrote {js}, {md}, " + ", ".join(pngs))
  return runs


if __name__ == "__main__":
  main()
