"""Per-arm summaries over seeds, noise floors, and the verdict of each claim (a)-(d), all from the run records.

A difference between two arms counts only when it is larger than both 2x the seed spread (the larger std over
seeds of the two arms) and the metric's noise floor: the seed spread of the reference arm (dense for losses and
accuracies, msa_per_group for the MSA diagnostics), and for an accuracy at least one example's worth of it. With
one seed on either side there is no spread: the verdict is marked "1 seed: indicative only"."""

from __future__ import annotations

import statistics

# metric -> +1 when higher is worse (a loss), -1 when higher is better
DIRECTION = {"loss": 1, "jaccard": 1, "kl": 1, "mass_recall": -1, "random_mass_recall": -1}
MSA_METRICS = ("jaccard", "mass_recall", "random_mass_recall", "kl")


def direction(metric: str) -> int:
  return -1 if metric.startswith("acc") else DIRECTION.get(metric.split("/")[0], 1)


def run_metrics(record: dict, train_len: int) -> dict[str, float]:
  """The scalar numbers of one run: loss (held-out mean over sources), loss/{source}, acc@{length} (mean over
  tasks), acc (at the training length), the MSA diagnostics (mean over layers) and diverged (0/1)."""
  out: dict[str, float] = {"diverged": float(record["diverged"])}
  ev = record["eval"]
  if ev["mean"] is not None:
    out["loss"] = ev["mean"]
  out.update({f"loss/{s}": x for s, x in ev["loss"].items() if x is not None})
  lengths = sorted({int(n) for acc in record["accuracy"].values() for n in acc})
  for n in lengths:
    vals = [acc[str(n)] for acc in record["accuracy"].values() if str(n) in acc]
    out[f"acc@{n}"] = sum(vals) / len(vals)
  if f"acc@{train_len}" in out:
    out["acc"] = out[f"acc@{train_len}"]
  names = {"group_jaccard": "jaccard", "mass_recall": "mass_recall", "random_mass_recall": "random_mass_recall",
           "kl": "kl"}
  for src, dst in names.items():
    per_layer = record["msa"].get(src)
    if per_layer:
      out[dst] = sum(per_layer.values()) / len(per_layer)
  return out


def summarize(runs: dict[str, dict[int, dict]], train_len: int) -> dict[str, dict[str, dict]]:
  """{arm: {metric: {"values": {seed: x}, "mean", "std" (None under 2 seeds), "n"}}}."""
  out: dict[str, dict[str, dict]] = {}
  for arm, by_seed in runs.items():
    per_seed = {seed: run_metrics(r, train_len) for seed, r in sorted(by_seed.items())}
    names = sorted({k for m in per_seed.values() for k in m})
    for name in names:
      vals = {str(s): m[name] for s, m in per_seed.items() if name in m}
      xs = list(vals.values())
      out.setdefault(arm, {})[name] = {"values": vals, "mean": statistics.fmean(xs),
                                       "std": statistics.stdev(xs) if len(xs) >= 2 else None, "n": len(xs)}
  return out


def noise_floors(summary: dict, examples_per_length: int | None) -> dict[str, float | None]:
  """{metric: floor}: the seed spread of the reference arm; an accuracy's floor is at least one example."""
  floors: dict[str, float | None] = {}
  metrics = sorted({k for arm in summary.values() for k in arm})
  for name in metrics:
    ref = "msa_per_group" if name in MSA_METRICS else "dense"
    std = summary.get(ref, {}).get(name, {}).get("std")
    if name.startswith("acc") and examples_per_length:
      std = max(std or 0.0, 1.0 / examples_per_length)
    floors[name] = std
  return floors


def compare(summary: dict, floors: dict, cand: str, ref: str, metric: str) -> dict | None:
  """cand vs ref on `metric`: {"cand", "ref", "diff" (cand - ref), "threshold", "outcome": better | worse | same,
  "one_seed"}; None when either arm lacks it."""
  a, b = summary.get(cand, {}).get(metric), summary.get(ref, {}).get(metric)
  if a is None or b is None:
    return None
  spread = max(a["std"] or 0.0, b["std"] or 0.0)
  threshold = max(2 * spread, floors.get(metric) or 0.0)
  diff = a["mean"] - b["mean"]
  worse = diff * direction(metric)
  outcome = "worse" if worse > threshold else "better" if -worse > threshold else "same"
  return {"metric": metric, "cand": cand, "ref": ref, "cand_mean": a["mean"], "ref_mean": b["mean"], "diff": diff,
          "threshold": threshold, "outcome": outcome, "one_seed": a["n"] < 2 or b["n"] < 2}


