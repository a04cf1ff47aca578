"""Sweeps of (setting, seed) runs, each in its own workdir SWEEP_DIR/{setting}_s{seed}, resumable: a finished run
(its record file written) is reused, an interrupted one resumes from its checkpoint, and a run that the trainer
stopped early (a SIGTERM: it saves and returns normally) stops the sweep instead of being reported as finished."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable

import jax

# A finished run's record (what the driver analysed); written last, atomically, so its presence means "finished".
RECORD = "analysis.json"


def workdir(sweep_dir: str, setting: str, seed: int | None) -> str:
  """SWEEP_DIR/{setting}_s{seed}, or SWEEP_DIR/{setting} when seed is None (a sweep of one seed may drop it)."""
  return os.path.join(sweep_dir, setting if seed is None else f"{setting}_s{seed}")


def write_json(path: str, obj, **kw) -> None:
  """Writes `obj` to `path` through a temporary file, so a reader never sees half a file (one per process: shards
  of a sweep rewrite the same results file)."""
  tmp = f"{path}.{os.getpid()}.tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, **kw)
  os.replace(tmp, path)


def stop_if_cut_short(trained: int, steps: int, *, tag: str, what: str, work: str) -> None:
  """SystemExit when a run holds fewer than `steps` trained steps: it must not be analysed as finished, and the sweep
  must not start the next run on a machine being taken away."""
  if trained < steps:
    raise SystemExit(f"[{tag}] {what} stopped at step {trained} of {steps} (interrupted); the same command resumes "
                     f"it from {work}")


def run_sweep(todo: list[tuple[str, int]], sweep_dir: str, run_one: Callable[[str, int, str], dict], *, tag: str,
              after_each: Callable[[], None] | None = None) -> None:
  """Runs each (setting, seed) of `todo` in its workdir, printing progress and an ETA. A run whose RECORD exists is
  reused; otherwise run_one(setting, seed, workdir) trains (resuming) and returns the run's record, which is saved
  as RECORD with its wall time ("wall_s": run_one's training and analysis). after_each() follows every new record."""
  t_sweep, done_here = time.time(), []
  for i, (setting, seed) in enumerate(todo):
    work = workdir(sweep_dir, setting, seed)
    record_path = os.path.join(work, RECORD)
    if os.path.exists(record_path):
      print(f"[{tag}] run {i + 1}/{len(todo)}: {setting} seed {seed}: finished before, reused", flush=True)
      continue
    elapsed = time.time() - t_sweep
    eta = (f", sweep ETA {statistics.fmean(done_here) * (len(todo) - i):.0f}s" if done_here else "")
    print(f"[{tag}] run {i + 1}/{len(todo)}: {setting} seed {seed} -> {work} (elapsed {elapsed:.0f}s{eta})",
          flush=True)
    t0 = time.time()
    record = run_one(setting, seed, work)
    record["wall_s"] = time.time() - t0
    write_json(record_path, record)
    done_here.append(time.time() - t0)
    if after_each is not None:
      after_each()
    print(f"[{tag}] run {i + 1}/{len(todo)}: {setting} seed {seed} done in {done_here[-1]:.0f}s "
          f"(elapsed {time.time() - t_sweep:.0f}s)", flush=True)


def load_finished(sweep_dir: str, settings: list[str], seeds: list[int], *, tag: str,
                  steps: int = 0) -> dict[str, dict[int, dict]]:
  """{setting: {seed: record}} of the finished runs; with `steps`, a run that recorded fewer trained steps
  ("steps_trained") is left out, and said so."""
  runs: dict[str, dict[int, dict]] = {}
  for setting in settings:
    for seed in seeds:
      path = os.path.join(workdir(sweep_dir, setting, seed), RECORD)
      if os.path.exists(path):
        with open(path) as f:
          record = json.load(f)
        if steps and record.get("steps_trained", steps) < steps:
          print(f"[{tag}] {setting}_s{seed} trained {record['steps_trained']} of {steps} steps: left out", flush=True)
          continue
        runs.setdefault(setting, {})[seed] = record
  return runs


def device_description(sweep_dir: str, report_only: bool) -> str:
  """"{n} x {device kind}" of this machine; a report-only command keeps the one of the sweep's earlier
  results.json, since the report is often rewritten on another machine than the one that trained."""
  device = f"{jax.device_count()} x {jax.devices()[0].device_kind}"
  old_results = os.path.join(sweep_dir, "results.json")
  if report_only and os.path.exists(old_results):
    with open(old_results) as f:
      device = json.load(f)["meta"].get("device", device)
  return device
