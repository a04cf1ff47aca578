"""The training loop end to end on real (licence) text: resume after SIGKILL, sharded == single device,
export -> eval, the NaN guard, and the errors a user gets before compilation."""

import json
import glob
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from m3_jax.data import inputs
from m3_jax.train import evaluation, trainer
from m3_jax.train.metrics import read_metrics
from tests.train_utils import REPO, small_config

# End-to-end training runs (each compiles and trains a model): the full suite only, not the fast tier.
pytestmark = pytest.mark.slow

CONFIG = os.path.join(REPO, "tests", "small_config.py")


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("data"))
  inputs.prepare(small_config(d), vision=False)
  return d


def run_main(args, env_extra=None, **kw):
  env = dict(os.environ, PYTHONUNBUFFERED="1", **(env_extra or {}))
  return subprocess.Popen([sys.executable, "-m", "m3_jax.main", *args], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def losses(workdir):
  """Per-step train loss; a step logged twice (before a crash and after the resume) keeps its last value."""
  out = {}
  for row in read_metrics(workdir):
    if "loss" in row:
      out[row["step"]] = row["loss"]
  return out


def test_resume_after_sigkill_gives_identical_losses(data_dir, tmp_path):
  steps = 40
  flags = [f"--config={CONFIG}:{data_dir}", f"--config.train.steps={steps}", "--config.checkpoint.every=5"]
  ref_dir, crash_dir = str(tmp_path / "ref"), str(tmp_path / "crash")
  ref = run_main(flags + [f"--workdir={ref_dir}"])
  out, _ = ref.communicate(timeout=600)
  assert ref.returncode == 0, out
  proc = run_main(flags + [f"--workdir={crash_dir}"])
  first = os.path.join(crash_dir, "checkpoints", "10")
  t0 = time.time()
  while not os.path.isdir(first) and proc.poll() is None and time.time() - t0 < 300:
    time.sleep(0.02)
  proc.send_signal(signal.SIGKILL)
  proc.communicate()
  assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
  killed_at = max(losses(crash_dir))
  assert killed_at < steps
  again = run_main(flags + [f"--workdir={crash_dir}"])
  out, _ = again.communicate(timeout=600)
  assert again.returncode == 0, out
  assert "resumed from step" in out
  a, b = losses(ref_dir), losses(crash_dir)
  assert sorted(a) == sorted(b) and max(a) == steps
  np.testing.assert_allclose([b[s] for s in sorted(b)], [a[s] for s in sorted(a)], rtol=1e-6)


def test_eight_device_mesh_matches_one_device_and_restores_across_meshes(data_dir, tmp_path):
  steps = 3
  mesh_flags = ["--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2"]
  flags = [f"--config={CONFIG}:{data_dir}", f"--config.train.steps={steps}", f"--config.train.eval_every={steps}"]
  sharded = str(tmp_path / "sharded")
  p = run_main(flags + mesh_flags + [f"--workdir={sharded}"],
               env_extra={"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"})
  out, _ = p.communicate(timeout=600)
  assert p.returncode == 0, out
  assert "mesh {'data': 2, 'fsdp': 2, 'tensor': 2, 'expert': 1, 'context': 1} on 8" in out
  single = str(tmp_path / "single")
  cfg = small_config(data_dir, **{"train.steps": steps, "train.eval_every": steps})
  trainer.train_and_evaluate(cfg, single)
  a, b = losses(sharded), losses(single)
  assert sorted(a) == [1, 2, 3]
  np.testing.assert_allclose([a[s] for s in (1, 2, 3)], [b[s] for s in (1, 2, 3)], rtol=2e-5)
  # the 8-device checkpoint restored onto this process's 1-device mesh evaluates to the same held-out loss
  sharded_eval = [r for r in read_metrics(sharded) if "eval/licenses/loss" in r][-1]["eval/licenses/loss"]
  ev = evaluation.evaluate(cfg, sharded)
  assert ev["eval/licenses/loss"] == pytest.approx(sharded_eval, rel=2e-5)


def test_export_is_loadable_by_eval(data_dir, tmp_path):
  cfg = small_config(data_dir, **{"train.steps": 2})
  work = str(tmp_path / "w")
  trainer.train_and_evaluate(cfg, work)
  full = evaluation.evaluate(cfg, work)
  path = evaluation.export(cfg, work)
  assert sorted(os.listdir(path)) == ["model_config.json", "params"]
  with open(os.path.join(path, "model_config.json")) as f:
    assert json.load(f)["hidden_size"] == 32
  exported = evaluation.evaluate(cfg, str(tmp_path / "eval_of_export"), checkpoint=path)
  # bf16 export: the same model up to bf16 rounding of the weights
  assert exported["eval/licenses/loss"] == pytest.approx(full["eval/licenses/loss"], abs=0.02)
  assert exported["eval/licenses/loss"] != full["eval/licenses/loss"]


def test_nan_guard_stops_and_keeps_last_good_checkpoint(data_dir, tmp_path):
  cfg = small_config(data_dir, **{"train.steps": 6, "checkpoint.every": 1, "optim.learning_rate": 1e38,
                                  "optim.grad_clip": 0.0, "optim.warmup_steps": 0})
  work = str(tmp_path / "nan")
  with pytest.raises(FloatingPointError, match=r"non-finite loss/grad at step (\d).*last good checkpoint is step"):
    trainer.train_and_evaluate(cfg, work)
  saved = sorted(int(s) for s in os.listdir(os.path.join(work, "checkpoints")) if s.isdigit())
  bad = max(losses(work)) if losses(work) else None
  assert saved and (bad is None or max(saved) < bad + 1)


def test_clear_errors_before_compilation(data_dir, tmp_path):
  p = run_main([f"--config={CONFIG}:{data_dir}", "--config.train.stepz=3", f"--workdir={tmp_path}/x"])
  out, _ = p.communicate(timeout=120)
  assert p.returncode != 0 and "stepz" in out
  with pytest.raises(ValueError, match="not a multiple of num_key_value_heads"):
    trainer.train_and_evaluate(small_config(data_dir, **{"model.num_key_value_heads": 3}), str(tmp_path / "h"))
  with pytest.raises(ValueError, match="need 3 devices"):
    trainer.train_and_evaluate(small_config(data_dir, **{"mesh.tensor": 3, "mesh.data": 1}), str(tmp_path / "m"))
  work = str(tmp_path / "shape")
  trainer.train_and_evaluate(small_config(data_dir, **{"train.steps": 1}), work)
  with pytest.raises(ValueError, match="different model.*hidden_size: 32 -> 64"):
    trainer.train_and_evaluate(small_config(data_dir, **{"train.steps": 2, "model.hidden_size": 64}), work)


def test_aot_mode_reports_bytes_per_device_on_a_fake_mesh(tmp_path):
  """configs/m3.py (the real widths; 2 of the 60 layers to keep CI short) on 8 fake devices."""
  work = str(tmp_path / "aot")
  p = run_main(["--config=configs/m3.py:dense_attention=True,layers=2,devices=8,fsdp=2,tensor=2,expert=2",
                f"--workdir={work}", "--mode=aot"])
  out, _ = p.communicate(timeout=600)
  assert p.returncode == 0, out
  with open(os.path.join(work, "aot_report.json")) as f:
    rep = json.load(f)
  assert rep["devices"] == 8 and rep["mesh"] == {"data": 1, "fsdp": 2, "tensor": 2, "expert": 2, "context": 1}
  # every M3 weight divides over its axes here, so each device holds between 1/8 and 1/2 of the f32 params
  assert rep["param_bytes_global"] == 4 * rep["params_total"]
  assert rep["param_bytes_global"] / 8 <= rep["param_bytes_per_device"] <= rep["param_bytes_global"] / 2
  assert rep["compiled_temp_bytes_per_device"] > 0


def test_generate_cli_streams_from_an_export(data_dir, tmp_path):
  cfg = small_config(data_dir, **{"train.steps": 2})
  work = str(tmp_path / "g")
  trainer.train_and_evaluate(cfg, work)
  path = evaluation.export(cfg, work)
  p = subprocess.run([sys.executable, "-m", "m3_jax.generate", f"--checkpoint={path}", "--prompt=The licence",
                      "--max_new_tokens=8", f"--tokenizer={data_dir}/tokenizer.json"],
                     cwd=REPO, capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stdout + p.stderr
  assert p.stdout.startswith("The licence") and len(p.stdout.strip()) > len("The licence")


def test_resume_may_change_switches_that_keep_parameter_shapes(data_dir, tmp_path):
  work = str(tmp_path / "switch")
  trainer.train_and_evaluate(small_config(data_dir, **{"train.steps": 1}), work)
  trainer.train_and_evaluate(small_config(data_dir, **{"train.steps": 2, "model.remat": True,
                                                       "model.moe_impl": "dense"}), work)
  assert max(losses(work)) == 2


def test_plot_run_writes_a_png(tmp_path):
  from m3_jax.train.metrics import MetricWriter
  sys.path.insert(0, os.path.join(REPO, "experiments"))
  import plot_run
  w = MetricWriter(str(tmp_path), tensorboard=False)
  for s in range(1, 6):
    w.write(s, {"loss": 5.0 - 0.1 * s, "lr": 1e-3, "grad_norm": 1.0, "kl_loss": 0.5 / s,
                "msa/layer1/mass_recall": 0.6, "msa/layer1/random_mass_recall": 0.4})
  w.write(5, {"eval/text/loss": 4.0})
  out = plot_run.plot(str(tmp_path))
  with open(out, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_dense_to_msa_conversion_run(data_dir, tmp_path, capsys):
  """MSA-CPT through the trainer: dense run -> export -> MSA run initialised from it (warmup, then sparse)."""
  dense = small_config(data_dir, **{"train.steps": 2})
  trainer.train_and_evaluate(dense, str(tmp_path / "dense"))
  dense.export.dtype = ""
  path = evaluation.export(dense, str(tmp_path / "dense"))
  msa = small_config(data_dir, **{"train.steps": 4, "init_from": path, "model.layer_types":
                                  ("full_attention", "minimax_m3_sparse"), "model.index_n_heads": 2,
                                  "model.index_head_dim": 8, "model.index_block_size": 8,
                                  "model.index_topk_blocks": 2, "model.warmup_steps": 2})
  trainer.train_and_evaluate(msa, str(tmp_path / "msa"))
  out = capsys.readouterr().out
  assert "initialised" in out and "indexer" in out
  rows = [r for r in read_metrics(str(tmp_path / "msa")) if "kl_loss" in r]
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  assert all(r["kl_loss"] > 0 and "msa/layer1/mass_recall" in r for r in rows)


def test_two_processes_match_one_and_share_checkpoints(data_dir, tmp_path):
  """jax.distributed on CPU (gloo over loopback): 2 processes, each feeding its half of the batch, give the same
  losses as one process; both write the checkpoint and both restore it to continue."""
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  work = str(tmp_path / "mp")

  def launch(steps):
    procs = [run_main([f"--config={CONFIG}:{data_dir}", f"--workdir={work}", f"--config.train.steps={steps}"],
                      env_extra={"M3_JAX_DISTRIBUTED": "1", "M3_JAX_COORDINATOR": f"127.0.0.1:{port}",
                                 "M3_JAX_NUM_PROCESSES": "2", "M3_JAX_PROCESS_ID": str(i), "JAX_PLATFORMS": "cpu"})
             for i in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    return outs

  launch(4)
  outs = launch(6)
  assert "resumed from step 4" in outs[0]
  single = str(tmp_path / "single")  # the same two launches (the cosine schedule follows train.steps)
  trainer.train_and_evaluate(small_config(data_dir, **{"train.steps": 4}), single)
  trainer.train_and_evaluate(small_config(data_dir, **{"train.steps": 6}), single)
  a, b = losses(work), losses(single)
  assert sorted(a) == list(range(1, 7))
  np.testing.assert_allclose([a[s] for s in sorted(a)], [b[s] for s in sorted(b)], rtol=1e-5)


def test_profile_steps_write_a_trace_and_leave_the_losses_alone(data_dir, tmp_path):
  """train.profile_steps=2,3 writes a trace (an xplane file for TensorBoard / xprof and a Perfetto JSON) and the
  run's losses equal an untraced run's; a bad spec is refused before the workdir is touched."""
  plain, traced = str(tmp_path / "plain"), str(tmp_path / "traced")
  trainer.train_and_evaluate(small_config(data_dir, **{"train.steps": 4}), plain)
  trainer.train_and_evaluate(small_config(data_dir, **{"train.steps": 4, "train.profile_steps": "2,3"}), traced)
  assert losses(traced) == losses(plain)
  found = {os.path.basename(f) for f in glob.glob(os.path.join(traced, "profile", "**", "*"), recursive=True)}
  assert any(f.endswith(".xplane.pb") for f in found), found
  assert any(f.endswith("trace.json.gz") for f in found), found
  for spec in ("3,2", "0,1", "a,b"):
    with pytest.raises(ValueError, match="train.profile_steps"):
      trainer.train_and_evaluate(small_config(data_dir, **{"train.profile_steps": spec}), str(tmp_path / "bad"))
  assert not os.path.exists(tmp_path / "bad" / "profile")
