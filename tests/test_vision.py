"""The M3 vision tower: HF parity (tests/fixtures/hf/vl_tiny, vl_segments), 3D RoPE against closed forms,
segment masking, the Conv3d patch embedding against XLA's convolution, and the configs."""

import dataclasses
import json
import os

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from flax import nnx

from m3_jax.interop import hf
from m3_jax.interop import hf_vision as hv
from m3_jax.models.config import TextConfig, VLConfig, VisionConfig
from tests.oracles import np_rope_3d
from m3_jax.models.vision import (VisionTower, apply_rope_3d, patch_positions, rope_inv_freq_3d,
                                  segment_attention)

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
ATOL = 1e-5


@pytest.fixture(scope="module")
def hf_model():
  return hf.load(os.path.join(FIX, "vl_tiny"))


@nnx.jit(static_argnums=2)
def run(tower, pixels, max_frames=None):
  """The tower under jit: one compilation per shape instead of one per op (eager), which dominates CPU time."""
  return tower(pixels, max_frames=max_frames)


def ref(name):
  return np.load(os.path.join(FIX, name, "reference.npz"))


def tiny_vision(**kw):
  base = dict(hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=2, patch_size=2,
              temporal_patch_size=2, spatial_merge_size=2, max_frames=2, initializer_range=0.3)
  base.update(kw)
  return VisionConfig(**base)


