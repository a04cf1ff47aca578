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
  try:
    _run_mode(_CONFIG.value, _WORKDIR.value)
  except Exception as e:  # noqa: BLE001
    if os.environ.get("M3_JAX_TRACEBACK") or not _is_ours(e):
      raise
    # A deliberate error of ours already says what is wrong and what to do: its traceback (and the worker threads'
    # behind it) would bury that line.
    print(f"error: {e}\n(M3_JAX_TRACEBACK=1 shows the traceback)", file=sys.stderr, flush=True)
    sys.exit(1)


_OUR_DIRS = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), d) + os.sep
                  for d in ("m3_jax", "configs", "pallas_kernels"))


def _is_ours(e: BaseException) -> bool:
  """Our named errors (checkpoint, lock, divergence, metrics writes), or a ValueError / OSError / KeyError raised
  by a line of this repository (a check with its message); an error raised inside a library keeps its traceback."""
  from m3_jax.train import checkpoint, loop, metrics  # noqa: PLC0415
  if isinstance(e, (checkpoint.CheckpointError, checkpoint.WorkdirLocked, loop.Diverged, metrics.MetricsWriteError)):
    return True
  tb = e.__traceback__
  while tb is not None and tb.tb_next is not None:
    tb = tb.tb_next
  return (isinstance(e, (ValueError, OSError, KeyError)) and tb is not None
          and os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_OUR_DIRS))


def _run_mode(config, workdir: str) -> None:
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
