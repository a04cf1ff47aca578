"""results.json, report.md and the plots (loss_curves.png, accuracy.png) from the finished runs."""

from __future__ import annotations

import os

from experiments.lib.sweep import write_json
from experiments.long_context import stats

PLOTS = ("loss_curves.png", "accuracy.png", "loss_by_position.png")


def _tables(runs: dict, meta: dict) -> dict:
  train_len = int(meta["seq_len"])
  summary = stats.summarize(runs, train_len)
  records = [r for by_seed in runs.values() for r in by_seed.values()]
  per_cell = [r["examples_per_cell"] for r in records if r.get("examples_per_cell")]  # a diverged run has none
  n_tasks = max((len(r["accuracy"]) for r in records), default=0)
  examples = min(per_cell) * n_tasks if per_cell and n_tasks else None
  floors = stats.noise_floors(summary, examples)
  lengths = sorted({int(k[4:]) for arm in summary.values() for k in arm if k.startswith("acc@")})
  return {"summary": summary, "noise_floors": floors, "examples_per_length": examples,
          "verdict": stats.verdict(summary, floors, train_len, lengths or [train_len]) if runs else []}


def write_results(sweep_dir: str, runs: dict, meta: dict) -> str:
  t = _tables(runs, meta)
  path = os.path.join(sweep_dir, "results.json")
  write_json(path, {"meta": meta, "runs": {f"{arm}/s{seed}": r for arm, by in runs.items() for seed, r in by.items()},
                    **t}, indent=1)
  return path


def _fmt(m: dict | None, digits: int = 4) -> str:
  if m is None:
    return "-"
  s = f"{m['mean']:.{digits}f}"
  return s + (f" ± {m['std']:.{digits}f}" if m["std"] is not None else "") + f" (n={m['n']})"


def _row_format(meta: dict) -> str:
  q, text = int(meta.get("task_questions", 1)), bool(meta.get("task_text_loss", False))
  placement = meta.get("task_placement", "end")
  if q == 1 and not text and placement == "end" and not meta.get("task_lengths"):
    return ""
  lengths = meta.get("task_lengths", "")
  return (f", {q} questions per row" + (", each after its needle" if placement == "interleaved" else "")
          + (f", examples of {lengths} tokens packed as segments" if lengths else "")
          + (", loss on the haystack text too" if text else ""))


def _mean(xs: list[float]) -> str:
  return f"{sum(xs) / len(xs):.3f}" if xs else "-"


def _position_table(runs: dict, arms: list[str]) -> list[str]:
  """Held-out loss per position bin (m3_jax.eval_long's loss_by_position; mean over seeds)."""
  first = next((r["loss_by_position"] for a in arms for r in runs[a].values()
                if (r.get("loss_by_position") or {}).get("bins")), None)
  if first is None:
    return []
  bins, docs = first["bins"], first.get("documents")
  L = ["", f"## Held-out loss by token position ({docs} long held-out documents, mean over seeds)", "",
       "| arm | " + " | ".join(f"{b['start']:,}-{b['end']:,}" for b in bins) + " |", "|---" * (len(bins) + 1) + "|"]
  for a in arms:
    cols = [[r["loss_by_position"]["bins"][i]["loss"] for r in runs[a].values()
             if len((r.get("loss_by_position") or {}).get("bins", [])) == len(bins)] for i in range(len(bins))]
    L.append(f"| {a} | " + " | ".join(_mean(c) for c in cols) + " |")
  return L + ["", "Loss that keeps falling with position means the model uses the longer context."]


def _needle_table(runs: dict, arms: list[str], tasks: list[str], lengths: list[int]) -> list[str]:
  """Share of (MSA layer, KV group) selections of the answering query that hold the needle's blocks."""
  have = [a for a in arms if any(r.get("needle_selected") for r in runs[a].values())]
  if not have:
    return []
  L = ["", "## Needle block selected when the answer is produced (MSA arms; mean over layers, groups, seeds)", "",
       "| arm | task | " + " | ".join(f"{n:,}" for n in lengths) + " |", "|---" * (len(lengths) + 2) + "|"]
  for a in have:
    for task in tasks:
      cells = [_mean([r["needle_selected"][task][str(n)] for r in runs[a].values()
                      if str(n) in (r.get("needle_selected") or {}).get(task, {})]) for n in lengths]
      L.append(f"| {a} | {task} | " + " | ".join(cells) + " |")
  return L