def random_tower(cfg, seed=0):
  """A tower with every parameter random, LayerNorm scales and biases included (numpy draws: no per-shape
  compilation of random ops)."""
  tower = nnx.eval_shape(lambda: VisionTower(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(tower)
  rng = np.random.default_rng(seed)
  pure = jax.tree.map(lambda x: jnp.asarray(0.3 * rng.standard_normal(x.shape), x.dtype), nnx.to_pure_dict(state))
  for ln in [pure["pre_layernorm"]] + [b for layer in pure["layers"].values() for k, b in layer.items()
                                       if k.startswith("layer_norm")]:
    ln["weight"] = 1.0 + 0.3 * ln["weight"]
  nnx.replace_by_pure_dict(state, pure)
  return nnx.merge(graphdef, state)


# ---- HF parity -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["image", "video"])
def test_tower_and_projector_match_hf(hf_model, kind):
  model, cfg = hf_model
  r = ref("vl_tiny")
  key = "pixel_values" if kind == "image" else "pixel_values_videos"
  frames = hv.hf_patches_to_frames(r[key], r[f"{kind}_grid_thw"][0], cfg.vision)
  feats = run(model.vision_tower, jnp.asarray(frames)[None])  # [1, T, gh, gw, C]
  np.testing.assert_allclose(hv.hf_patch_order(np.asarray(feats[0]), cfg.vision.spatial_merge_size),
                             r[f"{kind}_vision_tower_output"], atol=ATOL, rtol=0)
  tokens = model.multi_modal_projector(feats)
  np.testing.assert_allclose(np.asarray(tokens[0]), r[f"{kind}_features"], atol=ATOL, rtol=0)


@pytest.mark.parametrize("max_frames", [1, 2, 4])
def test_segments_match_hf_video_chunks(hf_model, max_frames):
  """max_frames = HF's vision_segment_max_frames: an 8-frame video (4 temporal patches) in chunks of 1, 2, 4."""
  model, cfg = hf_model
  r = ref("vl_segments")
  feats = run(model.vision_tower, jnp.asarray(r["video_a"])[None], max_frames)
  got = hv.hf_patch_order(np.asarray(feats[0]), cfg.vision.spatial_merge_size)
  np.testing.assert_allclose(got, r[f"video_a_tower_mf{max_frames}"], atol=ATOL, rtol=0)
  np.testing.assert_allclose(np.asarray(model.multi_modal_projector(feats)[0]), r[f"video_a_features_mf{max_frames}"],
                             atol=ATOL, rtol=0)
  # The settings really differ (so the test can tell them apart).
  others = [np.abs(r[f"video_a_tower_mf{o}"] - got).max() for o in (1, 2, 4) if o != max_frames]
  assert min(others) > 0.1


def test_ragged_last_segment_matches_hf(hf_model):
  """6 frames = 3 temporal patches at max_frames=2: HF chunks [2, 1]; our last segment is padded and masked."""
  model, cfg = hf_model
  r = ref("vl_segments")
  np.testing.assert_array_equal(r["video_b_grid_thw_mf2"][:, 0], [2, 1])
  feats = run(model.vision_tower, jnp.asarray(r["video_b"])[None], 2)
  np.testing.assert_allclose(hv.hf_patch_order(np.asarray(feats[0]), 2), r["video_b_tower_mf2"], atol=ATOL, rtol=0)
  np.testing.assert_allclose(np.asarray(model.multi_modal_projector(feats)[0]), r["video_b_features_mf2"],
                             atol=ATOL, rtol=0)


def test_patch_layout_round_trip_and_positions_match_hf(hf_model):
  _, cfg = hf_model
  r = ref("vl_tiny")
  for kind, key in (("image", "pixel_values"), ("video", "pixel_values_videos")):
    grid = r[f"{kind}_grid_thw"][0]
    frames = hv.hf_patches_to_frames(r[key], grid, cfg.vision)
    rows, g = hv.frames_to_hf_patches(frames, cfg.vision)
    np.testing.assert_array_equal(rows, r[key])
    assert g == tuple(grid)
    # One segment holds the whole item here, so t runs 0..T-1 as in HF's get_vision_position_ids.
    pos = patch_positions(*grid, max_frames=cfg.vision.max_frames)
    np.testing.assert_array_equal(hv.hf_patch_order(pos, 2), r[f"{kind}_vision_position_ids"])


def test_segment_positions_restart_per_segment():
  pos = patch_positions(5, 2, 4, max_frames=2)
  np.testing.assert_array_equal(pos[..., 0][:, 0, 0], [0, 1, 0, 1, 0])
  np.testing.assert_array_equal(pos[3, :, :, 1], np.repeat(np.arange(2)[:, None], 4, 1))
  np.testing.assert_array_equal(pos[3, :, :, 2], np.repeat(np.arange(4)[None], 2, 0))


# ---- 3D RoPE against closed forms -------------------------------------------------------------------------------

def test_rope_3d_per_axis_closed_form():
  cfg = VisionConfig(hidden_size=80 * 2, num_attention_heads=2, intermediate_size=8, rope_theta=10000.0)
  assert (cfg.head_dim, cfg.rope_axis_dim, cfg.rotary_dim) == (80, 26, 78)  # M3's head: 2 channels pass through
  rng = np.random.default_rng(0)
  pos = np.array([[0, 0, 0], [3, 0, 0], [0, 5, 0], [0, 0, 7], [2, 9, 4]])
  x = rng.standard_normal((len(pos), 2, 80)).astype(np.float32)
  got = np.asarray(apply_rope_3d(jnp.asarray(x), jnp.asarray(pos), cfg))
  np.testing.assert_allclose(got, np_rope_3d(x, pos, cfg), atol=2e-5, rtol=0)
  np.testing.assert_array_equal(got[0], x[0])  # position (0, 0, 0) is the identity
  np.testing.assert_array_equal(got[:, :, 78:], x[:, :, 78:])
  # A move along one axis only touches that axis' channel pairs.
  for row, axis in ((1, 0), (2, 1), (3, 2)):
    moved = np.zeros(80, bool)
    for c in range(13):
      moved[[axis * 13 + c, axis * 13 + c + 39]] = True
    np.testing.assert_array_equal(got[row][:, ~moved], x[row][:, ~moved])
    assert np.abs(got[row][:, moved] - x[row][:, moved]).max() > 0.1
  np.testing.assert_allclose(rope_inv_freq_3d(cfg), 10000.0 ** (-np.arange(0, 26, 2) / 26), rtol=1e-12)


def test_rope_3d_scores_depend_on_relative_position_only():
  cfg = tiny_vision(hidden_size=36, num_attention_heads=2)
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.standard_normal((1, 1, 18)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((1, 1, 18)), jnp.float32)

  def score(pq, pk):
    a = apply_rope_3d(q, jnp.asarray([pq]), cfg)
    b = apply_rope_3d(k, jnp.asarray([pk]), cfg)
    return float(jnp.sum(a * b))

  base = score([1, 2, 3], [0, 5, 1])
  assert score([4, 3, 8], [3, 6, 6]) == pytest.approx(base, abs=1e-5)
  assert abs(score([1, 2, 3], [1, 5, 1]) - base) > 1e-3  # a different t offset changes the score


# ---- segment masking ---------------------------------------------------------------------------------------------

def video(seed, frames, h=8, w=8):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((1, frames, h, w, 3)), jnp.float32)


def test_no_attention_across_segments():
  cfg = tiny_vision(max_frames=2)
  tower = random_tower(cfg)
  x = video(0, 8)  # 4 temporal patches: segments {0, 1} and {2, 3}
  base = np.asarray(run(tower, x))
  other = np.asarray(run(tower, x.at[:, 6:].add(1.0)))  # perturb temporal patch 3 (segment 1)
  np.testing.assert_allclose(other[:, :2], base[:, :2], atol=1e-6, rtol=0)
  assert np.abs(other[:, 2] - base[:, 2]).max() > 1e-2  # same segment: attention carries it
  same = np.asarray(run(tower, x.at[:, 2:4].add(1.0)))  # perturb temporal patch 1 (segment 0)
  assert np.abs(same[:, 0] - base[:, 0]).max() > 1e-2
  np.testing.assert_allclose(same[:, 2:], base[:, 2:], atol=1e-6, rtol=0)


@pytest.mark.parametrize("max_frames,frames", [(1, 6), (3, 8)])
def test_each_segment_equals_running_it_alone(max_frames, frames):
  """max_frames=1 is per-frame attention; a ragged last segment equals that segment run as its own item."""
  cfg = tiny_vision(max_frames=max_frames)
  tower = random_tower(cfg, seed=3)
  x = video(1, frames, h=8, w=12)
  full = np.asarray(run(tower, x))
  t = frames // 2
  for start in range(0, t, max_frames):
    stop = min(start + max_frames, t)
    alone = np.asarray(run(tower, x[:, 2 * start:2 * stop]))
    # Different batch shapes round differently in f32 (~1e-6 of the output scale, ~13 here, after 2 blocks);
    # attending across segments or to padding would move outputs by ~1e-1.
    np.testing.assert_allclose(full[:, start:stop], alone, atol=5e-6 * np.abs(full).max(), rtol=0)


def test_items_do_not_interact():
  cfg = tiny_vision(max_frames=4)
  tower = random_tower(cfg, seed=4)
  a, b = video(2, 4), video(3, 4)
  both = np.asarray(run(tower, jnp.concatenate([a, b])))
  np.testing.assert_allclose(both[1:], np.asarray(run(tower, b)), atol=5e-6 * np.abs(both).max(), rtol=0)


def test_segment_attention_matches_jax_key_length_masking():
  """Our masked softmax equals jax.nn.dot_product_attention's key_value_seq_lengths (what impl='cudnn' uses)."""
  rng = np.random.default_rng(5)
  q, k, v = (jnp.asarray(rng.standard_normal((3, 10, 2, 8)), jnp.float32) for _ in range(3))
  kv_len = jnp.asarray([10, 4, 7], jnp.int32)
  want = jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=kv_len, implementation="xla")
  np.testing.assert_allclose(np.asarray(segment_attention(q, k, v, kv_len)), np.asarray(want), atol=1e-6)


