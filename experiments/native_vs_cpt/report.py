"""SWEEP_DIR/results.json (meta, every run's analysis, summaries, the verdict table) and SWEEP_DIR/report.md (one
section per question, the verdict computed from the numbers), then the plots."""

from __future__ import annotations

import os
import statistics

from experiments.lib.sweep import write_json
from experiments.native_vs_cpt import plots
from experiments.native_vs_cpt.analysis import ATTENTION_BATCHES
from experiments.native_vs_cpt.stats import REFERENCE, build_tables, paired, text_stream_check, verdict


def write_results(sweep_dir: str, runs: dict[str, dict[int, dict]], meta: dict) -> str:
  os.makedirs(sweep_dir, exist_ok=True)
  path = os.path.join(sweep_dir, "results.json")
  summ, table = build_tables(runs) if runs else ({}, {})
  write_json(path, {"meta": meta, "runs": {f"{a}/s{s}": r for a, per in runs.items() for s, r in per.items()},
                    "summary": {a: {str(s): v for s, v in per.items()} for a, per in summ.items()},
                    "verdict_table": {k: ({a: {str(s): x for s, x in v.items()} for a, v in t.items()}
                                          if isinstance(t, dict) else t) for k, t in table.items()}})
  return path


def _ms(values: list[float], nd: int = 4) -> str:
  """"x" for one value, "mean ± std" for several, "-" for none."""
  if not values:
    return "-"
  if len(values) == 1:
    return f"{values[0]:.{nd}f}"
  return f"{statistics.fmean(values):.{nd}f} ± {statistics.stdev(values):.{nd}f}"


def _col(summ: dict, arm: str, key: str) -> list:
  """`key` of every seed's summary of `arm` that has it, by seed."""
  return [summ[arm][s][key] for s in sorted(summ[arm]) if summ[arm][s][key] is not None]


def _header(runs: dict, meta: dict, arms: list[str], seeds: list[int]) -> list[str]:
  """Title, what was trained, the unfinished runs and the arm settings table."""
  st = next(iter(next(iter(runs.values())).values()))["setting"]
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
  return lines


def _text_stream(runs: dict) -> list[str]:
  ok, stream_lines = text_stream_check(runs)
  return ["", "## Same text for every arm", "",
          "Each run logs the running count of text-row target tokens (`data/text_tokens`) and a sha256 chain over "
          "the text rows' inputs (`data/text_hash`) at every logged step; compared per seed:", "", *stream_lines, "",
          "All arms saw exactly the same text tokens in the same order." if ok else
          "**The text streams are NOT all identical: the comparison below is not at an equal text budget.**"]


def _final_text(summ: dict, table: dict, arms: list[str], text_sources: list[str]) -> list[str]:
  """Final held-out text loss per arm and its paired delta to text_only, overall and per source; the noise."""
  ref = summ.get(REFERENCE, {})
  lines = ["", "## Held-out text loss at the end", "",
           "Mean over the text sources of held-out loss (nats/token), mean ± std over seeds; delta = arm - text_only "
           "paired by seed (seeds share the text stream and the initialisation).", "",
           "| arm setting | text loss | delta vs text_only | per-seed deltas | "
           + " | ".join(f"delta {s}" for s in text_sources) + " |",
           "|---|---|---|---|" + "---|" * len(text_sources)]
  for a in arms:
    if a == REFERENCE or not ref:
      lines.append(f"| {a} | {_ms(_col(summ, a, 'text'))} | - | - |" + " - |" * len(text_sources))
      continue
    p = paired(table["text_loss"][a], table["text_loss"][REFERENCE])
    per_src = []
    for s in text_sources:
      q = paired({k: v["per_source"][s] for k, v in summ[a].items()},
                 {k: v["per_source"][s] for k, v in ref.items()})
      per_src.append(f"{q['mean']:+.4f}" + (f" ± {q['std']:.4f}" if q["std"] is not None else ""))
    lines.append(f"| {a} | {_ms(_col(summ, a, 'text'))} | {p['mean']:+.4f}"
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
  return lines


def _text_curves(summ: dict, arms: list[str]) -> list[str]:
  steps = [s for s, _ in next(iter(summ[arms[0]].values()))["curve"]]
  lines = ["", "## Held-out text loss over training", "",
           "Mean text loss (mean over seeds) at each evaluation; `text_loss.png` plots it with seed bands and the "
           "paired delta vs text_only.", "",
           "| step | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms)]
  for i, step in enumerate(steps):
    vals = []
    for a in arms:
      pts = [summ[a][s]["curve"][i][1] for s in summ[a] if len(summ[a][s]["curve"]) > i]
      vals.append(f"{statistics.fmean(pts):.4f}" if pts else "-")
    lines.append(f"| {step} | " + " | ".join(vals) + " |")
  return lines


def _captions(summ: dict, arms: list[str], src: dict[str, list[str]]) -> list[str]:
  lines = ["", "## Caption losses (held-out)", "",
           f"Image: token-weighted over {', '.join(src['image'])}; video: {', '.join(src['video']) or '-'} "
           f"(synthetic motion, held-out sprites); real clips: {', '.join(src['real']) or '-'} (evaluation only). "
           "text_only never trains on captions (its ViT stays at its initialisation): its numbers are the floor of "
           "no vision training.", "",
           "| arm setting | image caption loss | video caption loss | real-clip caption loss |", "|---|---|---|---|"]
  for a in arms:
    lines.append(f"| {a} | {_ms(_col(summ, a, 'image'))} | {_ms(_col(summ, a, 'video'))} | "
                 f"{_ms(_col(summ, a, 'real'))} |")
  return lines


def _attention_mass(summ: dict, arms: list[str]) -> list[str]:
  n_layers = len(next(iter(next(iter(summ.values())).values()))["mass"].get("image", []))
  lines = ["", "## Text->visual attention mass per layer", "",
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
  return lines


def _maps_verdict_notes(any_run: dict, seeds: list[int], table: dict, meta: dict) -> list[str]:
  return ["", "## Attention maps", "",
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
          f"Numbers: `results.json`; plots: {', '.join(f'`{p}`' for p in plots.PLOTS)}. Workdirs: "
          f"{', '.join(meta['workdirs'])}.", ""]


def write_report(sweep_dir: str, runs: dict[str, dict[int, dict]], meta: dict) -> tuple[str, list[str]]:
  """report.md and the plots of the finished `runs`. Returns (report path, plot paths)."""
  summ, table = build_tables(runs)
  arms = [a for a in meta["arms"] if a in runs]
  seeds = sorted({s for per in runs.values() for s in per})
  any_run = next(iter(next(iter(runs.values())).values()))
  src = any_run["sources"]
  lines = (_header(runs, meta, arms, seeds) + _text_stream(runs) + _final_text(summ, table, arms, src["text"])
           + _text_curves(summ, arms) + _captions(summ, arms, src) + _attention_mass(summ, arms)
           + _maps_verdict_notes(any_run, seeds, table, meta))
  path = os.path.join(sweep_dir, "report.md")
  with open(path, "w") as f:
    f.write("\n".join(lines))
  return path, plots.plot_all(sweep_dir, summ, runs, arms)
