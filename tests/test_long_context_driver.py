"""experiments/long_context (issue 19's MSA study driver) end to end at its tiny CPU size: two arms x one seed train,
export and evaluate; results.json and report.md hold a verdict line per claim and the numbers of the runs' own
metrics.jsonl and retrieval evaluations; the runs are made by two shard processes at once and a third command reuses
them. The verdict rules on
hand-made tables."""

import json
import os
import subprocess
import sys

import pytest

from experiments.long_context import __main__ as main_module
from experiments.long_context import stats, sweep
from m3_jax.data import text_prepare
from m3_jax.train.metrics import read_metrics
from tests.train_utils import REPO, license_texts

OVERRIDES = {"data.use_builtin": "false", "data.text_files": "licenses=" + ",".join(license_texts()),
             "data.vocab_size": "512", "model.vocab_size": "512", "train.seq_len": "144", "train.steps": "4",
             "train.log_every": "1", "model.msa_metrics_every": "1"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("lc_data"))
  text_prepare.prepare(d, sources=(), text_files={"licenses": license_texts()}, vocab_size=512, verbose=False)
  return d


def start(argv: list[str]) -> subprocess.Popen:
  # XLA_FLAGS (LLVM optimisation off) is inherited from tests/conftest.py
  return subprocess.Popen([sys.executable, "-m", "experiments.long_context", *argv], cwd=REPO, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, JAX_PLATFORMS="cpu"))


def finish(p: subprocess.Popen) -> str:
  out, err = p.communicate(timeout=180)
  assert p.returncode == 0, out[-3000:] + err[-3000:]
  return out


def drive(argv: list[str]) -> str:
  return finish(start(argv))