def describe(c: dict) -> str:
  word = {"same": "no difference beyond the threshold", "worse": f"{c['cand']} worse", "better": f"{c['cand']} better"}
  thr = (f"threshold {c['threshold']:.4f}" if c["threshold"] > 0 else
         "no seed spread or noise floor: direction only")
  return (f"{c['metric']} {c['cand']} {c['cand_mean']:.4f} vs {c['ref']} {c['ref_mean']:.4f} (diff {c['diff']:+.4f}, "
          f"{thr}: {word[c['outcome']]})")


def _line(claim: str, status: str, comps: list[dict], one_seed: bool = False) -> str:
  one = one_seed or any(c["one_seed"] for c in comps)
  return (f"- ({claim}) **{status}**{' (1 seed: indicative only)' if one else ''}: "
          + "; ".join(describe(c) for c in comps))


def verdict(summary: dict, floors: dict, train_len: int, lengths: list[int]) -> list[str]:
  """One line per claim (a)-(d), each with the comparisons it rests on."""
  def comps(cand, ref, names):
    return [c for c in (compare(summary, floors, cand, ref, n) for n in names) if c is not None]

  def missing(claim, arms):
    gone = [a for a in arms if a not in summary]
    return f"- ({claim}) **NOT TESTED**: arm(s) {', '.join(gone)} not run" if gone else None

  quality = ["loss", f"acc@{train_len}"] + ([f"acc@{max(lengths)}"] if max(lengths) != train_len else [])
  lines = []

  # (a) per-group selection keeps the groups' selections apart (lower Jaccard) and is not worse than shared
  miss = missing("a", ["msa_per_group", "msa_shared"])
  if miss:
    lines.append(miss)
  else:
    div = comps("msa_per_group", "msa_shared", ["jaccard"])
    q = comps("msa_per_group", "msa_shared", quality)
    diverse = bool(div) and div[0]["outcome"] == "better"
    worse = any(c["outcome"] == "worse" for c in q)
    better = any(c["outcome"] == "better" for c in q)
    status = ("DOES NOT REPRODUCE: per-group selections are not more diverse" if not diverse else
              "DOES NOT REPRODUCE: per-group is more diverse but worse" if worse else
              "REPRODUCES: per-group is more diverse and better" if better else
              "PARTLY: per-group is more diverse, quality the same within the threshold")
    lines.append(_line("a", status, div + q))

  # (b) block-level selection costs nothing against finer blocks at the same token budget
  fine = [a for a in ("msa_block16", "msa_block64") if a in summary]
  miss = missing("b", ["msa_per_group"]) or (None if fine else "- (b) **NOT TESTED**: no msa_block16 / msa_block64 run")
  if miss:
    lines.append(miss)
  else:
    q = [c for arm in fine for c in comps("msa_per_group", arm, quality)]
    status = ("DOES NOT REPRODUCE: coarse blocks are worse than finer ones" if any(c["outcome"] == "worse" for c in q)
              else "REPRODUCES: no drop from block-level selection beyond the threshold")
    lines.append(_line("b", status, q))

  # (c) MSA matches dense attention, trained from scratch and converted from dense
  miss = missing("c", ["dense", "msa_per_group"])
  if miss:
    lines.append(miss)
  else:
    for arm, what in (("msa_per_group", "MSA from scratch"), ("dense_to_msa", "dense -> MSA conversion")):
      if arm not in summary:
        lines.append(f"- (c) **NOT TESTED** ({what}): arm {arm} not run")
        continue
      q = comps(arm, "dense", quality)
      status = (f"DOES NOT REPRODUCE: {what} is worse than dense" if any(c["outcome"] == "worse" for c in q) else
                f"REPRODUCES: {what} matches dense within the threshold")
      lines.append(_line("c", status, q))

  # (d) without the detach the index branch's gradient disturbs the trunk: training diverges or ends worse
  miss = missing("d", ["msa_per_group", "msa_no_detach"])
  if miss:
    lines.append(miss)
  else:
    diverged = summary["msa_no_detach"]["diverged"]["mean"]
    q = comps("msa_no_detach", "msa_per_group", ["loss", f"acc@{train_len}"])
    status = ("REPRODUCES: training without the detach diverged" if diverged else
              "REPRODUCES (weakly): no divergence, but worse without the detach"
              if any(c["outcome"] == "worse" for c in q) else
              "DOES NOT REPRODUCE: no divergence and no difference beyond the threshold without the detach")
    n = summary["msa_no_detach"]["diverged"]["n"]
    lines.append(_line("d", status, q, one_seed=n < 2) + (f" (diverged in {diverged * n:.0f} of {n} seeds)"
                                                           if diverged else ""))
  return lines
