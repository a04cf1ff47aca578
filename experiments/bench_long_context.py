r"""Whole-model long-context training throughput, MSA beside dense in one call (issue 18): configs/small_msa.py at
each head layout x sequence length x attention, `m3_jax.main` for a few steps each, median tokens/s and MFU of the
logged steps after the first two, speed-up over dense, the FLOP-ideal ratio (train_flops_per_token dense / MSA:
the speed-up at equal MFU) and the share of it reached. Prints a table and writes JSON (one entry per run).

  python3 -m experiments.bench_long_context --heads=8/2 --heads=16/1 --seq=16384 --seq=32768 --seq=65536 \
      --seq=131072 --data_dir=.gpudata --out=$OUT/long_context_train_h200.json
  # a config argument for every run of one attention kind, e.g. the remat policy or packed-document masks:
  python3 -m experiments.bench_long_context ... --msa_arg=remat_policy=save_selection --common_arg=document_mask=True

A run that fails (out of memory, say) is recorded with its return code and the last lines of its log.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from experiments.lib import metrics
from experiments.lib.config import REPO
from m3_jax.models.flops import train_flops_per_token
from m3_jax.train import config_lib


def small_msa_arg(heads: str, seq: int, attention: str, steps: int, extra: str) -> str:
  return ",".join(x for x in (f"attention={attention}", f"heads={heads}", f"seq_len={seq}", f"steps={steps}", extra)
                  if x)


def flops_per_token(arg: str, seq: int) -> float:
  from configs.small_msa import get_config  # noqa: PLC0415
  return train_flops_per_token(config_lib.text_config(config_lib.model_config(get_config(arg))), seq)


def train(name: str, arg: str, args) -> dict:
  work = os.path.join(args.workroot, name)
  subprocess.run(["rm", "-rf", work], check=True)
  cmd = [sys.executable, "-m", "m3_jax.main", f"--config=configs/small_msa.py:{arg}", f"--workdir={work}",
         f"--config.data.dir={args.data_dir}", f"--config.train.log_every={args.log_every}"]
  t0 = time.time()
  try:
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.run_timeout)
    returncode, log = proc.returncode, proc.stdout + proc.stderr
  except subprocess.TimeoutExpired as e:  # the steps logged so far still count
    returncode = "timeout"
    log = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
  res = {"returncode": returncode, "wall_s": time.time() - t0}
  rows = [r for r in metrics.read(work) if "tokens_per_sec" in r] if os.path.isdir(work) else []
  steady = rows[2:] if len(rows) > 3 else rows[1:]
  if not steady:
    res["log_tail"] = log.splitlines()[-6:]
    return res
  if returncode:
    res["log_tail"] = log.splitlines()[-6:]
  res["tokens_per_sec"] = statistics.median(r["tokens_per_sec"] for r in steady)
  res["mfu"] = statistics.median(r["mfu"] for r in steady)
  res["loss_first_last"] = [rows[0]["loss"], rows[-1]["loss"]]
  peaks = [r["peak_memory_gib"] for r in rows if r.get("peak_memory_gib") is not None]
  res["peak_memory_gib"] = max(peaks) if peaks else None
  return res


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--heads", action="append", help="Q/KV heads, e.g. 8/2 (default 8/2 and 16/1)")
  ap.add_argument("--seq", type=int, action="append", help="sequence lengths (default 16K..128K)")
  ap.add_argument("--attention", default="dense,msa")
  ap.add_argument("--steps", type=int, default=20)
  ap.add_argument("--log_every", type=int, default=5)
  ap.add_argument("--common_arg", default="", help="config argument items for every run")
  ap.add_argument("--msa_arg", default="", help="config argument items for the MSA runs")
  ap.add_argument("--dense_arg", default="", help="config argument items for the dense runs")
  ap.add_argument("--data_dir", default="data")
  ap.add_argument("--workroot", default="/tmp/bench_long_context")
  ap.add_argument("--run_timeout", type=int, default=600)
  ap.add_argument("--out", default="long_context_train.json")
  args = ap.parse_args()
  import jax  # noqa: PLC0415  (after argparse: --help needs no backend)
  info = {"device": str(jax.devices()[0]), "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
          "steps": args.steps, "log_every": args.log_every, "common_arg": args.common_arg,
          "msa_arg": args.msa_arg, "dense_arg": args.dense_arg}
  entries = []
  for heads in args.heads or ["8/2", "16/1"]:
    hq, hkv = map(int, heads.split("/"))
    for seq in args.seq or [16384, 32768, 65536, 131072]:
      per = {}
      for attention in args.attention.split(","):
        extra = ",".join(x for x in (args.common_arg, args.msa_arg if attention == "msa" else args.dense_arg) if x)
        arg = small_msa_arg(heads, seq, attention, args.steps, extra)
        name = f"{attention}_{hq}x{hkv}_{seq // 1024}k"
        entry = {"heads": hq, "kv_heads": hkv, "attention": attention, "seq_len": seq, "config_arg": arg,
                 "flops_per_token": flops_per_token(arg, seq), **train(name, arg, args)}
        per[attention] = entry
        entries.append(entry)
        print(json.dumps(entry), flush=True)
        with open(args.out, "w") as f:  # after every run: a later crash or time-out loses nothing
          json.dump({"info": info, "runs": entries}, f, indent=1)
      if "dense" in per and "msa" in per:
        ratio = per["dense"]["flops_per_token"] / per["msa"]["flops_per_token"]
        for e in per.values():
          e["flop_ideal_ratio"] = ratio if e["attention"] == "msa" else 1.0
        if per["dense"].get("tokens_per_sec") and per["msa"].get("tokens_per_sec"):
          speedup = per["msa"]["tokens_per_sec"] / per["dense"]["tokens_per_sec"]
          per["msa"]["speedup_vs_dense"], per["dense"]["speedup_vs_dense"] = speedup, 1.0
          per["msa"]["share_of_ideal"] = speedup / ratio
          per["msa"]["mfu_over_dense_mfu"] = per["msa"]["mfu"] / per["dense"]["mfu"]
  print(f"\n{'heads':>6} {'seq':>7} {'attention':>9} {'tok/s':>10} {'MFU':>6} {'speed-up':>8} {'ideal':>6} "
        f"{'share':>6} {'peak GiB':>8}")
  for e in entries:
    tps = f"{e['tokens_per_sec']:,.0f}" if e.get("tokens_per_sec") else f"rc {e['returncode']}"
    mfu = f"{100 * e['mfu']:.1f}%" if e.get("mfu") else "-"
    fmt = lambda k, f="{:.2f}": f.format(e[k]) if e.get(k) is not None else "-"  # noqa: E731
    print(f"{e['heads']}/{e['kv_heads']:<4} {e['seq_len']:>7} {e['attention']:>9} {tps:>10} {mfu:>6} "
          f"{fmt('speedup_vs_dense'):>8} {fmt('flop_ideal_ratio'):>6} {fmt('share_of_ideal'):>6} "
          f"{fmt('peak_memory_gib', '{:.1f}'):>8}")
  with open(args.out, "w") as f:
    json.dump({"info": info, "runs": entries}, f, indent=1)


if __name__ == "__main__":
  main()