def test_driver_cpu_two_arms_end_to_end(data_dir, tmp_path):
  sweep = str(tmp_path / "sweep")
  argv = ["--size=cpu", "--arms=dense,msa_per_group", "--seeds=0", f"--data_dir={data_dir}", f"--sweep_dir={sweep}",
          "--eval_tasks=passkey", "--lengths=144,288", "--depths=0,1", "--samples=1", "--eval_batch=2",
          "--prefill_chunk=144", "--loss_length=-1",
          f"--compilation_cache={os.environ.get('JAX_COMPILATION_CACHE_DIR', 'none')}"]
  for k, v in OVERRIDES.items():
    argv += ["--override", f"{k}={v}"]
  # two shards at once (as on one GPU), each one arm; then the whole sweep reuses both runs and writes the report
  shards = [start(argv + [f"--shard={i}/2"]) for i in range(2)]
  outs = [finish(p) for p in shards]
  assert "run 1/1: dense seed 0" in outs[0] and "run 1/1: msa_per_group seed 0" in outs[1]
  assert "--report_only writes the report" in outs[0] and not os.path.exists(os.path.join(sweep, "report.md"))
  out = drive(argv)
  assert out.count("finished before, reused") == 2

  with open(os.path.join(sweep, "results.json")) as f:
    res = json.load(f)
  with open(os.path.join(sweep, "report.md")) as f:
    report = f.read()
  assert sorted(res["runs"]) == ["dense/s0", "msa_per_group/s0"]
  for arm in ("dense", "msa_per_group"):
    work = os.path.join(sweep, f"{arm}_s0")
    rows = read_metrics(work)
    last_eval = max((r for r in rows if "eval/mean_loss" in r), key=lambda r: r["step"])
    got = res["summary"][arm]["loss"]
    assert got["mean"] == pytest.approx(last_eval["eval/mean_loss"], rel=1e-6) and got["std"] is None
    assert f"| {arm} | {got['mean']:.4f} (n=1) |" in report
    with open(os.path.join(work, "long_eval", "results.json")) as f:
      ev = json.load(f)
    for n in (144, 288):
      acc = [c["accuracy"] for c in ev["tasks"]["passkey"]["cells"] if c["length"] == n]
      assert res["summary"][arm][f"acc@{n}"]["mean"] == pytest.approx(sum(acc) / len(acc))
    assert [s for s, _ in res["runs"][f"{arm}/s0"]["loss_curve"]] == [1, 2, 3, 4]
  # the diagnostics are the mean of the last 3 logged values of the MSA layer (layer 1)
  jac = [v for r in read_metrics(os.path.join(sweep, "msa_per_group_s0"))
         if (v := r.get("msa/layer1/group_jaccard")) is not None]
  assert jac and res["summary"]["msa_per_group"]["jaccard"]["mean"] == pytest.approx(sum(jac[-3:]) / len(jac[-3:]))
  assert "jaccard" not in res["summary"]["dense"]

  assert res["verdict"] and all(line in report for line in res["verdict"])
  for claim in "abcd":
    assert any(line.startswith(f"- ({claim}) **") for line in res["verdict"]), claim
  # (c) from these runs' numbers, one seed; (a), (b), (d) lack their arms and say so
  c = next(line for line in res["verdict"] if line.startswith("- (c) **") and "MSA from scratch" in line)
  s = res["summary"]
  assert "(1 seed: indicative only)" in c
  assert f"loss msa_per_group {s['msa_per_group']['loss']['mean']:.4f} vs dense {s['dense']['loss']['mean']:.4f}" in c
  assert any(line.startswith("- (a) **NOT TESTED**") and "msa_shared" in line for line in res["verdict"])
  assert any(line.startswith("- (d) **NOT TESTED**") and "msa_no_detach" in line for line in res["verdict"])
  for p in ("loss_curves.png", "accuracy.png"):
    with open(os.path.join(sweep, p), "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"

  # the report alone reads the same finished runs again: the same numbers
  drive(argv + ["--report_only"])
  with open(os.path.join(sweep, "results.json")) as f:
    assert json.load(f)["summary"] == res["summary"]
  with pytest.raises(SystemExit, match="expected I/N"):
    main_module.parse_shard("1of2")


def test_cpu_model_sets_the_tiny_models_depth_and_width():
  a = main_module.parse_args(["--cpu_model=hidden_size=128,num_hidden_layers=4,head_dim=32"])
  m = sweep.make_config("cpu", "msa_per_group", 0, steps=4, data_dir="data", overrides=[], model=a.cpu_model).model
  assert (m.hidden_size, m.num_hidden_layers, m.head_dim, m.rotary_dim) == (128, 4, 32, 8)
  # the depth reaches layer_types (which --override could not): layer 0 dense, the rest the arm's
  assert tuple(m.layer_types) == ("full_attention",) + ("minimax_m3_sparse",) * 3
  assert tuple(m.mlp_layer_types) == ("dense",) * 4
  assert sweep.make_config("cpu", "dense", 0, steps=4, data_dir="data", overrides=[]).model.num_hidden_layers == 2
  for spec, match in [("width=128", "not KEY=VALUE"), ("hidden_size", "not KEY=VALUE"),
                      ("num_hidden_layers=9", "expected 1 to 8")]:
    with pytest.raises(SystemExit, match=match):
      sweep.make_config("cpu", "dense", 0, steps=4, data_dir="data", overrides=[], model=spec)
  with pytest.raises(SystemExit, match="is for --size=cpu"):
    sweep.make_config("gpu", "dense", 0, steps=4, data_dir="data", overrides=[], model="hidden_size=128")


def test_verdict_from_numbers():
  """Two seeds per arm: a difference above 2x spread counts, one below does not; one seed is flagged."""
  def run(loss, jac, acc, diverged=False):
    return {"eval": {"mean": loss, "loss": {"t": loss}}, "diverged": diverged, "accuracy": {"passkey": {"8": acc}},
            "msa": {"group_jaccard": {"1": jac}} if jac is not None else {}}
  runs = {"dense": {0: run(2.0, None, 0.5), 1: run(2.02, None, 0.5)},
          "msa_per_group": {0: run(2.01, 0.3, 0.5), 1: run(2.03, 0.32, 0.5)},
          "msa_shared": {0: run(2.5, 1.0, 0.5), 1: run(2.52, 1.0, 0.5)},
          # a diverged run has no held-out loss and no retrieval (sweep.run_arm records it without evaluating)
          "msa_no_detach": {0: {"eval": {"mean": None, "loss": {}}, "diverged": True, "accuracy": {}, "msa": {}}}}
  s = stats.summarize(runs, 8)
  floors = stats.noise_floors(s, 10)
  assert floors["loss"] == pytest.approx(s["dense"]["loss"]["std"]) and floors["acc@8"] == pytest.approx(0.1)
  lines = stats.verdict(s, floors, 8, [8])
  a, b, c, d = (next(x for x in lines if x.startswith(f"- ({k})")) for k in "abcd")
  assert "REPRODUCES: per-group is more diverse and better" in a and "indicative" not in a
  assert b.startswith("- (b) **NOT TESTED**")
  assert "REPRODUCES: MSA from scratch matches dense" in c
  assert "REPRODUCES: training without the detach diverged" in d and "1 seed: indicative only" in d
  assert "diverged in 1 of 1 seeds" in d

  # a loss difference below the dense arm's seed spread is no difference
  runs["msa_shared"] = {0: run(2.015, 1.0, 0.5), 1: run(2.035, 1.0, 0.5)}
  s = stats.summarize(runs, 8)
  a = stats.verdict(s, stats.noise_floors(s, 10), 8, [8])[0]
  assert "PARTLY: per-group is more diverse, quality the same within the threshold" in a


def test_report_tables_for_position_loss_needle_selection_and_granularity(tmp_path):
  from experiments.long_context import report  # noqa: PLC0415
  bins = lambda xs: {"documents": 3, "bins": [{"start": 1, "end": 8, "loss": xs[0]},  # noqa: E731
                                               {"start": 8, "end": 64, "loss": xs[1]}]}
  runs = {"dense": {0: {"loss_by_position": bins([4.0, 3.0])}, 1: {"loss_by_position": bins([5.0, 2.0])}},
          "msa_per_group": {0: {"loss_by_position": bins([4.5, 2.5]),
                                "needle_selected": {"passkey": {"144": 0.25, "288": 1.0}}},
                            1: {"loss_by_position": {},  # a run without the measurement is left out of the mean
                                "needle_selected": {"passkey": {"144": 0.75}}}}}
  pos = report._position_table(runs, ["dense", "msa_per_group"])
  assert "| 1-8 | 8-64 |" in pos[3] and "3 long held-out documents" in pos[1]
  assert "| dense | 4.500 | 2.500 |" in pos and "| msa_per_group | 4.500 | 2.500 |" in pos
  needle = report._needle_table(runs, ["dense", "msa_per_group"], ["passkey"], [144, 288])
  assert "| msa_per_group | passkey | 0.500 | 1.000 |" in needle and not any("| dense |" in x for x in needle)
  row = {"T": 131072, "block_size": 16, "topk": 128, "budget_tokens": 2048, "select_ms": 1.0, "sparse_fwd_ms": 2.5,
         "train_step_ms": 10.25, "cudnn_fwd_bwd_ms": 40.0}
  gran = report._granularity_table({"granularity": [row], "granularity_device": "H100"})
  assert "T = 131,072, H100" in gran[1] and "| 16 x 128 | 2,048 | 1.00 | 2.50 | 10.25 | 40.00 |" in gran
  assert report._granularity_table({}) == [] and report._needle_table({"dense": {0: {}}}, ["dense"], [], []) == []
