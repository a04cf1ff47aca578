"""HF checkpoints in and out through the public API exactly as named: `load(path)` and `model(input_ids)`.

The references are HF transformers' own outputs (tests/fixtures/make_hf_random_checks.py: tiny random MiniMax-M3
models with other configs and seeds than make_hf_fixtures.py, saved by save_pretrained; no torch here).
"""

import functools
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from m3_jax.interop import safetensors_io
from m3_jax.interop.hf import load, read_config, save
from m3_jax.models import decode

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(REPO, "tests", "fixtures", "hf")
CHECKS = ["random_gqa4", "random_mha_sharded", "random_legacy", "random_vl"]
TEXT_ONLY = {"random_vl": True}  # a minimax_m3_vl checkpoint: its vision tensors are dropped on request only


def fixture(name):
  return os.path.join(FIX, name)


def meta(name):
  with open(os.path.join(fixture(name), "meta.json")) as f:
    return json.load(f)


@functools.lru_cache(maxsize=None)
def loaded(name):
  return load(fixture(name), text_only=TEXT_ONLY.get(name, False))


def pure(model):
  return nnx.to_pure_dict(nnx.state(model))


def assert_same_params(a, b):
  fa, fb = jax.tree_util.tree_flatten_with_path(pure(a))[0], jax.tree_util.tree_flatten_with_path(pure(b))[0]
  assert [p for p, _ in fa] == [p for p, _ in fb]
  for (path, x), (_, y) in zip(fa, fb):
    assert x.dtype == y.dtype, path
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


# ---- parity with HF ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", CHECKS)
def test_logits_match_hf(name):
  model, cfg = loaded(name)
  r = np.load(os.path.join(fixture(name), "reference.npz"))
  ids = r["input_ids"]  # int64 numpy [B, T], passed as it comes
  logits, aux = model(ids)
  assert logits.shape == r["logits"].shape == ids.shape + (cfg.vocab_size,)
  diff = float(np.max(np.abs(np.asarray(logits) - r["logits"])))
  print(f"{name}: max |ours - HF| = {diff:.2e}")
  assert diff <= 1e-4
  # Sparsity is active: most query rows see more blocks than they may keep, and HF's logits move by far more than
  # the tolerance when the same weights attend densely, so ignoring the selection could not pass.
  if "minimax_m3_sparse" in cfg.layer_types:
    visible = np.arange(ids.shape[1]) // cfg.index_block_size + 1
    assert (visible > cfg.index_topk_blocks).mean() > 0.5
    assert meta(name)["max_abs_logit_change_if_all_layers_were_full_attention"] > 0.5
  assert "sparse" in cfg.mlp_layer_types


def test_greedy_generation_matches_hf():
  r = np.load(os.path.join(fixture("random_mha_sharded"), "reference.npz"))
  model, cfg = loaded("random_mha_sharded")
  new = r["gen_new_ids"]
  # the prompt ends inside block 2 and generation crosses into block 3 (blocks of 16): the index-key cache is used
  assert r["gen_prompt_ids"].shape[1] // cfg.index_block_size < (r["gen_prompt_ids"].shape[1] + new.shape[1] - 1) \
      // cfg.index_block_size
  got = decode.generate(model, jnp.asarray(r["gen_prompt_ids"], jnp.int32), max_new_tokens=new.shape[1])
  np.testing.assert_array_equal(np.asarray(got), new)


# ---- config.json ------------------------------------------------------------------------------------------------

def _compare_to_hf(cfg, resolved, rotary, theta, where):
  for k, v in resolved.items():
    if k == "rope_parameters":
      continue
    got = list(getattr(cfg, k)) if isinstance(v, list) else getattr(cfg, k)
    assert got == v, f"{where}: {k} = {got!r}, HF resolves {v!r}"
  assert cfg.rotary_dim == rotary, where
  assert cfg.rope_theta == theta, where


@pytest.mark.parametrize("name", CHECKS)
def test_config_resolves_like_hf(name):
  m = meta(name)
  cfg = read_config(fixture(name))
  rope = m["hf_resolved_text_config"]["rope_parameters"]
  _compare_to_hf(cfg, m["hf_resolved_text_config"], m["hf_rotary_dim"], rope["rope_theta"], name)