def test_patch_embedding_is_a_strided_conv3d():
  cfg = tiny_vision(num_hidden_layers=1)
  tower = random_tower(cfg, seed=6)
  x = video(7, 4, h=8, w=6)
  got = tower.embed_patches(x)  # [1, T, gh, gw, d]
  w = tower.patch_embed[...]  # [tp, p, p, C, d] = DHWIO
  want = jax.lax.conv_general_dilated(x, w, window_strides=(2, 2, 2), padding="VALID",
                                      dimension_numbers=("NDHWC", "DHWIO", "NDHWC"),
                                      precision=jax.lax.Precision.HIGHEST)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


def test_remat_changes_nothing():
  cfg = tiny_vision()
  x = video(8, 6)
  a = np.asarray(run(random_tower(cfg, seed=9), x))
  b = np.asarray(run(random_tower(dataclasses.replace(cfg, remat=True), seed=9), x))
  np.testing.assert_array_equal(a, b)


def test_bad_pixels_are_named():
  tower = random_tower(tiny_vision(num_hidden_layers=1))
  with pytest.raises(ValueError, match="frames=3 must be a positive multiple of temporal_patch_size=2"):
    tower(video(0, 3))
  with pytest.raises(ValueError, match="height=6 and width=8 must be positive multiples of .* = 4"):
    tower(video(0, 2, h=6, w=8))
  with pytest.raises(ValueError, match="1 channels, expected num_channels=3"):
    tower(jnp.zeros((1, 2, 8, 8, 1)))


