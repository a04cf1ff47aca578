r"""Issue 19's MSA fidelity study: arms of configs/small_msa.py x seeds, retrieval evaluation, then a report.

  # GPU box (H200): every arm, 3 seeds for dense / msa_per_group / msa_shared and 1 for the rest, resumable
  python -m experiments.long_context --size=gpu --data_dir=data_long --sweep_dir=workdirs/long_context \
      --tasks=passkey,single_key,kv --task_share=0.1
  # the same on one GPU by 4 processes at once (each a quarter of the runs), then the report
  for i in 0 1 2 3; do XLA_PYTHON_CLIENT_MEM_FRACTION=0.23 python -m experiments.long_context --size=gpu \
      --data_dir=data_long --sweep_dir=workdirs/long_context --task_share=0.1 --shard=$i/4 & done; wait
  # only the report of the finished runs
  python -m experiments.long_context --size=gpu --sweep_dir=workdirs/long_context --report_only
  # a tiny CPU version (2 layers, width 64, 256 tokens; what the test runs with 2 arms, 1 seed, a few steps)
  python -m experiments.long_context --size=cpu --data_dir=data --sweep_dir=workdirs/long_context_cpu --seeds=0

Arms (`--arms`): dense (attention=dense), msa_per_group (one block selection per KV group: the default),
msa_shared (one selection per query for every group), msa_block16 / msa_block64 (finer blocks at the same token
budget: block 16 x top 128 and block 64 x top 32 against 128 x 16; on --size=cpu the same ratios to its 16 x 4),
msa_no_detach (the index branch's input not detached), dense_to_msa (dense for --convert_at of the steps, exported
as --mode=export does, then MSA from that export with indexer warmup --convert_warmup of the remaining steps).
Every (arm, seed) trains in SWEEP_DIR/{arm}_s{seed}; a finished one (its analysis.json) is reused, an interrupted
one resumes.

After each run: held-out loss per source (the final eval row of metrics.jsonl), the MSA diagnostics of the last
logged steps (msa/layer*/mass_recall, random_mass_recall, group_jaccard, kl), and, from the run's export,
retrieval accuracy per task at --lengths (default: the training length, 2x and 4x) through m3_jax.eval_long
(chunked prefill + cached decoding). SWEEP_DIR/results.json is rewritten after each run; at the end report.md,
loss_curves.png and accuracy.png, with a verdict for each of the claims (a)-(d) computed from the numbers (a
difference counts only above 2x the seed spread and the noise floor; one seed is indicative only).

Modules: sweep (arms, configs, runs), analysis (what is read and measured from a finished run), stats (summaries
and verdicts), report (results.json, report.md, plots); `python -m experiments.long_context` runs __main__.
"""
