r"""Command line: train, evaluate or export a config.

  python -m m3_jax.main --config=configs/tiny_lm.py[:arg] --workdir=DIR [--mode=train|eval|export|aot] \
      [--config.train.steps=100] [--checkpoint=EXPORT_DIR]

Unknown `--config.*` keys are refused by ml_collections (the config is locked); the cheap consistency checks
(heads vs KV heads, mesh divisibility, a workdir holding another model, a multimodal batch whose placeholders do
not match its images) run before anything is compiled. A config with a `vision` section (configs/tiny_vlm.py)
trains, evaluates and exports the vision-language model; the others the text model.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # XLA's C++ warnings (e.g. SPMD remat notes) off by default

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file[:arg]", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "where checkpoints, metrics.jsonl and TensorBoard events go")
_MODE = flags.DEFINE_enum("mode", "train", ["train", "eval", "export", "aot"],
                          "train | eval | export (params-only) | aot (compile on a fake mesh, report memory)")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "eval: an export directory to evaluate instead of WORKDIR")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if os.environ.get("M3_JAX_DISTRIBUTED"):  # multi-process launch (README: "Multi-process launch")
    import jax  # noqa: PLC0415
    kw = {}
    if os.environ.get("M3_JAX_COORDINATOR"):  # explicit; otherwise JAX detects SLURM / Open MPI / TPU pods
      kw = dict(coordinator_address=os.environ["M3_JAX_COORDINATOR"],
                num_processes=int(os.environ["M3_JAX_NUM_PROCESSES"]),
                process_id=int(os.environ["M3_JAX_PROCESS_ID"]))
    if os.environ.get("JAX_PLATFORMS", "") == "cpu":
      jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes talk over loopback
    jax.distributed.initialize(**kw)
  config, workdir = _CONFIG.value, _WORKDIR.value
  if _MODE.value == "aot":
    from m3_jax.train import aot, config_lib  # noqa: PLC0415
    if config_lib.is_multimodal(config):
      raise app.UsageError("--mode=aot compiles text-model configs only; this config has a `vision` section")
    aot.fake_devices(int(config.get("aot_devices", 0) or 8))
    aot.compile_report(config, workdir)
    return
  from m3_jax.train import evaluation, trainer  # noqa: PLC0415  (after flag parsing: a bad flag fails fast)

  if _MODE.value == "train":
    trainer.train_and_evaluate(config, workdir)
  elif _MODE.value == "eval":
    evaluation.evaluate(config, workdir, _CHECKPOINT.value)
  else:
    evaluation.export(config, workdir)


def run() -> None:
  app.run(main)


if __name__ == "__main__":
  sys.exit(run())
