r"""Where a training step's device time goes: per-op totals from a jax.profiler trace (train.profile_steps).

  python -m experiments.trace_summary WORKDIR/profile --steps=3 [--device=GPU] [--top=40] [--out=ops.json]

Reads the Perfetto trace (`*.trace.json.gz`) that the trainer's profiler writes, keeps the events of the device
threads whose process name contains --device (the GPU streams; "CPU" reads a CPU run's XLA ops), sums their
durations per op name and per kind (our Pallas kernels, cuDNN attention, matmuls, XLA fusions, copies / memsets,
collectives, other), divides by the profiled steps, and prints a table (ms per step and share of the device
time) and writes JSON. Overlapping streams are summed, so the total can exceed the wall time of a step.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os

# kind -> substrings of op names (first match wins, in this order)
KINDS = (
    ("pallas: msa", ("msa_", "sparse_", "_fwd_kernel", "_bwd_kernel", "kv_map")),
    ("attention: cudnn", ("cudnn", "flash", "fmha", "sdpa")),
    ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "dot", "matmul")),
    ("copy / memset", ("memcpy", "memset", "copy", "transpose")),
    ("collective", ("all-reduce", "all-gather", "reduce-scatter", "nccl", "all-to-all")),
    ("fusion", ("fusion", "loop_", "input_", "reduce")),
)


def kind_of(name: str) -> str:
  low = name.lower()
  for kind, keys in KINDS:
    if any(k in low for k in keys):
      return kind
  return "other"


def load_events(profile_dir: str, device: str) -> list[dict]:
  """Complete events ("ph": "X") of the device processes of the newest trace under `profile_dir`."""
  traces = sorted(glob.glob(os.path.join(profile_dir, "**", "*.trace.json.gz"), recursive=True), key=os.path.getmtime)
  if not traces:
    raise FileNotFoundError(f"no *.trace.json.gz under {profile_dir} (run with --config.train.profile_steps=A,B)")
  with gzip.open(traces[-1], "rt") as f:
    events = json.load(f)["traceEvents"]
  names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
  pids = {pid for pid, n in names.items() if device.lower() in str(n).lower()}
  if not pids:
    raise ValueError(f"no process whose name contains {device!r} in {traces[-1]}; processes: {sorted(names.values())}")
  threads = {(e["pid"], e["tid"]): str(e["args"]["name"]) for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name" and e.get("pid") in pids}
  # A GPU process has one thread per CUDA stream (the kernels) beside "XLA Ops" / "XLA Modules" lines that repeat
  # the same time as HLO ops: count the streams only, so no interval is counted twice.
  streams = {key for key, n in threads.items() if n.lower().startswith("stream")}
  keep = (lambda e: (e.get("pid"), e.get("tid")) in streams) if streams else (lambda e: e.get("pid") in pids)
  print(f"{traces[-1]}: threads " + ", ".join(sorted({threads.get(k, '?') for k in (streams or threads)})))
  return [e for e in events if e.get("ph") == "X" and "dur" in e and keep(e)]


def summarise(events: list[dict], steps: int) -> dict:
  per_op: dict[str, float] = collections.defaultdict(float)
  count: dict[str, int] = collections.Counter()
  for e in events:
    per_op[e["name"]] += float(e["dur"]) / 1e3  # us -> ms
    count[e["name"]] += 1
  total = sum(per_op.values())
  per_kind: dict[str, float] = collections.defaultdict(float)
  for name, ms in per_op.items():
    per_kind[kind_of(name)] += ms
  ops = sorted(per_op.items(), key=lambda kv: -kv[1])
  return {"steps": steps, "device_ms_per_step": total / steps,
          "kinds": {k: {"ms_per_step": v / steps, "share": v / total} for k, v in
                    sorted(per_kind.items(), key=lambda kv: -kv[1])},
          "ops": [{"name": n, "kind": kind_of(n), "ms_per_step": v / steps, "share": v / total,
                   "calls_per_step": count[n] / steps} for n, v in ops]}


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("profile_dir")
  ap.add_argument("--steps", type=int, required=True, help="train steps in the trace (LAST - FIRST + 1)")
  ap.add_argument("--device", default="GPU", help="substring of the device processes' names")
  ap.add_argument("--top", type=int, default=40)
  ap.add_argument("--out", default="")
  args = ap.parse_args()
  if args.steps < 1:
    ap.error(f"--steps={args.steps} must be >= 1")
  res = summarise(load_events(args.profile_dir, args.device), args.steps)
  print(f"device time per step: {res['device_ms_per_step']:.2f} ms (streams summed)\n")
  print(f"{'kind':<22}{'ms/step':>10}{'share':>8}")
  for k, v in res["kinds"].items():
    print(f"{k:<22}{v['ms_per_step']:>10.2f}{100 * v['share']:>7.1f}%")
  print(f"\n{'op':<72}{'kind':<18}{'ms/step':>9}{'share':>7}{'calls':>7}")
  for o in res["ops"][:args.top]:
    print(f"{o['name'][:71]:<72}{o['kind']:<18}{o['ms_per_step']:>9.2f}{100 * o['share']:>6.1f}%"
          f"{o['calls_per_step']:>7.0f}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(res, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
  main()
