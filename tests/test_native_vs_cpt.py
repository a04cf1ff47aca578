"""The native-vs-CPT experiment (configs/native_vs_cpt.py, experiments/native_vs_cpt/): the mixing schedules on
the real pipeline (every arm reads the same text rows, those of the text pipeline; vision rows are extra and start
exactly at the arm's step; resume in the middle), the LR rescale in closed form, the text->visual attention mass
against a hand-computed example, the verdict on hand-made tables, and a micro smoke run of the driver.

Data are real: licence texts (text), Fashion-MNIST (images, and the sprites of synthetic-motion clips) and the real
clips, prepared into a per-session directory; package downloads are shared with the other data tests
(the `download_cache` fixture: $M3_DATA_DIR/raw, else under pytest's temp root).
"""

import hashlib
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from configs import native_vs_cpt
from experiments.native_vs_cpt import analysis, plots, stats
from m3_jax.core.batch import TEXT_KEYS
from m3_jax.data import inputs, text_pipeline
from m3_jax.data import vision_pipeline as vp
from m3_jax.models.multimodal import text_to_visual_mass
from m3_jax.train import config_lib
from m3_jax.train.metrics import read_metrics
from m3_jax.train.optimizer import OptimConfig, make_schedule, wsd_decay_start
from tests.train_utils import REPO, license_texts

# End-to-end training runs (each compiles and trains a model): the full suite only, not the fast tier.
pytestmark = pytest.mark.slow

OVERRIDES = {"data.use_builtin": False, "data.text_files": "licenses=" + ",".join(license_texts()),
             "data.vocab_size": 512, "model.vocab_size": 512, "data.mm.prepare_sources": "fashion_mnist,real_clips",
             "data.mm.max_items": "fashion_mnist=600"}
# 28 x 28 pixels, patch 7, merge 2: 4 tokens per image; 4 frames = 2 temporal patches: 8 per video
SPEC = vp.VisionSpec(height=28, width=28, patch_size=7, num_frames=4, max_images_per_row=3, max_videos_per_row=1)
SEQ, TEXT_ROWS, VISION_ROWS, STEPS = 64, 4, 2, 6
# arm -> first step with multimodal rows (None: never), as a cpt arm of a 6-step run would place them
STARTS = {"text_only": None, "native": 0, "cpt_predecay": 2, "cpt_decay": 4}


def micro_config(data_dir: str, arg: str = "arm=native"):
  c = native_vs_cpt.get_config("size=micro," + arg)
  c.data.dir = data_dir
  for k, v in OVERRIDES.items():
    node = c
    *path, last = k.split(".")
    for p in path:
      node = node[p]
    node[last] = v
  return c


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, download_cache):
  d = tmp_path_factory.mktemp("nvc_data")
  os.symlink(download_cache, d / "raw")
  inputs.prepare(micro_config(str(d)), vision=True)
  return str(d)


def arm_iter(d, start, *, seed=0, process_index=0, process_count=1):
  kw = dict(vision_weight=0.0) if start is None else dict(vision_rows=VISION_ROWS, vision_start_step=start)
  return iter(vp.make_mm_train_dataset(d, spec=SPEC, seq_len=SEQ, global_batch_size=TEXT_ROWS, seed=seed,
                                       process_index=process_index, process_count=process_count, **kw))


def has_items(b):
  return b["image_valid"].any(1) | b["video_valid"].any(1)


# ---- the mixing schedules ----------------------------------------------------------------------------------------

