"""Parity with HF transformers' MiniMax-M3 (fixtures made by tests/fixtures/make_hf_fixtures.py; no torch here)."""

import os

import numpy as np
import pytest
import jax.numpy as jnp

from m3_jax.interop import hf

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "hf")


def ref(name):
  return np.load(os.path.join(FIX, name, "reference.npz"))


def test_text_dense_logits_match_hf():
  model, cfg = hf.load(os.path.join(FIX, "text_dense"))
  r = ref("text_dense")
  logits, _ = model(jnp.asarray(r["input_ids"]))
  np.testing.assert_allclose(np.asarray(logits), r["logits"], atol=1e-4, rtol=0)
  # per-layer: the residual stream after each layer (HF's hidden_states[i + 1], last one pre-norm)
  assert cfg.rotary_dim == 8


def test_save_load_round_trip_is_lossless(tmp_path):
  model, cfg = hf.load(os.path.join(FIX, "text_dense"))
  hf.save(model, cfg, str(tmp_path / "ckpt"))
  again, cfg2 = hf.load(str(tmp_path / "ckpt"))
  assert cfg2 == cfg
  from flax import nnx
  a, b = nnx.to_pure_dict(nnx.state(model)), nnx.to_pure_dict(nnx.state(again))
  import jax
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  from m3_jax.interop import safetensors_io
  orig = safetensors_io.Checkpoint(os.path.join(FIX, "text_dense"))
  new = safetensors_io.Checkpoint(str(tmp_path / "ckpt"))
  assert sorted(orig.names) == sorted(new.names)
  for n in orig.names:
    np.testing.assert_array_equal(orig.get(n), new.get(n))


def test_missing_and_misshaped_tensors_are_named(tmp_path):
  from m3_jax.interop import safetensors_io
  src = safetensors_io.Checkpoint(os.path.join(FIX, "text_dense"))
  tensors = {n: src.get(n) for n in src.names}
  d = tmp_path / "bad"
  d.mkdir()
  import shutil
  shutil.copy(os.path.join(FIX, "text_dense", "config.json"), d / "config.json")
  t = dict(tensors)
  del t["model.layers.1.mlp.gate.weight"]
  t["model.extra.weight"] = np.zeros(3, np.float32)
  safetensors_io.write(str(d / "model.safetensors"), t)
  with pytest.raises(ValueError, match=r"(?s)missing \['model.layers.1.mlp.gate.weight'\].*unexpected \['model.extra"):
    hf.load(str(d))
  t = dict(tensors)
  t["model.layers.0.self_attn.q_proj.weight"] = np.zeros((60, 64), np.float32)
  safetensors_io.write(str(d / "model.safetensors"), t)
  with pytest.raises(ValueError, match="q_proj.weight has shape \\(60, 64\\)"):
    hf.load(str(d))


def _sorted_sets(idx):
  """Per-row selection as a sorted set with -1 last (HF's topk leaves tied +inf local slots in any order)."""
  idx = np.asarray(idx)
  big = np.where(idx < 0, np.iinfo(np.int32).max, idx)
  return np.where(np.sort(big, -1) == np.iinfo(np.int32).max, -1, np.sort(big, -1))


@pytest.mark.parametrize("name", ["text_msa", "text_msa_local2"])
def test_msa_model_matches_hf(name):
  """Sequences of 96 tokens in blocks of 8 with top-3: 75% of query rows drop blocks, so sparsity is active."""
  model, cfg = hf.load(os.path.join(FIX, name))
  r = ref(name)
  ids = jnp.asarray(r["input_ids"])
  logits, aux = model(ids)
  np.testing.assert_allclose(np.asarray(logits), r["logits"], atol=1e-4, rtol=0)
  _, cap = model(ids, capture_attention=True)
  sparse_layers = [i for i, t in enumerate(cfg.layer_types) if t == "minimax_m3_sparse"]
  assert sparse_layers
  for i in sparse_layers:
    ours = _sorted_sets(cap["block_idx"][i])
    theirs = _sorted_sets(r[f"layer{i}.indexer.block_indices"])
    np.testing.assert_array_equal(ours, theirs)
    # sparsity is active: most query rows see more blocks than they may keep
    visible_blocks = np.arange(theirs.shape[2]) // cfg.index_block_size + 1
    assert (visible_blocks > cfg.index_topk_blocks).mean() > 0.5
    if f"layer{i}.attn.input" not in r:
      continue
    # the attention layer alone, fed HF's input, matches HF's output to 1e-5
    layer = model.layers[i]
    x = jnp.asarray(r[f"layer{i}.attn.input"])
    pos = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
    y, _ = layer.self_attn(x, pos)
    np.testing.assert_allclose(np.asarray(y), r[f"layer{i}.attn.output"], atol=1e-5, rtol=0)


def test_sharded_safetensors_index_loads_the_same(tmp_path):
  import json
  import shutil
  from m3_jax.interop import safetensors_io
  src = safetensors_io.Checkpoint(os.path.join(FIX, "text_dense"))
  names = sorted(src.names)
  half = len(names) // 2
  d = tmp_path / "sharded"
  d.mkdir()
  shutil.copy(os.path.join(FIX, "text_dense", "config.json"), d / "config.json")
  weight_map = {}
  for i, part in enumerate((names[:half], names[half:])):
    fn = f"model-{i + 1:05d}-of-00002.safetensors"
    safetensors_io.write(str(d / fn), {n: src.get(n) for n in part})
    weight_map.update({n: fn for n in part})
  (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
  model, _ = hf.load(str(d))
  r = ref("text_dense")
  logits, _ = model(jnp.asarray(r["input_ids"]))
  np.testing.assert_allclose(np.asarray(logits), r["logits"], atol=1e-4, rtol=0)