def test_config_cases_resolve_like_hf():
  """Legacy names, RoPE precedence and defaults, each resolved by HF's own config classes."""
  with open(os.path.join(FIX, "random_config_resolution.json")) as f:
    cases = json.load(f)["cases"]
  assert len(cases) >= 9
  for name, case in cases.items():
    cfg = read_config(case["config_json"])
    _compare_to_hf(cfg, case["hf_resolved"], case["hf_rotary_dim"], case["hf_rope_theta"], name)


def test_unsupported_config_is_refused():
  base = {"model_type": "minimax_m3_vl_text", "num_hidden_layers": 1, "head_dim": 16}
  with pytest.raises(ValueError, match="rope_type 'yarn' is not supported"):
    read_config({**base, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}})
  with pytest.raises(ValueError, match="model_type 'llama' is not a MiniMax-M3 model"):
    read_config({**base, "model_type": "llama"})
  with pytest.raises(ValueError, match="num_experts=8 and num_local_experts=16 disagree"):
    read_config({**base, "num_experts": 8, "num_local_experts": 16})


# ---- save / load round trips ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["random_gqa4", "random_mha_sharded", "random_vl"])
def test_load_save_load_is_lossless(name, tmp_path):
  """hf (single file), hf (sharded index) and MiniMax's release layout (VL): saving writes HF's text layout with
  exactly the tensors HF holds in memory, and loading that gives the same parameters back."""
  model, cfg = loaded(name)
  out = str(tmp_path / "ckpt")
  save(model, cfg, out)
  again, cfg2 = load(out)
  assert cfg2 == cfg
  assert_same_params(model, again)
  src, new = safetensors_io.Checkpoint(fixture(name)), safetensors_io.Checkpoint(out)
  if name == "random_vl":  # release layout: per-expert / split tensors are merged the way HF merges them
    pre = "language_model.model.layers.1."
    w1 = np.stack([src.get(f"{pre}block_sparse_moe.experts.{e}.w1.weight") for e in range(cfg.num_local_experts)])
    w3 = np.stack([src.get(f"{pre}block_sparse_moe.experts.{e}.w3.weight") for e in range(cfg.num_local_experts)])
    np.testing.assert_array_equal(new.get("model.layers.1.mlp.experts.gate_up_proj"),
                                  np.concatenate([w1, w3], axis=1))
    np.testing.assert_array_equal(new.get("model.layers.0.mlp.gate_up_proj.weight"), np.concatenate(
        [src.get("language_model.model.layers.0.mlp.gate_proj.weight"),
         src.get("language_model.model.layers.0.mlp.up_proj.weight")]))
    np.testing.assert_array_equal(new.get("model.layers.1.self_attn.indexer.q_proj.weight"),
                                  src.get("language_model.model.layers.1.self_attn.index_q_proj.weight"))
    np.testing.assert_array_equal(new.get("lm_head.weight"), src.get("language_model.lm_head.weight"))
  else:  # HF's own names: byte-identical tensors
    assert sorted(src.names) == sorted(new.names)
    for n in src.names:
      np.testing.assert_array_equal(src.get(n), new.get(n))


def test_save_sharded_index_and_dtype(tmp_path):
  model, cfg = loaded("random_gqa4")
  out = tmp_path / "sharded"
  save(model, cfg, str(out), max_shard_size=30_000)
  with open(out / "model.safetensors.index.json") as f:
    index = json.load(f)
  files = sorted(set(index["weight_map"].values()))
  assert len(files) > 3 and files == sorted(p.name for p in out.glob("model-*-of-*.safetensors"))
  assert not (out / "model.safetensors").exists()
  again, _ = load(str(out))
  assert_same_params(model, again)
  # bf16 on disk: dtype=None keeps it (HF's dtype="auto"), dtype="float32" upcasts
  save(model, cfg, str(tmp_path / "bf16"), dtype="bfloat16")
  half, hcfg = load(str(tmp_path / "bf16"))
  assert hcfg.param_dtype == hcfg.dtype == "bfloat16"
  assert half.layers[0].self_attn.q_proj[...].dtype == jnp.bfloat16
  full, fcfg = load(str(tmp_path / "bf16"), dtype="float32")
  assert fcfg.param_dtype == "float32" and full.embed_tokens[...].dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(full.embed_tokens[...]),
                                np.asarray(model.embed_tokens[...].astype(jnp.bfloat16).astype(jnp.float32)))