def _granularity_table(meta: dict) -> list[str]:
  """Kernel times per selection granularity (experiments.bench_msa --granularity), claim (b)'s speed half."""
  rows = meta.get("granularity") or []
  if not rows:
    return []
  L = ["", f"## Kernel time per selection granularity (one M3-shaped layer, T = {rows[0]['T']:,}, "
       f"{meta.get('granularity_device', '?')})", "",
       "| block x top-k | token budget | selection ms | sparse forward ms | training step ms | cuDNN fwd+bwd ms |",
       "|---|---|---|---|---|---|"]
  for r in rows:
    L.append(f"| {r['block_size']} x {r['topk']} | {r['budget_tokens']:,} | {r['select_ms']:.2f} | "
             f"{r['sparse_fwd_ms']:.2f} | {r['train_step_ms']:.2f} | {r['cudnn_fwd_bwd_ms']:.2f} |")
  return L


def write_report(sweep_dir: str, runs: dict, meta: dict, missing: list[str]) -> tuple[str, list[str]]:
  t = _tables(runs, meta)
  summary, floors = t["summary"], t["noise_floors"]
  arms = [a for a in meta["arms"] if a in summary]
  sources = sorted({k[5:] for a in arms for k in summary[a] if k.startswith("loss/")})
  lengths = sorted({int(k[4:]) for a in arms for k in summary[a] if k.startswith("acc@")})
  tasks = sorted({task for by in runs.values() for r in by.values() for task in r["accuracy"]})
  L = ["# MSA fidelity study (issue 19)", "",
       f"Size `{meta['size']}` on {meta['device']}: {meta['steps']} steps x batch {meta['batch_size']} x "
       f"{meta['seq_len']} tokens; task rows {meta['task_share']:.0%} ({meta['train_tasks'] or 'none'}"
       f"{_row_format(meta)}); "
       f"retrieval tasks {meta['eval_tasks']} at lengths {lengths}, depths {meta['depths']}, {meta['samples']} "
       f"samples per (task, length, depth). dense_to_msa: dense for {meta['convert_at']:.0%} of the steps, then MSA "
       f"with indexer warmup over {meta['convert_warmup']:.0%} of the rest.", ""]
  if meta.get("note"):
    L += [meta["note"], ""]
  if missing:
    L += [f"**Not finished, left out of every table and claim below:** {', '.join(missing)}.", ""]
  L += ["Numbers are mean ± std over seeds (n seeds). A difference counts only when larger than 2x the seed spread "
        "and the noise floor (the seed std of dense for losses and accuracies, of msa_per_group for the MSA "
        "diagnostics; an accuracy's floor is at least one example: 1/"
        f"{t['examples_per_length'] or '?'}).", "", "## Verdict (computed from the numbers)", "", *t["verdict"], "",
        "## Held-out loss per source (final evaluation)", "",
        "| arm | mean | " + " | ".join(sources) + " | diverged |", "|---" * (len(sources) + 3) + "|"]
  for a in arms:
    s = summary[a]
    L.append(f"| {a} | {_fmt(s.get('loss'))} | " + " | ".join(_fmt(s.get(f"loss/{x}")) for x in sources)
             + f" | {int(s['diverged']['mean'] * s['diverged']['n'])}/{s['diverged']['n']} |")
  L += ["", "## Retrieval accuracy (exact match, mean over tasks) by length", "",
        "| arm | " + " | ".join(f"{n:,}" for n in lengths) + " |", "|---" * (len(lengths) + 1) + "|"]
  for a in arms:
    L.append(f"| {a} | " + " | ".join(_fmt(summary[a].get(f"acc@{n}"), 3) for n in lengths) + " |")
  L += ["", "Per task (mean over seeds):", "", "| arm | task | " + " | ".join(f"{n:,}" for n in lengths) + " |",
        "|---" * (len(lengths) + 2) + "|"]
  for a in arms:
    for task in tasks:
      cells = []
      for n in lengths:
        xs = [r["accuracy"][task][str(n)] for r in runs[a].values() if str(n) in r["accuracy"].get(task, {})]
        cells.append(_mean(xs))
      L.append(f"| {a} | {task} | " + " | ".join(cells) + " |")
  L += _position_table(runs, arms) + _needle_table(runs, arms, tasks, lengths) + _granularity_table(meta)
  L += ["", "## MSA diagnostics (mean over MSA layers of the last logged steps)", "",
        "| arm | mass_recall | random_mass_recall | group_jaccard | kl |", "|---|---|---|---|---|"]
  for a in arms:
    s = summary[a]
    if "mass_recall" in s:
      L.append(f"| {a} | " + " | ".join(_fmt(s.get(k)) for k in ("mass_recall", "random_mass_recall", "jaccard", "kl"))
               + " |")
  L += ["", "## Noise floors", "", "| metric | floor |", "|---|---|"]
  L += [f"| {k} | {'-' if v is None else f'{v:.4f}'} |" for k, v in floors.items() if k != "diverged"]
  L += ["", "Plots: " + ", ".join(f"[{p}]({p})" for p in PLOTS), ""]
  md = os.path.join(sweep_dir, "report.md")
  with open(md, "w") as f:
    f.write("\n".join(L))
  return md, _plots(sweep_dir, runs, summary, arms, lengths)


