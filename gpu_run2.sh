python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 280 python experiments/bench_msa.py --impls=pallas --skip_check --decode_only \
  --train_seq=32768 --train_seq=131072 --out=$OUT/bench_train.json > $OUT/bench_train.log 2>&1
echo train rc=$?
timeout 140 python experiments/bench_msa.py --impls=pallas --skip_check --decode_only --kl_teachers=131072 \
  --kl_teacher_list=unroll --out=$OUT/bench_kl_unroll.json > $OUT/bench_kl_unroll.log 2>&1
echo unroll rc=$?
grep '^{' $OUT/*.log