# ---- errors -----------------------------------------------------------------------------------------------------

def _rewrite(tmp_path, name, edit):
  """A copy of a fixture with its tensors edited (dict name -> array) into one model.safetensors."""
  src = safetensors_io.Checkpoint(fixture(name))
  tensors = {n: np.asarray(src.get(n)) for n in src.names}
  edit(tensors)
  d = tmp_path / "bad"
  shutil.rmtree(d, ignore_errors=True)
  d.mkdir()
  shutil.copy(os.path.join(fixture(name), "config.json"), d / "config.json")
  safetensors_io.write(str(d / "model.safetensors"), tensors)
  return str(d)


def test_missing_tensor_is_named(tmp_path):
  d = _rewrite(tmp_path, "random_gqa4", lambda t: t.pop("model.layers.2.self_attn.indexer.k_norm.weight"))
  with pytest.raises(ValueError, match=r"missing \['model.layers.2.self_attn.indexer.k_norm.weight'\]") as e:
    load(d)
  assert "unexpected" not in str(e.value) and "mis-shaped" not in str(e.value)


def test_unexpected_tensor_is_named_and_mtp_is_ignored_like_hf(tmp_path):
  def edit(t):
    t["model.layers.0.self_attn.sinks"] = np.zeros(8, np.float32)
    t["model.mtp.0.proj.weight"] = np.zeros((2, 2), np.float32)  # HF drops multi-token-prediction heads on load
  d = _rewrite(tmp_path, "random_gqa4", edit)
  with pytest.raises(ValueError, match=r"unexpected \['model.layers.0.self_attn.sinks'\]") as e:
    load(d)
  assert "missing" not in str(e.value) and "mtp" not in str(e.value)


def test_misshaped_tensor_is_named(tmp_path):
  d = _rewrite(tmp_path, "random_gqa4", lambda t: t.update(
      {"model.layers.1.mlp.gate_up_proj.weight": np.zeros((40, 48), np.float32)}))
  with pytest.raises(ValueError, match=r"mis-shaped: model.layers.1.mlp.gate_up_proj.weight has shape \(40, 48\), "
                                       r"expected \(80, 48\) \(for our layers/1/mlp/gate_up of shape \(48, 2, 40\)\)"):
    load(d)


def test_quantised_tensor_is_refused_not_cast(tmp_path):
  d = _rewrite(tmp_path, "random_gqa4", lambda t: t.update(
      {"model.layers.0.self_attn.o_proj.weight": np.ones((48, 96), np.int8)}))
  with pytest.raises(ValueError, match=r"not floating point .*model.layers.0.self_attn.o_proj.weight \(I8\)"):
    load(d)


def test_release_layout_errors_name_the_stored_tensor(tmp_path):
  def edit(t):
    t.pop("language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight")
    t["language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight"] = np.zeros((9, 32), np.float32)
  d = _rewrite(tmp_path, "random_vl", edit)
  with pytest.raises(ValueError) as e:
    load(d, text_only=True)
  msg = str(e.value)
  assert "missing ['language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight']" in msg
  assert "block_sparse_moe.experts.0.w1.weight has shape (9, 32), expected (8, 32)" in msg


def test_vl_checkpoint_loads_the_vl_model_and_its_text_tower_only_on_request():
  from m3_jax.interop import hf  # noqa: PLC0415
  from m3_jax.models.transformer import TextModel  # noqa: PLC0415
  model, cfg = load(fixture("random_vl"))  # the VL model (vision tower + projector + text tower)
  assert not isinstance(model, TextModel)
  r = np.load(os.path.join(fixture("random_vl"), "reference.npz"))
  logits, _ = model(r["input_ids"])  # text-only input through the VL model, as HF's reference was made
  assert float(np.max(np.abs(np.asarray(logits) - r["logits"]))) <= 1e-4
  # the text-only plan never drops the vision tensors silently
  with pytest.raises(ValueError, match=r"(?s)unexpected \['multi_modal_projector.*vision tower / projector.*"
                                       r"text_only=True"):
    hf.load_plan(fixture("random_vl"))


