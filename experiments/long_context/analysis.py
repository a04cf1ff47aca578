"""What is read and measured from a finished run: held-out loss per source and the training curve (metrics.jsonl),
the MSA diagnostics of its last logged steps, and retrieval accuracy of its export (m3_jax.eval_long)."""

from __future__ import annotations

import math
import re

from experiments.lib import metrics
from m3_jax import eval_long

DIAGNOSTICS = ("mass_recall", "random_mass_recall", "block_recall", "group_jaccard", "kl")
# The diagnostics are one batch each: the mean of the last few logged steps is the run's end-of-training value.
LAST_LOGGED = 3
_MSA_KEY = re.compile(r"msa/layer(\d+)/(\w+)")


def loss_curve(phases: list[dict]) -> list[list]:
  """[[step, training loss]] over the run's phases (dense_to_msa's MSA phase counts on from its dense phase); a
  non-finite loss (logged as None) stays None."""
  out, offset = [], 0
  for ph in phases:
    out += [[offset + s, x] for s, x in metrics.by_step(metrics.read(ph["workdir"]), "loss")]
    offset += ph["steps"]
  return out


def msa_diagnostics(workdir: str) -> dict[str, dict[str, float]]:
  """{diagnostic: {layer: mean of its last LAST_LOGGED logged values}} of the MSA layers ({} for a dense run)."""
  rows = metrics.read(workdir)
  keys = sorted({k for r in rows for k in r if _MSA_KEY.fullmatch(k)})
  out: dict[str, dict[str, float]] = {}
  for k in keys:
    layer, name = _MSA_KEY.fullmatch(k).groups()
    vals = [v for _, v in metrics.by_step(rows, k, keep_none=False)][-LAST_LOGGED:]
    if name in DIAGNOSTICS and vals:
      out.setdefault(name, {})[layer] = sum(vals) / len(vals)
  return out


def final_eval(workdir: str) -> dict:
  """{"step", "loss": {source: x}, "mean": mean over sources} of the run's last held-out evaluation."""
  evs = metrics.evals(workdir)
  if not evs:
    raise RuntimeError(f"{workdir}: metrics.jsonl has no eval row")
  last = evs[-1]
  losses = {s: x for s, x in last["loss"].items() if x is not None}
  mean = sum(losses.values()) / len(losses) if len(losses) == len(last["loss"]) and losses else None
  return {"step": last["step"], "loss": last["loss"], "mean": mean}


def _per_length(cells: list[dict], key: str) -> dict[str, float]:
  """{str(length): the example-weighted mean of cells' `key`} over the cells where it is not None."""
  per_length: dict[int, list[float]] = {}
  for c in cells:
    if c.get(key) is not None:
      per_length.setdefault(c["length"], []).extend([c[key]] * c["n"])
  return {str(n): sum(v) / len(v) for n, v in sorted(per_length.items())}


def retrieval(export: str, *, data_dir: str, tasks: str, lengths: list[int], depths: str, samples: int,
              batch_size: int, prefill_chunk: int, loss_length: int, out: str) -> dict:
  """m3_jax.eval_long on the run's export: {"accuracy": {task: {length: x}}, "needle_selected": {task: {length:
  x}} (MSA exports; {} for dense ones), "loss_by_position": bins}. needle_selected: the share of (MSA layer, KV
  group) pairs whose selection for the last prompt position held the answer needle's blocks."""
  res = eval_long.evaluate(checkpoint=export, tasks=tasks, lengths=",".join(map(str, lengths)), depths=depths,
                           samples=samples, out=out, data_dir=data_dir, batch_size=batch_size,
                           prefill_chunk=prefill_chunk, loss_length=loss_length)
  acc = {task: _per_length(r["cells"], "accuracy") for task, r in res["tasks"].items()}
  picked = {task: m for task, r in res["tasks"].items() if (m := _per_length(r["cells"], "needle_selected"))}
  n_examples = len(res["depths"]) * samples
  return {"accuracy": acc, "needle_selected": picked, "examples_per_cell": n_examples,
          "loss_by_position": res["loss_by_position"]}


def diverged_run(phases: list[dict]) -> dict:
  """The record of a run the trainer stopped on a non-finite loss or state: its curve and diagnostics up to there,
  no held-out loss and no retrieval (there is no trained model to evaluate)."""
  work = phases[-1]["workdir"]
  return {"eval": {"step": None, "loss": {}, "mean": None}, "loss_curve": loss_curve(phases), "diverged": True,
          "msa": msa_diagnostics(work), "accuracy": {}, "needle_selected": {}, "examples_per_cell": None,
          "loss_by_position": {}}


def analyse_run(phases: list[dict], export: str, **eval_kw) -> dict:
  """The run's record: final held-out losses, the loss curve, whether training diverged (a non-finite loss), the
  MSA diagnostics and retrieval accuracy."""
  work = phases[-1]["workdir"]
  curve = loss_curve(phases)
  diverged = any(x is None or not math.isfinite(x) for _, x in curve)
  return {"eval": final_eval(work), "loss_curve": curve, "diverged": diverged, "msa": msa_diagnostics(work),
          **retrieval(export, **eval_kw)}
