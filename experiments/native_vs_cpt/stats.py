"""The numbers of the report: per-run summaries, paired (same-seed) differences and how far they stand out of the
seed noise and the numerical noise floor, the text-stream check, and the verdict on each seed claim."""

from __future__ import annotations

import dataclasses
import math
import statistics

REFERENCE = "text_only"


# ================================================================================================== summaries ==

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


# ========================================================================================= paired differences ==

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


def _fmt_paired(p: dict, unit: str = "nats") -> str:
  """"+0.0550 nats (std 0.0050 over 3 seeds, t = +19.1)", or "(one seed)" without a noise estimate."""
  s = f"{p['mean']:+.4f} {unit}"
  if p["std"] is not None:
    s += f" (std {p['std']:.4f} over {p['n']} seeds, t = {p['t']:+.1f})"
  else:
    s += " (one seed)"
  return s


@dataclasses.dataclass(frozen=True)
class _Noise:
  """What a paired text-loss difference is compared with: the seed-to-seed spread (std) of text_only's text loss and
  the numerical noise floor (noise_floor()); either may be None."""
  spread: float | None
  floor: float | None

  def describe(self, p: dict) -> str:
    """'; |delta| = N x the seed-to-seed spread ...; N x the numerical noise floor ...' for the known ones."""
    out = ""
    if self.spread:
      out += (f"; |delta| = {abs(p['mean']) / self.spread:.1f} x the seed-to-seed spread of text_only "
              f"({self.spread:.4f})")
    if self.floor:
      out += f"; {abs(p['mean']) / self.floor:.1f} x the numerical noise floor ({self.floor:.4f})"
    return out

  def below_floor(self, p: dict) -> bool:
    return self.floor is not None and abs(p["mean"]) <= self.floor


# ================================================================================================== verdict ==

def verdict(table: dict) -> list[str]:
  """The seed claims, judged from the numbers. table: {"text_loss": {setting: {seed: final mean text loss}},
  "mass": {setting: {seed: mean text->visual attention mass}}, "seed_spread": std over seeds of the reference's
  text loss or None}. A claim 'REPRODUCES' when the paired (same-seed) difference has the claimed sign and stands out
  of the seed noise (|t| >= 2); with one seed there is no noise estimate and only the direction is reported."""
  text, mass = table["text_loss"], table.get("mass", {})
  noise = _Noise(table.get("seed_spread"), table.get("noise_floor"))
  lines = []
  if REFERENCE not in text:
    return ["- no text_only run: no verdict (every claim is a difference to text_only)"]
  if len(text[REFERENCE]) < 2:
    lines.append("- ONE SEED: the seed noise cannot be estimated, so no difference below can be called real; the "
                 "signs are reported as observations only (the GPU sweep runs 3 seeds)")
  deltas = {arm: paired(v, text[REFERENCE]) for arm, v in text.items() if arm != REFERENCE}
  lines += _claim_native(text, deltas, noise)
  lines += _claim_decay(text, deltas, noise)
  pre = sorted(a for a in text if a.startswith("cpt_predecay_lr"))
  vision_lines, vision_at = _vision_effects(text, deltas, noise, pre)
  lines += vision_lines + _claim_lr(text, pre, vision_at, noise)
  lines += _claim_attention(mass)
  return lines


def _claim_native(text: dict, deltas: dict, noise: _Noise) -> list[str]:
  """Claim 1: native mixing barely hurts text at the same text-token budget."""
  if "native" not in deltas:
    return []
  p, s = deltas["native"], strength(deltas["native"])
  if noise.below_floor(p):
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
  return [f"- claim 'native (vision from step 0) keeps text capability': {word}. native - text_only held-out "
          f"text loss = {_fmt_paired(p)}, {s}{noise.describe(p)}"]


def _claim_decay(text: dict, deltas: dict, noise: _Noise) -> list[str]:
  """Claim 2: vision added in the LR decay degrades text (and the ordering against native)."""
  if "cpt_decay" not in deltas:
    return []
  p, s = deltas["cpt_decay"], strength(deltas["cpt_decay"])
  if noise.below_floor(p):
    word = "DOES NOT REPRODUCE (below the numerical noise floor)"
  elif s == "one seed":
    word = "observed only"
  elif s in ("clear", "moderate"):
    word = "REPRODUCES" if p["mean"] > 0 else "CONTRADICTED (late vision improves text here)"
  else:
    word = "DOES NOT REPRODUCE (within noise)"
  lines = [f"- claim 'vision added in the LR decay degrades text': {word}. cpt_decay - text_only = {_fmt_paired(p)}, "
           f"{s}{noise.describe(p)}"]
  if "native" in text:
    q = paired(text["cpt_decay"], text["native"])
    sq = strength(q)
    order = ("native keeps text better than cpt_decay" if q["mean"] > 0 else
             "cpt_decay keeps text better than native")
    lines.append(f"- ordering: {order}: cpt_decay - native = {_fmt_paired(q)}, {sq}")
  return lines


