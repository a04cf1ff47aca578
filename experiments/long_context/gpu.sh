#!/usr/bin/env bash
# Issue 19's study on the GPU box: SHARDS processes of `python -m experiments.long_context --size=gpu` share one
# GPU (each a 1/SHARDS share of its memory and every SHARDS-th (arm, seed)), stopped with SIGINT after BUDGET
# seconds (an unfinished run starts again on the next call), then the report; the small outputs (report, JSON,
# plots, each run's analysis.json, metrics.jsonl and long_eval/) are packed into $OUT/long_context.tgz.
#
#   SHARDS=3 BUDGET=480 DATA=.longdata/data_long.tar.xz SWEEP=workdirs/long_context \
#       bash experiments/long_context/gpu.sh --arms=dense,msa_per_group,msa_shared --seeds=0 --task_share=0.5 ...
#
# DATA: a prepared data directory, or a .tar.xz of one (python -m m3_jax.data DIR --profile=long, packed without
# raw/), unpacked under /tmp. Every other argument goes to the driver.
set -uo pipefail
SHARDS=${SHARDS:-3}
BUDGET=${BUDGET:-480}
SWEEP=${SWEEP:-workdirs/long_context}
DATA=${DATA:?DATA= a prepared data directory or a .tar.xz of one}
PY=${PY:-python3}
if [[ "$DATA" == *.tar.xz ]]; then
  mkdir -p /tmp/lc_data && tar -C /tmp/lc_data -xJf "$DATA"
  DATA=$(dirname "$(find /tmp/lc_data -name manifest.json | head -1)")
fi
mkdir -p "$SWEEP"
frac=$($PY -c "print(round(0.92 / $SHARDS, 3))")
for ((i = 0; i < SHARDS; i++)); do
  XLA_PYTHON_CLIENT_MEM_FRACTION=$frac timeout -s INT -k 30 "$BUDGET" $PY -m experiments.long_context --size=gpu \
      --data_dir="$DATA" --sweep_dir="$SWEEP" --shard="$i/$SHARDS" "$@" >"$SWEEP/shard$i.log" 2>&1 &
done
wait
for ((i = 0; i < SHARDS; i++)); do echo "== shard $i"; grep -v "^step .*eta" "$SWEEP/shard$i.log" | tail -25; done
$PY -m experiments.long_context --size=gpu --data_dir="$DATA" --sweep_dir="$SWEEP" --report_only "$@" \
    >"$SWEEP/report.log" 2>&1
tail -60 "$SWEEP/report.log"
if [[ -n "${OUT:-}" ]]; then
  (cd "$SWEEP" && find . \( -name checkpoints -o -name export -o -name tb -o -name .jax_cache \) -prune -o -type f \
      \( -name '*.json' -o -name '*.jsonl' -o -name '*.md' -o -name '*.png' -o -name '*.log' \) -print |
      tar -czf "$OUT/long_context.tgz" -T -)
  ls -la "$OUT"
fi
