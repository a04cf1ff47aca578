"""What the experiment drivers share.

  config   configs/*.py get_config(arg) + dotted --override KEY=VALUE items; the shared flags; the compilation cache
  sweep    (setting, seed) runs in SWEEP_DIR/{setting}_s{seed}: resume, reuse finished ones, stop on one cut short
  metrics  reading a run's metrics.jsonl (series by step, evaluations)
  training every call into the trainer, the data wiring and the models (one module to repoint when they move)
  timing   median wall time of a jitted call
"""