def _control_of(arm: str) -> str:
  """The text-only control of a cpt_predecay_lr{S} arm: text_only at S = 1, else text_only_lr{S}."""
  scale = arm[len("cpt_predecay_lr"):]
  return REFERENCE if float(scale) == 1.0 else "text_only_lr" + scale


def _vision_effects(text: dict, deltas: dict, noise: _Noise, pre: list[str]) -> tuple[list[str], dict]:
  """Each predecay arm against text_only and, where its control ran, vision's own effect at its LR
  (cpt_predecay_lr{S} - text_only_lr{S}). Returns (report lines, {arm: that paired difference})."""
  lines, vision_at = [], {}
  for arm in pre:
    p = deltas[arm]
    lines.append(f"- {arm} - text_only = {_fmt_paired(p)}, {strength(p)}{noise.describe(p)}")
    control = _control_of(arm)
    if control != REFERENCE and control in text:
      c = deltas[control]
      lines.append(f"  - the LR change alone ({control} - text_only) = {_fmt_paired(c)}, {strength(c)}"
                   f"{noise.describe(c)}")
    if control in text:
      vision_at[arm] = paired(text[arm], text[control])
      q = vision_at[arm]
      if control != REFERENCE:  # at S = 1 it is the line above
        lines.append(f"  - vision's own effect at this LR ({arm} - {control}) = {_fmt_paired(q)}, {strength(q)}"
                     f"{noise.describe(q)}")
  return lines, vision_at


def _claim_lr(text: dict, pre: list[str], vision_at: dict, noise: _Noise) -> list[str]:
  """Claim 3: vision before the decay is sensitive to the LR. lr_scale changes the text-only part of training too,
  so where a text_only_lr{S} control ran, the claim is judged on vision's own effect at each LR
  (cpt_predecay_lr{S} - text_only_lr{S}; at S = 1 the control is text_only itself) and how it differs across LRs."""
  if len(pre) == 1:
    return [f"- claim 'vision before the decay is sensitive to the LR': NOT TESTED (only {pre[0]} finished; "
            "it needs cpt_predecay at two LRs)"]
  if len(pre) < 2:
    return []
  a, b = pre[0], pre[-1]
  if a in vision_at and b in vision_at:
    # difference in differences: does vision cost more text at one LR than at the other?
    q = paired(vision_at[a]["per_seed"], vision_at[b]["per_seed"])
    what = f"vision's effect at {a} minus at {b} = {_fmt_paired(q)}"
    both_small = noise.below_floor(vision_at[a]) and noise.below_floor(vision_at[b])
    controlled = True
  else:
    q = paired(text[a], text[b])
    what = f"{a} - {b} = {_fmt_paired(q)}"
    both_small = controlled = False
  s = strength(q)
  signs = {v > 0 for v in q["per_seed"].values()}
  if noise.below_floor(q) or both_small:
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
  lines = [f"- claim 'vision before the decay is sensitive to the LR': {word}"]
  if controlled:
    lines.append("  - judged on vision's own effect (each predecay arm minus its text-only control at the same LR), "
                 "so the LR's effect on the text-only part of training is taken out")
  else:
    lines.append("  - caveat: lr_scale also changes the text-only part of training; this compares the predecay arms "
                 "directly, which mixes the LR's own effect with vision's (a text_only_lr{S} control arm, not run, "
                 "separates them)")
  return lines


def _claim_attention(mass: dict) -> list[str]:
  """Claim 4: native models' text tokens attend to visual tokens; CPT-style ones barely."""
  if "native" not in mass or "cpt_decay" not in mass:
    return []
  q = paired(mass["native"], mass["cpt_decay"])
  s = strength(q)
  ratio = statistics.fmean(mass["native"].values()) / max(statistics.fmean(mass["cpt_decay"].values()), 1e-12)
  if s == "one seed":
    word = "observed only"
  elif s in ("clear", "moderate"):
    word = "REPRODUCES" if q["mean"] > 0 else "CONTRADICTED (cpt_decay's text attends more to visual tokens)"
  else:
    word = "DOES NOT REPRODUCE (within noise)"
  return [f"- claim 'native text tokens attend to visual tokens more than CPT-style ones': {word}. "
          f"native - cpt_decay mean text->visual attention mass = {_fmt_paired(q, 'of the attention')}, {s}; "
          f"native / cpt_decay = {ratio:.2f}x"]
