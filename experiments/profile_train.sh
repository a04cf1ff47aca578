#!/usr/bin/env bash
# Throughput and a per-op profile of whole training steps, several runs side by side in one GPU call: each
# NAME=CONFIG[:ARG] [flags] trains STEPS steps through experiments.bench_train (tokens/s = median of the logged
# intervals, logging every 5 steps), traces the last steps but two (train.profile_steps), and summarises each trace's
# device time per op (experiments.trace_summary). The JSON, logs and op tables land in $OUT/profile_train.tar.gz; the
# op tables' heads are printed. DUMP_HLO=1 also keeps each run's optimised train-step HLO ($OUT/profile_train_hlo.tar)
# and names every kernel's source line in its op table (trace_summary --hlo). From the repo root on the GPU box:
#   DATA=.gpudata OUT=$OUT STEPS=30 bash experiments/profile_train.sh \
#       "cap=configs/small_lm.py:moe=True,moe_impl=capacity" "mosaic=configs/small_lm.py:moe=True,moe_impl=ragged ..."
set -uo pipefail
DATA=${DATA:-data}
OUT=${OUT:-/tmp/profile_train}
STEPS=${STEPS:-30}
RUN_TIMEOUT=${RUN_TIMEOUT:-240}
PY=${PY:-python3}
dir=$OUT/profile_train
mkdir -p "$dir"
for spec in "$@"; do
  name=${spec%%=*}; rest=${spec#*=}; config=${rest%% *}; flags=${rest#"$config"}
  case $config in *:*) config="$config,steps=$STEPS";; *) config="$config:steps=$STEPS";; esac
  hlo=(); dump=()
  if [ -n "${DUMP_HLO:-}" ]; then  # the optimised HLO of the train step, so that trace_summary names each kernel's source
    rm -rf "/tmp/profile_train/hlo_$name"
    dump=("XLA_FLAGS=${XLA_FLAGS:-} --xla_dump_to=/tmp/profile_train/hlo_$name --xla_dump_hlo_module_re=.*train_step.*")
  fi
  env "${dump[@]}" $PY -m experiments.bench_train --out="$dir/${name}_bench.json" --workroot=/tmp/profile_train \
    --run_timeout="$RUN_TIMEOUT" --run "$name=$config --config.data.dir=$DATA --config.train.log_every=5 \
--config.train.profile_steps=$((STEPS - 4)),$((STEPS - 2))$flags"
  if [ -n "${DUMP_HLO:-}" ]; then
    f=$(ls -S /tmp/profile_train/hlo_$name/*train_step*after_optimizations.txt 2>/dev/null | head -1)
    [ -n "$f" ] && hlo=(--hlo="$f") && gzip -c "$f" >"$dir/${name}_hlo.txt.gz"
  fi
  $PY -m experiments.trace_summary "/tmp/profile_train/$name/profile" --steps=3 --top=30 \
    --device="${TRACE_DEVICE:-GPU}" --out="$dir/${name}_ops.json" "${hlo[@]}" >"$dir/${name}_ops.txt" 2>&1
  echo "== $name"; head -14 "$dir/${name}_ops.txt"
done
# the HLOs in a tarball of their own: a large program's text must not push the op tables past a size limit
(cd "$dir" && ls *_hlo.txt.gz >/dev/null 2>&1 && tar -cf "$OUT/profile_train_hlo.tar" *_hlo.txt.gz && rm -f *_hlo.txt.gz)
tar -czf "$OUT/profile_train.tar.gz" -C "$OUT" profile_train && rm -rf "$dir"