def test_text_rows_identical_across_arms_and_vision_from_the_configured_step(data_dir):
  ref = iter(text_pipeline.make_train_dataset(data_dir, seq_len=SEQ, global_batch_size=TEXT_ROWS, seed=0))
  want = [next(ref) for _ in range(STEPS)]
  # The text stream written out independently: sha256 chained over each step's int32 inputs, loss tokens counted.
  chain, tokens = hashlib.sha256(b"").hexdigest(), 0
  for b in want:
    chain = hashlib.sha256(bytes.fromhex(chain) + b["inputs"].astype("<i4").tobytes()).hexdigest()
    tokens += int(b["loss_mask"].sum())

  for arm, start in STARTS.items():
    it = arm_iter(data_dir, start)
    rows = TEXT_ROWS if start is None else TEXT_ROWS + VISION_ROWS
    for step in range(STEPS):
      b = next(it)
      assert b["inputs"].shape == (rows, SEQ), arm
      # the first rows are exactly the text pipeline's batch of this step
      for k in TEXT_KEYS:
        np.testing.assert_array_equal(b[k][:TEXT_ROWS], want[step][k], err_msg=f"{arm} step {step} {k}")
      np.testing.assert_array_equal(b["text_row"], np.arange(rows) < TEXT_ROWS)
      assert not has_items(b)[:TEXT_ROWS].any()
      extra = {k: v[TEXT_ROWS:] for k, v in b.items()}
      if start is not None and step >= start:
        # every multimodal row holds at least one captioned item (no text pieces in them) and some loss
        assert has_items(extra).all() and (extra["loss_mask"].sum(1) > 0).all(), (arm, step)
      elif start is not None:
        # padding rows: no token, no loss, no item, zero pixels
        assert not extra["segment_ids"].any() and not extra["loss_mask"].any() and not has_items(extra).any()
        assert not extra["inputs"].any() and not extra["images"].any() and not extra["videos"].any()
    assert it.text_stream == {"text_tokens": tokens, "text_hash": chain}, arm
    assert it.get_state()["text_hash"] == chain

  # Two processes: each reads its slice of the text pipeline and appends half of the vision rows.
  for p in range(2):
    ref = iter(text_pipeline.make_train_dataset(data_dir, seq_len=SEQ, global_batch_size=TEXT_ROWS, seed=0,
                                           process_index=p, process_count=2))
    it = arm_iter(data_dir, 1, process_index=p, process_count=2)
    for step in range(2):
      b, r = next(it), next(ref)
      assert b["inputs"].shape == (TEXT_ROWS // 2 + VISION_ROWS // 2, SEQ)
      np.testing.assert_array_equal(b["inputs"][:TEXT_ROWS // 2], r["inputs"])
      assert has_items(b)[TEXT_ROWS // 2:].all() == (step >= 1)


def test_extra_rows_resume_mid_run(data_dir):
  """A state taken mid-run (before the vision start, then after it), through JSON, continues with identical batches
  and the same text-stream count and hash."""
  for cut in (1, 3):
    it = arm_iter(data_dir, 2, seed=1)
    for _ in range(cut):
      next(it)
    state = json.loads(json.dumps(it.get_state()))
    want = [next(it) for _ in range(3)]
    again = arm_iter(data_dir, 2, seed=1)
    again.set_state(state)
    for x in want:
      y = next(again)
      assert set(x) == set(y)
      for k in x:
        np.testing.assert_array_equal(x[k], y[k], err_msg=f"cut {cut}, {k}")
    assert again.text_stream == it.text_stream


def test_modes_are_exclusive_and_errors_name_the_argument(data_dir):
  with pytest.raises(ValueError, match=r"vision_rows=2 appends .* vision_weight=0.5"):
    vp.make_mm_train_dataset(data_dir, spec=SPEC, seq_len=SEQ, global_batch_size=4, seed=0, vision_rows=2,
                             vision_weight=0.5)
  with pytest.raises(ValueError, match=r"vision_rows=3: expected an int >= 0 divisible by process_count=2"):
    vp.make_mm_train_dataset(data_dir, spec=SPEC, seq_len=SEQ, global_batch_size=4, seed=0, vision_rows=3,
                             process_count=2)
  c = micro_config(data_dir, "arm=native")
  c.data.mm.vision_weight = 0.25
  with pytest.raises(ValueError, match=r"set data.mm.vision_weight=0"):
    inputs.train_iterator(c, config_lib.vision_config(config_lib.model_config(c)))


# ---- the schedule --------------------------------------------------------------------------------------------------

def test_lr_scale_schedule_in_closed_form():
  base = dict(learning_rate=0.01, schedule="wsd", warmup_steps=10, total_steps=100, decay_fraction=0.2,
              min_lr_ratio=0.1)

  def wsd(step, scale, start):  # warmup 0 -> 0.01 over 10 steps, flat to step 80, linear to 0.001 at step 100
    lr = 0.01 * step / 10 if step < 10 else (0.01 if step < 80 else 0.01 - 0.009 * (step - 80) / 20)
    return lr * (scale if step >= start else 1.0)

  steps = [0, 5, 10, 39, 40, 41, 79, 80, 90, 99, 100]
  scaled = make_schedule(OptimConfig(**base, lr_scale=0.3, lr_scale_from=40))
  plain = make_schedule(OptimConfig(**base))
  for s in steps:
    assert float(scaled(s)) == pytest.approx(wsd(s, 0.3, 40), rel=1e-6, abs=1e-12), s
    assert float(plain(s)) == pytest.approx(wsd(s, 1.0, 0), rel=1e-6, abs=1e-12), s
  with pytest.raises(ValueError, match="optim.lr_scale=0.0 must be > 0"):
    OptimConfig(**base, lr_scale=0.0)

  # The arms of the config: vision (and the LR rescale) start where the WSD schedule says.
  for size in ("cpu", "gpu"):
    for arm, scale in (("native", 1.0), ("cpt_decay", 1.0), ("cpt_predecay", 0.3), ("text_only", 1.0)):
      c = native_vs_cpt.get_config(f"arm={arm},lr_scale={scale},size={size}")
      o = config_lib.optim_config(c)
      steps_, warm, decay = int(c.train.steps), o.warmup_steps, wsd_decay_start(o)
      assert decay == steps_ - round(0.2 * steps_) and warm == steps_ // 20
      half = warm + round(0.5 * (decay - warm))  # half-way through the stable phase
      want = {"native": 0, "cpt_decay": decay, "cpt_predecay": half, "text_only": None}[arm]
      m = c.data.mm
      assert (m.vision_start_step if m.vision_rows else None) == want, (size, arm)
      assert o.lr_scale == scale and (o.lr_scale_from == half if scale != 1.0 else True)


# ---- the attention mass ------------------------------------------------------------------------------------------

def test_attention_mass_per_layer_against_a_hand_computed_example():
  """Two batches (one row of 5 tokens each), two layers, two heads. Only text queries that can see a visual token
  of their own segment count (not visual tokens, not padding); the report's number per layer is the mean over all
  such queries of both batches, then over heads.

  Batch A: tokens [text, vis, vis, text, pad], one segment + padding: the only query is t3.
    layer 0: head 0 puts 0.2 + 0.3 = 0.5 on the visual tokens, head 1 0.1 + 0.1 = 0.2 (the padding row and t0 hold
    visual mass that must not count). layer 1: t3 spreads evenly over t0..t3: 0.5 on visual in both heads.
  Batch B: tokens [vis, text, text | vis, text], two segments: queries t1, t2 (see t0) and t4 (sees t3).
    layer 0: head 0: 0.6, 0.3, 0.9 (mean 0.6); head 1: 0.2, 0.1, 0.3 (mean 0.2).
    layer 1: even spread over what each sees: 1/2, 1/3, 1/2 (mean 4/9) in both heads.
  Layer 0: head 0 (0.5 * 1 + 0.6 * 3) / 4 = 0.575, head 1 (0.2 + 0.2 * 3) / 4 = 0.2; mean 0.3875.
  Layer 1: (0.5 * 1 + 4/9 * 3) / 4 = 11/24 in both heads.
  """
  f = np.float32
  a_vis = np.array([[0, 1, 1, 0, 0]], bool)
  a_seg = np.array([[1, 1, 1, 1, 0]])
  a0 = np.zeros((1, 2, 5, 5), f)
  a0[0, :, 0] = [1, 0, 0, 0, 0]
  a0[0, :, 1] = [0.5, 0.5, 0, 0, 0]
  a0[0, :, 2] = [0.2, 0.4, 0.4, 0, 0]
  a0[0, 0, 3] = [0.1, 0.2, 0.3, 0.4, 0]
  a0[0, 1, 3] = [0.4, 0.1, 0.1, 0.4, 0]
  a0[0, :, 4] = [0, 0.5, 0.5, 0, 0]  # padding query: excluded
  a1 = a0.copy()
  a1[0, :, 3] = [0.25, 0.25, 0.25, 0.25, 0]
  b_vis = np.array([[1, 0, 0, 1, 0]], bool)
  b_seg = np.array([[1, 1, 1, 2, 2]])
  b0 = np.zeros((1, 2, 5, 5), f)
  b0[0, :, 0] = [1, 0, 0, 0, 0]
  b0[0, 0, 1], b0[0, 1, 1] = [0.6, 0.4, 0, 0, 0], [0.2, 0.8, 0, 0, 0]
  b0[0, 0, 2], b0[0, 1, 2] = [0.3, 0.3, 0.4, 0, 0], [0.1, 0.5, 0.4, 0, 0]
  b0[0, :, 3] = [0, 0, 0, 1, 0]
  b0[0, 0, 4], b0[0, 1, 4] = [0, 0, 0, 0.9, 0.1], [0, 0, 0, 0.3, 0.7]
  b1 = b0.copy()
  b1[0, :, 1] = [0.5, 0.5, 0, 0, 0]
  b1[0, :, 2] = [1 / 3, 1 / 3, 1 / 3, 0, 0]
  b1[0, :, 4] = [0, 0, 0, 0.5, 0.5]

  masses, counts = [], []
  for layers, vis, seg in (((a0, a1), a_vis, a_seg), ((b0, b1), b_vis, b_seg)):
    per_layer = [text_to_visual_mass(p, vis, seg) for p in layers]
    masses.append(np.stack([np.asarray(m) for m, _ in per_layer]))  # [layers, heads]
    counts.append(float(per_layer[0][1]))
  assert counts == [1.0, 3.0]
  np.testing.assert_allclose(masses[0], [[0.5, 0.2], [0.5, 0.5]], rtol=1e-6)
  np.testing.assert_allclose(masses[1], [[0.6, 0.2], [4 / 9, 4 / 9]], rtol=1e-6)
  np.testing.assert_allclose(analysis.reduce_mass(masses, counts), [0.3875, 11 / 24], rtol=1e-6)

  # An example's map: the caption after a visual span attends to each visual token (mean over caption queries).
  # Row [text, <s>, vis, vis, <e>, cap, cap] (ids 40, 4, 2, 2, 5, 41, 42); queries t5, t6.
  probs = np.zeros((1, 1, 7, 7))
  probs[0, 0, 5] = [0.1, 0.1, 0.3, 0.1, 0.2, 0.2, 0]
  probs[0, 0, 6] = [0.1, 0.1, 0.1, 0.3, 0.1, 0.1, 0.2]
  m = analysis.example_map(probs, np.array([[40, 4, 2, 2, 5, 41, 42]]), np.ones((1, 7), int), 0)
  assert m["kind"] == "image"
  np.testing.assert_allclose(m["layers"], [[0.2, 0.2]])
  np.testing.assert_allclose(m["mass"], [0.4])


# ---- the verdict ---------------------------------------------------------------------------------------------------

def test_verdict_from_hand_made_tables():
  ref = {0: 3.0, 1: 3.1, 2: 2.9}

  def arm(*deltas):
    return {s: ref[s] + d for s, d in enumerate(deltas)}

  # native within noise; cpt_decay clearly worse (deltas 0.05, 0.06, 0.055: mean 0.055, std 0.005, t = 19.1);
  # predecay: the better LR flips across seeds; attention clearly higher in native.
  table = {"text_loss": {"text_only": ref, "native": arm(0.001, -0.002, 0.0005), "cpt_decay": arm(0.05, 0.06, 0.055),
                         "cpt_predecay_lr0.3": arm(0.02, 0.0, 0.03), "cpt_predecay_lr1.0": arm(0.0, 0.02, 0.01)},
           "mass": {"native": {0: 0.30, 1: 0.32, 2: 0.31}, "cpt_decay": {0: 0.05, 1: 0.06, 2: 0.04}},
           "seed_spread": 0.011}
  lines = "\n".join(stats.verdict(table))
  assert "claim 'native (vision from step 0) keeps text capability': REPRODUCES" in lines
  assert ("claim 'vision added in the LR decay degrades text': REPRODUCES. cpt_decay - text_only = +0.0550 nats "
          "(std 0.0050 over 3 seeds, t = +19.1), clear; |delta| = 5.0 x the seed-to-seed spread") in lines
  assert "ordering: native keeps text better than cpt_decay" in lines
  assert "which LR is better flips across seeds" in lines
  assert "claim 'native text tokens attend to visual tokens more than CPT-style ones': REPRODUCES" in lines
  assert "native / cpt_decay = 6.20x" in lines
  assert "ONE SEED" not in lines

  # late vision within noise; native worse beyond noise but less than cpt_decay; the LR consistently matters
  table["text_loss"].update({"native": arm(0.05, 0.06, 0.055), "cpt_decay": arm(0.1, 0.12, 0.11),
                             "cpt_predecay_lr0.3": arm(0.01, 0.012, 0.011),
                             "cpt_predecay_lr1.0": arm(0.05, 0.06, 0.055)})
  lines = "\n".join(stats.verdict(table))
  assert "keeps text capability': PARTLY REPRODUCES" in lines
  assert "the LR matters here (clear): cpt_predecay_lr0.3 keeps text better" in lines
  table["text_loss"]["cpt_decay"] = arm(0.01, -0.01, 0.005)
  table["mass"]["native"] = {0: 0.05, 1: 0.04, 2: 0.06}
  lines = "\n".join(stats.verdict(table))
  assert "degrades text': DOES NOT REPRODUCE (within noise)" in lines
  assert "keeps text capability': DOES NOT REPRODUCE" in lines
  assert "CPT-style ones': DOES NOT REPRODUCE (within noise)" in lines

  # with the LR's own control the claim is judged on vision's effect at each LR: here lr0.3 costs text through
  # the LR change alone (control +0.1) and vision adds the same small amount at both LRs -> not sensitive
  table["text_loss"].update({"text_only_lr0.3": arm(0.10, 0.11, 0.12), "cpt_predecay_lr0.3": arm(0.11, 0.12, 0.13),
                             "cpt_predecay_lr1.0": arm(0.01, 0.01, 0.01)})
  lines = "\n".join(stats.verdict(dict(table, noise_floor=0.02)))
  assert ("vision's own effect at this LR (cpt_predecay_lr0.3 - text_only_lr0.3) = +0.0100 nats (std 0.0000 over 3 "
          "seeds") in lines
  assert "the LR change alone (text_only_lr0.3 - text_only) = +0.1100 nats" in lines
  assert "sensitive to the LR': NOT sensitive to this LR change (below the numerical noise floor)" in lines
  assert "judged on vision's own effect" in lines
  # vision costs 0.063 more at lr0.3 than at lr1.0 (above the floor, every seed): the LR matters for vision
  table["text_loss"]["cpt_predecay_lr0.3"] = arm(0.18, 0.18, 0.19)
  lines = "\n".join(stats.verdict(dict(table, noise_floor=0.02)))
  assert ("the LR matters here (clear): vision costs more text at cpt_predecay_lr0.3, vision's effect at "
          "cpt_predecay_lr0.3 minus at cpt_predecay_lr1.0 = +0.0633 nats") in lines
  del table["text_loss"]["text_only_lr0.3"]

  # a difference below the numerical noise floor (vision arms vs text_only before vision starts) is noise
  table["text_loss"]["cpt_decay"] = arm(0.05, 0.06, 0.055)
  lines = "\n".join(stats.verdict(dict(table, noise_floor=0.06)))
  assert "degrades text': DOES NOT REPRODUCE (below the numerical noise floor)" in lines

  def run(start, losses):  # evaluations at steps 0, 10, 20, 30 of one text source
    return {"setting": {"vision_start_step": start, "lr_scale_from": None}, "sources": {"text": ["t"]},
            "evals": [{"step": 10 * i, "loss": {"t": x}, "tokens": {"t": 1}} for i, x in enumerate(losses)]}
  runs = {"text_only": {0: run(None, [9.0, 5.0, 4.0, 3.0])},
          "cpt_decay": {0: run(30, [9.0, 5.02, 3.99, 2.0])},  # before step 30: |0.02|, |-0.01|
          "native": {0: run(0, [9.0, 4.0, 3.0, 2.0])}}  # vision from step 0: nothing before
  assert stats.noise_floor(runs) == pytest.approx(0.02)

  # one seed: directions only, never a 'REPRODUCES'
  one = {"text_loss": {k: {0: v[0]} for k, v in table["text_loss"].items()},
         "mass": {k: {0: v[0]} for k, v in table["mass"].items()}, "seed_spread": None}
  lines = stats.verdict(one)
  assert lines[0].startswith("- ONE SEED")
  assert not any("REPRODUCES" in line for line in lines)


# ---- the driver ----------------------------------------------------------------------------------------------------

def test_driver_micro_smoke(data_dir, tmp_path):
  """Two arm settings, one seed: trains, analyses, writes results.json, report.md (every section) and the plots; the
  two runs logged the same text stream; from the vision start on cpt_predecay_lr0.3 ran at 0.3 x text_only's LR."""
  sweep = str(tmp_path / "sweep")
  cmd = [sys.executable, "-m", "experiments.native_vs_cpt", "--size=micro", "--arms=text_only,cpt_predecay_lr0.3",
         f"--data_dir={data_dir}", f"--sweep_dir={sweep}"]
  for k, v in OVERRIDES.items():
    cmd += ["--override", f"{k}={v}"]
  # XLA_FLAGS (LLVM optimisation off) is inherited from tests/conftest.py
  p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  assert "[native_vs_cpt] run 2/2: cpt_predecay_lr0.3 seed 0" in p.stdout

  with open(os.path.join(sweep, "report.md")) as f:
    report = f.read()
  for section in ("## Same text for every arm", "## Held-out text loss at the end",
                  "## Held-out text loss over training", "## Caption losses (held-out)",
                  "## Text->visual attention mass per layer", "## Attention maps",
                  "## Verdict (computed from the numbers)"):
    assert section in report, section
  assert "All arms saw exactly the same text tokens in the same order." in report
  assert "| cpt_predecay_lr0.3 | 5 | x0.3 from 5 |" in report  # 10 steps: warmup 1, decay from 8, half-way 5
  for name in plots.PLOTS:
    with open(os.path.join(sweep, name), "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n", name

  with open(os.path.join(sweep, "results.json")) as f:
    res = json.load(f)
  runs = res["runs"]
  assert sorted(runs) == ["cpt_predecay_lr0.3/s0", "text_only/s0"]
  a, b = runs["text_only/s0"], runs["cpt_predecay_lr0.3/s0"]
  assert a["text_stream"] == b["text_stream"] and len(a["text_stream"]) == 10
  for r in (a, b):
    assert [e["step"] for e in r["evals"]] == [0, 5, 10]
    for kind in ("image", "video"):
      layers = r["attention"][kind]["layers"]
      assert len(layers) == 1 and 0.0 < layers[0] < 1.0
  lr = {name: {row["step"]: row["lr"] for row in read_metrics(os.path.join(sweep, f"{name}_s0")) if "lr" in row}
        for name in ("text_only", "cpt_predecay_lr0.3")}
  for step, x in lr["text_only"].items():
    # the logged lr of step s is the schedule at s - 1 (the step counter before the update)
    factor = 0.3 if step - 1 >= 5 else 1.0
    assert lr["cpt_predecay_lr0.3"][step] == pytest.approx(factor * x, rel=1e-6), step
  assert math.isfinite(res["summary"]["cpt_predecay_lr0.3"]["0"]["text"])

  # A run that recorded fewer trained steps than the schedule (a time limit's SIGTERM) is left out of the report,
  # and the report says so, rather than being compared at an unequal text budget.
  path = os.path.join(sweep, "cpt_predecay_lr0.3_s0", "analysis.json")
  with open(path) as f:
    analysis = json.load(f)
  assert analysis["steps_trained"] == 10
  analysis["steps_trained"] = 7
  with open(path, "w") as f:
    json.dump(analysis, f)
  p = subprocess.run(cmd + ["--report_only"], cwd=REPO, capture_output=True, text=True, timeout=300,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  assert "cpt_predecay_lr0.3_s0 trained 7 of 10 steps: left out" in p.stdout
  with open(os.path.join(sweep, "report.md")) as f:
    report = f.read()
  assert "**Not finished, left out of every table and claim below:** cpt_predecay_lr0.3_s0." in report
  assert "| cpt_predecay_lr0.3 |" not in report