# ---- configs -----------------------------------------------------------------------------------------------------

def test_config_defaults_are_m3_and_hf_dict_round_trips():
  v = VisionConfig()
  assert (v.num_hidden_layers, v.hidden_size, v.num_attention_heads, v.patch_size, v.temporal_patch_size,
          v.spatial_merge_size, v.max_frames) == (32, 1280, 16, 14, 2, 2, 4)
  with open(os.path.join(FIX, "vl_tiny", "config.json")) as f:
    raw = json.load(f)
  cfg = VLConfig.from_hf_dict(raw)
  assert cfg.vision == VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                    image_size=64, patch_size=4, layer_norm_eps=1e-5, rope_theta=10000.0)
  assert cfg.text == TextConfig.from_hf_dict(raw["text_config"])
  assert (cfg.image_token_index, cfg.video_token_index, cfg.projector_hidden_size) == (250, 251, 48)
  assert cfg.merged_hidden_size == raw["merged_hidden_size"]
  assert VLConfig.from_dict(json.loads(cfg.to_json())) == cfg
  # the video processor's name for our max_frames
  assert VisionConfig.from_hf_dict({**raw["vision_config"], "vision_segment_max_frames": 2}).max_frames == 2


@pytest.mark.parametrize("kw,msg", [
    (dict(hidden_size=30, num_attention_heads=4), "hidden_size=30 is not a multiple of num_attention_heads=4"),
    (dict(hidden_size=8, num_attention_heads=2), "head_dim=4 is too small for 3D RoPE"),
    (dict(max_frames=0), "max_frames=0 must be positive"),
    (dict(hidden_act="relu"), "hidden_act='relu'"),
    (dict(attention_impl="flash"), "attention_impl='flash'"),
])
def test_vision_config_errors(kw, msg):
  with pytest.raises(ValueError, match=msg):
    VisionConfig(**kw)


def test_vl_config_errors():
  text = TextConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=8, rotary_dim=4, dense_intermediate_size=16, layer_types=["full_attention"],
                    mlp_layer_types=["dense"])
  with pytest.raises(ValueError, match=r"image_token_index=200025 is outside the text vocabulary \[0, 64\)"):
    VLConfig(text=text)
  with pytest.raises(ValueError, match="both 2"):
    VLConfig(text=text, image_token_index=2, video_token_index=2)
  with pytest.raises(ValueError, match="no 'vision_config'"):
    VLConfig.from_hf_dict({"text_config": {}})
  with pytest.raises(ValueError, match="rope_type='default'"):
    VisionConfig.from_hf_dict({"rope_parameters": {"rope_type": "default"}})
