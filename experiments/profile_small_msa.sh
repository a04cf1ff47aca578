#!/usr/bin/env bash
# Profile whole training steps of configs/small_msa.py (issue 18): for each NAME=ARG, train 12 steps logging every
# step, trace steps 8..10 (train.profile_steps), then summarise the trace's device time per op
# (experiments/trace_summary.py). Usage, from the repo root on the GPU box:
#   DATA=/path/to/prepared/data OUT=/tmp/out bash experiments/profile_small_msa.sh msa_g4=  dense_g4=attention=dense
set -uo pipefail
DATA=${DATA:-data}
OUT=${OUT:-/tmp/profile_small_msa}
PY=${PY:-python3}
mkdir -p "$OUT"
for spec in "$@"; do
  name=${spec%%=*}; arg=${spec#*=}
  work=/tmp/prof_$name
  rm -rf "$work"
  timeout 300 $PY -m m3_jax.main --config=configs/small_msa.py:${arg:+$arg,}steps=12 --workdir="$work" \
    --config.data.dir="$DATA" --config.train.log_every=1 --config.train.profile_steps=8,10 \
    >"$OUT/$name.log" 2>&1
  echo "== $name (rc $?): $(grep -m1 '^compiled in' "$OUT/$name.log")"
  cp "$work/metrics.jsonl" "$OUT/${name}_metrics.jsonl" 2>/dev/null
  $PY -m experiments.trace_summary "$work/profile" --steps=3 --top=25 --out="$OUT/${name}_ops.json" \
    >"$OUT/${name}_ops.txt" 2>&1
  head -12 "$OUT/${name}_ops.txt"
done
