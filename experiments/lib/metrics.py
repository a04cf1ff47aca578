"""Reading a run's WORKDIR/metrics.jsonl (one JSON object per logged step, m3_jax.train.metrics.MetricWriter): the
rows, series by step, and its held-out evaluations. A resumed run logs some steps twice: where it matters the last
row of a step wins."""

from __future__ import annotations

from typing import Any

from m3_jax.train.metrics import read_metrics


def read(workdir: str) -> list[dict]:
  """Every logged row of the run, in file order ([] when it has no metrics.jsonl)."""
  return read_metrics(workdir)


def rows_by_step(rows: list[dict], key: str, *, keep_none: bool = True) -> dict[int, dict]:
  """{step: the last row of that step holding `key`}; keep_none=False also leaves out rows where `key` is None (a
  non-finite number when written)."""
  return {r["step"]: r for r in rows if key in r and (keep_none or r[key] is not None)}


def by_step(rows: list[dict], key: str, *, keep_none: bool = True) -> list[tuple[int, Any]]:
  """[(step, value of `key`)] sorted by step, the last row of a step winning (see rows_by_step)."""
  got = rows_by_step(rows, key, keep_none=keep_none)
  return [(s, got[s][key]) for s in sorted(got)]


def evals(workdir: str) -> list[dict]:
  """[{"step", "loss": {source: x}, "tokens": {source: n}}] for every evaluation of the run, by step (the rows
  holding eval/mean_loss and their eval/{source}/loss and eval/{source}/tokens)."""
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


def last_eval(workdir: str, source: str) -> dict:
  """{"step", and each eval/{source}/{name} as name} of the latest evaluation of `source`."""
  found = [r for r in read_metrics(workdir) if f"eval/{source}/loss" in r]
  if not found:
    raise RuntimeError(f"{workdir}: metrics.jsonl has no eval/{source} row")
  last = max(found, key=lambda r: r["step"])
  prefix = f"eval/{source}/"
  return {"step": last["step"], **{k.split("/", 2)[2]: v for k, v in last.items() if k.startswith(prefix)}}
