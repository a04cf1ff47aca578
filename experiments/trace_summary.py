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
import re

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


_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = .*?metadata=\{([^}]*)\}")
_CALLS = re.compile(r"calls=%([\w.\-]+)")
_COMP = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \(.*\{\s*$")


def _frames(text: str) -> dict[int, str]:
  """stack_frame_id -> "file:line (function)" of the HLO text's frame tables (FileNames ... StackFrames)."""
  tables: dict[str, dict[int, str]] = {}
  current = None
  for line in text.splitlines():
    head = line.strip()
    if head in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      current = tables.setdefault(head, {})
      continue
    m = re.match(r"^(\d+) (.*)$", head) if current is not None else None
    if not m:
      current = None if not head or head.startswith(("HloModule", "%", "ENTRY")) else current
      continue
    current[int(m.group(1))] = m.group(2)
  names = {i: v.strip('"') for i, v in tables.get("FileNames", {}).items()}
  funcs = {i: v.strip('"') for i, v in tables.get("FunctionNames", {}).items()}
  where = {}
  for i, v in tables.get("FileLocations", {}).items():
    f = re.search(r"file_name_id=(\d+)", v)
    fn = re.search(r"function_name_id=(\d+)", v)
    ln = re.search(r"\bline=(\d+)", v)
    path = names.get(int(f.group(1)), "?") if f else "?"
    path = path.split("/m3_jax/")[-1] if "/m3_jax/" in path else os.path.basename(path)  # repo-relative-ish
    where[i] = f"{path}:{ln.group(1) if ln else '?'} ({funcs.get(int(fn.group(1)), '?') if fn else '?'})"
  frames = {}
  for i, v in tables.get("StackFrames", {}).items():
    loc = re.search(r"file_location_id=(\d+)", v)
    frames[i] = where.get(int(loc.group(1)), "?") if loc else "?"
  return frames


def hlo_sources(text: str) -> dict[str, dict]:
  """Kernel name (HLO instruction name, '.' -> '_') -> {"op": jax op path tail, "at": its source line,
  "inside": the distinct source lines of the instructions fused into it (fusions only)}."""
  frames = _frames(text)

  def meta(m: str) -> tuple[str, str]:
    op = re.search(r'op_name="([^"]*)"', m)
    sf = re.search(r"stack_frame_id=(\d+)", m)
    src = re.search(r'source_file="([^"]*)" source_line=(\d+)', m)  # older XLA writes the line inline
    at = frames.get(int(sf.group(1)), "?") if sf else (f"{os.path.basename(src.group(1))}:{src.group(2)}" if src
                                                          else "?")
    return ("/".join(op.group(1).split("/")[-3:]) if op else "?"), at

  lines_of: dict[str, list[str]] = collections.defaultdict(list)  # computation -> source lines inside
  instrs: list[tuple[str, str | None, str, str]] = []  # (name, called computation, op, source line)
  comp = None
  for line in text.splitlines():
    c = _COMP.match(line)
    if c:
      comp = c.group(1)
      continue
    m = _INSTR.match(line)
    if not m:
      continue
    name, md = m.groups()
    calls = _CALLS.search(line)
    calls = calls.group(1) if calls else None
    op, at = meta(md)
    if comp and at != "?" and at not in lines_of[comp]:
      lines_of[comp].append(at)
    instrs.append((name, calls, op, at))
  # a fusion's computation is printed before the instruction that calls it, so "inside" is read once all are seen
  return {name.replace(".", "_").replace("-", "_"): {"op": op, "at": at, "inside": lines_of.get(calls, [])[:6]}
          for name, calls, op, at in instrs}


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


def attribute(res: dict, sources: dict[str, dict]) -> None:
  """Adds op / at / inside to each op of `res` found in `sources`, and res["by_source"]: ms per step per source
  line (kernels not in the HLO, e.g. cuDNN's or Mosaic's inner kernels, under their own name)."""
  by: dict[str, float] = collections.defaultdict(float)
  for o in res["ops"]:
    src = sources.get(o["name"]) or sources.get(re.sub(r"_\d+$", "", o["name"]))
    if src:
      o.update(src)
    by[src["at"] if src else f"[{o['name'][:60]}]"] += o["ms_per_step"]
  total = sum(by.values()) or 1.0
  res["by_source"] = {k: {"ms_per_step": v, "share": v / total} for k, v in sorted(by.items(), key=lambda kv: -kv[1])}


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("profile_dir")
  ap.add_argument("--steps", type=int, required=True, help="train steps in the trace (LAST - FIRST + 1)")
  ap.add_argument("--device", default="GPU", help="substring of the device processes' names")
  ap.add_argument("--top", type=int, default=40)
  ap.add_argument("--out", default="")
  ap.add_argument("--hlo", default="", help="the step's optimised HLO text: name each kernel's source")
  args = ap.parse_args()
  if args.steps < 1:
    ap.error(f"--steps={args.steps} must be >= 1")
  res = summarise(load_events(args.profile_dir, args.device), args.steps)
  if args.hlo:
    with open(args.hlo) as f:
      attribute(res, hlo_sources(f.read()))
  print(f"device time per step: {res['device_ms_per_step']:.2f} ms (streams summed)\n")
  print(f"{'kind':<22}{'ms/step':>10}{'share':>8}")
  for k, v in res["kinds"].items():
    print(f"{k:<22}{v['ms_per_step']:>10.2f}{100 * v['share']:>7.1f}%")
  print(f"\n{'op':<72}{'kind':<18}{'ms/step':>9}{'share':>7}{'calls':>7}")
  for o in res["ops"][:args.top]:
    print(f"{o['name'][:71]:<72}{o['kind']:<18}{o['ms_per_step']:>9.2f}{100 * o['share']:>6.1f}%"
          f"{o['calls_per_step']:>7.0f}" + (f"  {o['op']} @ {o['at']}" if "op" in o else ""))
  if "by_source" in res:
    print(f"\n{'source line of the kernel HLO instruction':<72}{'ms/step':>9}{'share':>7}")
    for at, v in list(res["by_source"].items())[:args.top]:
      print(f"{at[:71]:<72}{v['ms_per_step']:>9.2f}{100 * v['share']:>6.1f}%")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(res, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
  main()