def _plots(sweep_dir: str, runs: dict, summary: dict, arms: list[str], lengths: list[int]) -> list[str]:
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  fig, ax = plt.subplots(figsize=(7, 4))
  for i, a in enumerate(arms):
    for j, r in enumerate(runs[a].values()):
      pts = [(s, x) for s, x in r["loss_curve"] if x is not None]
      ax.plot([p[0] for p in pts], [p[1] for p in pts], color=f"C{i}", lw=1, alpha=0.8,
              label=a if j == 0 else None)
  ax.set_xlabel("step")
  ax.set_ylabel("training loss (nats)")
  ax.set_title("training loss per arm (one line per seed)")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(sweep_dir, PLOTS[0]), dpi=100)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(7, 4))
  width = 0.8 / max(1, len(arms))
  for i, a in enumerate(arms):
    ms = [summary[a].get(f"acc@{n}") for n in lengths]
    ax.bar([k + i * width for k in range(len(lengths))], [m["mean"] if m else 0.0 for m in ms], width,
           yerr=[(m["std"] or 0.0) if m else 0.0 for m in ms], label=a, color=f"C{i}")
  ax.set_xticks([k + 0.4 - width / 2 for k in range(len(lengths))], [f"{n:,}" for n in lengths])
  ax.set_xlabel("prompt length (tokens)")
  ax.set_ylabel("exact-match accuracy (mean over tasks)")
  ax.set_ylim(0, 1)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(sweep_dir, PLOTS[1]), dpi=100)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(7, 4))
  drawn = False
  for i, a in enumerate(arms):
    for j, r in enumerate(runs[a].values()):
      bins = (r.get("loss_by_position") or {}).get("bins") or []
      if bins:
        ax.semilogx([(b["start"] + b["end"]) / 2 for b in bins], [b["loss"] for b in bins], "o-", color=f"C{i}",
                    lw=1, ms=3, alpha=0.8, label=a if j == 0 else None)
        drawn = True
  ax.set_xlabel("token position (bin centre)")
  ax.set_ylabel("held-out loss (nats)")
  ax.set_title("held-out loss by position (one line per seed)" if drawn else "no loss by position was measured")
  if drawn:
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(sweep_dir, PLOTS[2]), dpi=100)
  plt.close(fig)
  return list(PLOTS)