def test_index_pointing_at_a_missing_shard_file(tmp_path):
  d = tmp_path / "broken"
  shutil.copytree(fixture("random_mha_sharded"), d)
  os.remove(d / "model-00003-of-00008.safetensors")
  with pytest.raises(FileNotFoundError, match="model-00003-of-00008.safetensors"):
    load(str(d))


# ---- abstract load and the sharding plan ------------------------------------------------------------------------

def test_abstract_load_reads_no_data(tmp_path):
  from m3_jax.interop import hf  # noqa: PLC0415
  model, cfg = loaded("random_legacy")
  hf.abstract_checkpoint(cfg, str(tmp_path / "shape_only"), dtype="float32")
  assert os.path.getsize(tmp_path / "shape_only" / "model.safetensors") < 20_000  # headers only
  abstract, acfg = load(str(tmp_path / "shape_only"), abstract=True)
  assert acfg == cfg
  real = jax.tree.leaves(pure(model))
  shapes = jax.tree.leaves(pure(abstract))
  assert len(real) == len(shapes)
  for x, s in zip(real, shapes):
    assert isinstance(s, jax.ShapeDtypeStruct) and (s.shape, s.dtype) == (x.shape, x.dtype)
  with pytest.raises(ValueError, match="shape-only checkpoint"):
    load(str(tmp_path / "shape_only"))


EIGHT_DEVICES = r"""
import json, sys
import jax, numpy as np
from flax import nnx
from m3_jax.interop import hf
from m3_jax.core.sharding import make_mesh
mesh = make_mesh({"fsdp": 2, "tensor": 2, "expert": 2})
path = sys.argv[1]
model, cfg = hf.load(path, mesh=mesh)
plan = hf.load_plan(path, mesh=mesh)
abstract, _ = hf.load(path, mesh=mesh, abstract=True)
specs = {}
flat = dict(nnx.to_flat_state(nnx.state(model)))
aflat = dict(nnx.to_flat_state(nnx.state(abstract)))
for e in plan.entries:
  arr, sds = flat[e.rule.ours].get_value(), aflat[e.rule.ours].get_value()
  assert arr.sharding == e.sharding == sds.sharding, e.ours
  specs[e.ours] = [str(e.sharding.spec), len(arr.sharding.device_set), list(arr.addressable_shards[0].data.shape)]
r = np.load(path + "/reference.npz")
logits, _ = model(r["input_ids"])
print(json.dumps({"devices": jax.device_count(), "max_diff": float(np.abs(np.asarray(logits) - r["logits"]).max()),
                  "specs": specs}))
"""


