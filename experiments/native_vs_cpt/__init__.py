r"""Native vs continued-pretraining (CPT) multimodal training (configs/native_vs_cpt.py): arms x seeds, then a report.

  # what `make run` runs (2-core CPU, one seed, the five arm settings, ~10 min):
  python -m experiments.native_vs_cpt --size=cpu --data_dir=data --sweep_dir=workdirs/native_vs_cpt
  # GPU box (H200), 5 arm settings x 3 seeds, resumable: split over commands by seed, then only the report
  python -m experiments.native_vs_cpt --size=gpu --data_dir=data --sweep_dir=workdirs/nvc_gpu --seeds=0,1
  python -m experiments.native_vs_cpt --size=gpu --data_dir=data --sweep_dir=workdirs/nvc_gpu --seeds=2
  # the LR control of cpt_predecay_lr0.3 (same LR change, no vision), one process per (arm, seed) fits one H200
  python -m experiments.native_vs_cpt --size=gpu --data_dir=data --sweep_dir=workdirs/nvc_gpu --seeds=0 \
      --arms=text_only_lr0.3
  python -m experiments.native_vs_cpt --size=gpu --data_dir=data --sweep_dir=workdirs/nvc_gpu --seeds=0,1,2 \
      --arms=text_only,native,cpt_decay,cpt_predecay_lr1.0,cpt_predecay_lr0.3,text_only_lr0.3 --report_only
  # data for a machine without network: prepare here (text + vision), copy DATA_DIR without raw/
  python -m experiments.native_vs_cpt --size=gpu --data_dir=data --prepare_only

Arm settings (`--arms`): text_only, native, cpt_decay, cpt_predecay_lr{S} (vision half-way through the stable phase,
LR x S from then on; default S = 1.0 and 0.3) and, optionally, text_only_lr{S} (the same LR change without vision:
separates the LR effect from the vision effect of cpt_predecay_lr{S}). Every (arm setting, seed) trains in its own
workdir SWEEP_DIR/{setting}_s{seed}; a finished one (its analysis.json) is reused, an interrupted one resumes.

After each run the driver evaluates, from the final checkpoint, the text->visual attention mass per layer over
held-out image- and video-caption batches (for each text token that can see visual tokens, the attention probability
on them; mean over heads and those queries, `m3_jax.models.multimodal.text_to_visual_mass`), and the attention
maps of a few held-out examples (caption tokens -> each visual token, per layer). SWEEP_DIR/results.json is
rewritten after every finished run; at the end come report.md and the plots text_loss.png, text_delta.png,
caption_loss.png, attention_mass.png and attention_maps.png. The verdict in report.md is computed from the numbers.

Modules: sweep (arm settings, their configs, the arms x seeds runs), analysis (what is read and measured from a
finished run), stats (summaries, paired differences, noise floor, the verdict), report (results.json, report.md),
plots (the PNGs); `python -m experiments.native_vs_cpt` runs __main__.
"""

