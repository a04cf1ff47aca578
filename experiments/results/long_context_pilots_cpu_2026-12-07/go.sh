#!/bin/bash
# usage: go.sh NAME STEPS [extra args...]; runs one dense passkey pilot, logs to /tmp/lc_helper/NAME.log
name=$1; steps=$2; shift 2
cd /work/main
start=$(date +%s)
echo "CMD: .venv/bin/python -m experiments.long_context --size=cpu --arms=dense --seeds=0 --steps=$steps --tasks=passkey --eval_tasks=passkey --data_dir=.gpudata --loss_length=-1 --sweep_dir=/tmp/lc_helper/$name $*" > /tmp/lc_helper/$name.log
.venv/bin/python -m experiments.long_context --size=cpu --arms=dense --seeds=0 --steps=$steps --tasks=passkey \
  --eval_tasks=passkey --data_dir=.gpudata --loss_length=-1 --sweep_dir=/tmp/lc_helper/$name "$@" >> /tmp/lc_helper/$name.log 2>&1
echo "WALL_S $(( $(date +%s) - start )) rc $?" >> /tmp/lc_helper/$name.log