def _run8(args):
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
  p = subprocess.run([sys.executable] + args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  return p.stdout


def test_load_onto_eight_devices_matches_hf_and_the_plan():
  out = json.loads(_run8(["-c", EIGHT_DEVICES, fixture("text_msa")]).strip().splitlines()[-1])
  assert out["devices"] == 8
  print(f"text_msa on 8 devices: max |ours - HF| = {out['max_diff']:.2e}")
  assert out["max_diff"] <= 1e-4
  s = out["specs"]
  # [E, d, 2, I] experts split over expert x fsdp x tensor; q heads over tensor, the model dim over fsdp (and
  # context, size 1 here: a context-parallel mesh shards parameters over it too)
  assert s["layers/1/mlp/gate_up"] == ["P('expert', ('fsdp', 'context'), None, 'tensor')", 8, [4, 32, 2, 8]]
  assert s["layers/0/self_attn/q_proj"] == ["P(('fsdp', 'context'), 'tensor', None)", 8, [32, 2, 16]]
  assert s["embed_tokens"] == ["P('tensor', ('fsdp', 'context'))", 8, [128, 32]]


def _closed_form_bytes(d, v, hq, hkv, hd, di_dense, e, i, si, hi, di, layer_types, mlp_types, param_bytes):
  """Per-device bytes on mesh fsdp=2, tensor=2, expert=2: size / shards for every tensor, the shard count written
  out by hand from the axes each tensor is split over (router and its bias are float32 in every plan)."""
  f, t, x = 2, 2, 2
  total = 2 * v * d * param_bytes / (t * f) + d * param_bytes  # embed, lm_head: vocab x tensor, d x fsdp; final norm
  for lt, mt in zip(layer_types, mlp_types):
    total += 2 * d * param_bytes  # the two layer norms, replicated
    total += (2 * d * hq * hd + 2 * d * hkv * hd) * param_bytes / (f * t) + 2 * hd * param_bytes  # q, o, k, v; norms
    if lt == "minimax_m3_sparse":
      total += d * hi * di * param_bytes / (f * t) + d * di * param_bytes / f + 2 * di * param_bytes
    if mt == "dense":
      total += 3 * d * di_dense * param_bytes / (f * t)
    else:
      total += d * e * 4 / f + e * 4  # router [d, E] over fsdp; bias replicated
      total += 3 * e * d * i * param_bytes / (x * f * t) + 3 * d * si * param_bytes / (f * t)
  return total


def test_plan_cli_per_device_bytes_equal_the_closed_form(tmp_path):
  """configs/m3.py at full width (4 of its 60 layers: 3 dense + 1 MSA/MoE) on 8 fake devices."""
  dest = tmp_path / "plan.json"
  out = _run8(["-m", "m3_jax.interop.plan", "--config=configs/m3.py:devices=8,fsdp=2,tensor=2,expert=2,layers=4",
               "--devices=8", f"--out={dest}"])
  assert "per device:" in out
  with open(dest) as f:
    rep = json.load(f)
  assert rep["mesh"] == {"data": 1, "fsdp": 2, "tensor": 2, "expert": 2, "context": 1}
  lt = ["full_attention"] * 3 + ["minimax_m3_sparse"]
  mt = ["dense"] * 3 + ["sparse"]
  for dtype, nbytes in (("bfloat16", 2), ("float32", 4)):
    p = rep["plans"][dtype]
    want = _closed_form_bytes(6144, 200064, 64, 4, 128, 12288, 128, 3072, 3072, 4, 128, lt, mt, nbytes)
    assert p["bytes_per_device_max"] == p["bytes_per_device_min"] == want, dtype
    assert {r["kind"] for r in p["kinds"]} >= {"model.layers.*.mlp.experts.gate_up_proj", "lm_head.weight"}
  assert len(rep["tensors"]) == 3 + 3 * 10 + 18


def test_generate_cli_with_the_checkpoints_own_hf_tokenizer(tmp_path):
  """`python -m m3_jax.generate` on an HF directory that ships a foreign tokenizer.json: it streams the greedy
  continuation (greedy == HF is test_greedy_generation_matches_hf) and stops at generation_config's eos."""
  import tokenizers  # noqa: PLC0415
  from tokenizers import models, pre_tokenizers  # noqa: PLC0415
  d = tmp_path / "hf_dir"
  shutil.copytree(fixture("random_mha_sharded"), d)
  tok = tokenizers.Tokenizer(models.WordLevel({f"w{i}": i for i in range(150)}, unk_token="w0"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.save(str(d / "tokenizer.json"))
  model, _ = loaded("random_mha_sharded")
  prompt = [7, 93, 41, 12, 5]
  free = decode.generate(model, jnp.asarray([prompt], jnp.int32), max_new_tokens=6)[0].tolist()
  eos = free[3]  # make the 4th generated token the end of sequence
  (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 149]}))
  want = free[:free.index(eos) + 1]
  text = " ".join(f"w{i}" for i in prompt)
  p = subprocess.run([sys.executable, "-m", "m3_jax.generate", f"--checkpoint={d}", f"--prompt={text}",
                      "--max_new_tokens=6"], cwd=REPO, capture_output=True, text=True, timeout=300,
                     env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert p.returncode == 0, p.stderr[-3000:]
  assert p.stdout.strip() == text + " ".join(f"w{i}" for i in want)
