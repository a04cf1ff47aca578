"""Scanned layer stacks (TextConfig.scan_layers) against the unscanned model as the reference: the same parameters
(per-layer -> stacked) give the same losses, gradients, aux outputs, router-bias updates, train step, decoding and
HF checkpoints; the two layouts convert into each other exactly."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from m3_jax.models import decode
from m3_jax.models.config import TextConfig
from m3_jax.models.transformer import (LayerStack, TextModel, layer_locations, layer_runs, stack_layers,
                                       unstack_layers)
from m3_jax.train.optimizer import decay_mask
from tests.model_utils import jaxpr_eqns, msa_cfg, numpy_values

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
STEP = {"step": jnp.int32(10**6)}  # past any warmup; an odd step + 1, so recall metrics are computed


def moe_cfg(**kw):
  """tiny_lm's recipe at test size: layer 0 dense attention + dense MLP, layers 1-2 MoE (4 experts, top 2)."""
  base = dict(vocab_size=61, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, rotary_dim=4, rope_theta=1e4, dense_intermediate_size=48, intermediate_size=16,
              shared_intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
              layer_types=["full_attention"] * 3, mlp_layer_types=["dense", "sparse", "sparse"])
  return TextConfig(**{**base, **kw})


CONFIGS = {
    "tiny_lm_moe": lambda: moe_cfg(remat=True),
    # no remat: the scan still runs its body under the save_matmuls policy (LayerStack.__call__)
    "tiny_lm_moe_no_remat": lambda: moe_cfg(),
    # layer 0 dense, layers 1-2 MSA (block 4, top 2: sparsity is active at 24 tokens)
    "tiny_msa": lambda: msa_cfg(num_hidden_layers=3, layer_types=["full_attention"] + ["minimax_m3_sparse"] * 2,
                                mlp_layer_types=["dense"] * 3, remat=True),
}


def pair(cfg: TextConfig, seed=0):
  """(unscanned model with random non-trivial values everywhere, the scanned model holding the same values)."""
  flat = nnx.eval_shape(lambda: TextModel(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(flat)
  state = numpy_values(state, seed=seed, std=0.3)
  plain = nnx.merge(graphdef, state)
  scan_cfg = cfg.replace(scan_layers=True)
  graphdef_s, state_s = nnx.split(nnx.eval_shape(lambda: TextModel(scan_cfg, rngs=nnx.Rngs(0))))
  nnx.replace_by_pure_dict(state_s, stack_layers(nnx.to_pure_dict(nnx.state(plain)), scan_cfg))
  return plain, nnx.merge(graphdef_s, state_s)


def per_layer(tree, cfg):
  """A (scanned) model's pure-dict state or gradients in the unscanned layout, as float64 numpy."""
  return jax.tree.map(lambda a: np.asarray(a, np.float64), unstack_layers(tree, cfg))


def assert_trees_close(a, b, *, scale_atol: float = 0.0, **tol):
  """Leaf by leaf; scale_atol adds scale_atol x max|leaf| to atol: an f32 sum's rounding error is relative to the
  size of its terms, not of its result, so an element that cancels to near zero (e.g. an embedding row's gradient
  summed over positions) can differ by ~eps x the leaf's scale when the scan reorders the sums."""
  fa, fb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0]
  assert [p for p, _ in fa] == [p for p, _ in fb]
  for (path, x), (_, y) in zip(fa, fb):
    kw = dict(tol)
    if scale_atol:
      kw["atol"] = kw.get("atol", 0.0) + scale_atol * float(np.max(np.abs(y), initial=0.0))
    np.testing.assert_allclose(x, y, err_msg=jax.tree_util.keystr(path), **kw)


def ids(t=24, b=2, seed=0, vocab=61):
  return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, size=(b, t)))


def loss_grads_aux(model, x):
  """(total loss, gradients as a pure dict, aux) of LM cross-entropy + 0.1 x MoE balance loss + the KL losses."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(p):
    logits, aux = nnx.merge(graphdef, p, rest)(x[:, :-1], step_state=STEP)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), x[:, 1:, None], axis=-1)
    return jnp.mean(nll) + 0.1 * aux["moe_aux_loss"] + aux["kl_loss"], aux

  (total, aux), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  return float(total), nnx.to_pure_dict(grads), aux


def test_layer_runs_and_locations():
  m3 = TextConfig()
  assert layer_runs(m3.layer_types, m3.mlp_layer_types) == [(0, 3), (3, 57)]
  cfg = moe_cfg(scan_layers=True)
  assert layer_locations(cfg) == [(("layers", 0), None)] + [(("layers", 1, "layer"), j) for j in range(2)]
  model = nnx.eval_shape(lambda: TextModel(cfg, rngs=nnx.Rngs(0)))
  assert isinstance(model.layers[1], LayerStack) and (model.layers[1].first, model.layers[1].count) == (1, 2)
  q = model.layers[1].layer.self_attn.q_proj
  assert q.shape == (2, 32, 4, 8) and q.get_metadata()["logical_axes"] == ("layers", "embed", "q_heads", "head_dim")
  with pytest.raises(ValueError, match="scan_layers=1 must be True or False"):
    moe_cfg(scan_layers=1)


def test_stacked_and_per_layer_layouts_round_trip_exactly():
  """stack_layers gives the scanned model's state layout (numpy stays numpy) and unstack_layers undoes it
  bit for bit; a partial state (the router biases alone) converts too."""
  cfg, scan_cfg = moe_cfg(), moe_cfg(scan_layers=True)
  plain = nnx.to_pure_dict(numpy_values(nnx.state(nnx.eval_shape(lambda: TextModel(cfg, rngs=nnx.Rngs(0))))))
  stacked = stack_layers(plain, scan_cfg)
  want = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: TextModel(scan_cfg, rngs=nnx.Rngs(0)))))
  assert jax.tree.map(lambda a: (a.shape, a.dtype), stacked) == jax.tree.map(lambda a: (a.shape, a.dtype), want)
  assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(stacked))
  np.testing.assert_array_equal(stacked["layers"][1]["layer"]["mlp"]["down"][1], plain["layers"][2]["mlp"]["down"])
  assert_trees_close(unstack_layers(stacked, scan_cfg), plain, rtol=0, atol=0)
  biases = {"layers": {i: {"mlp": {"e_score_correction_bias": plain["layers"][i]["mlp"]["e_score_correction_bias"]}}
                       for i in (1, 2)}}
  assert_trees_close(unstack_layers(stack_layers(biases, scan_cfg), scan_cfg), biases, rtol=0, atol=0)
  with pytest.raises(ValueError, match=r"layers 1\.\.2 form one stack, but the state has only \[2\]"):
    stack_layers({"layers": {2: {}}}, scan_cfg)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_losses_gradients_and_aux_match_the_unscanned_model(name):
  """With remat on or off: the same loss, gradients (compared per layer), MoE balance loss and expert_load rows,
  KL loss, per-layer metric keys (true layer indices) and values."""
  cfg = CONFIGS[name]()
  plain, scanned = pair(cfg)
  x = ids()
  total_p, grads_p, aux_p = loss_grads_aux(plain, x)
  total_s, grads_s, aux_s = loss_grads_aux(scanned, x)
  np.testing.assert_allclose(total_s, total_p, rtol=1e-6)
  # scale_atol 1e-5 (~100 f32 eps of the leaf's largest value): the failing case was 1.3e-6 of it
  assert_trees_close(per_layer(grads_s, scanned.cfg), per_layer(grads_p, cfg), rtol=2e-5, atol=1e-7,
                     scale_atol=1e-5)
  for k in ("moe_aux_loss", "kl_loss"):
    np.testing.assert_allclose(float(aux_s[k]), float(aux_p[k]), rtol=1e-6, err_msg=k)
  assert set(aux_s) == set(aux_p)
  assert sorted(aux_s["metrics"]) == sorted(aux_p["metrics"])
  if name == "tiny_msa":
    assert float(aux_p["kl_loss"]) > 0 and "layer2/kl" in aux_p["metrics"] and "layer0/kl" not in aux_p["metrics"]
    assert_trees_close(aux_s["metrics"], aux_p["metrics"], rtol=1e-5, atol=1e-7)
  else:
    assert aux_p["expert_load"].shape == (2, 4)  # rows: layers 1, 2
    np.testing.assert_allclose(np.asarray(aux_s["expert_load"]), np.asarray(aux_p["expert_load"]), atol=1e-7)


def _forward_scan_residuals(model, x):
  """The [count, ...] arrays the forward scan of `model`'s first stack hands to the backward (abstract values)."""
  graphdef, state = nnx.split(model)
  count = model.layers[1].count

  def loss(st):
    logits, aux = nnx.merge(graphdef, st)(x)
    return jnp.mean(logits.astype(jnp.float32)) + aux["moe_aux_loss"]

  forward = next(e for e in jaxpr_eqns(jax.make_jaxpr(jax.grad(loss))(state).jaxpr) if e.primitive.name == "scan")
  return [v.aval for v in forward.outvars if v.aval.shape[:1] == (count,)]


def test_scanned_bf16_model_stacks_no_f32_activations_for_the_backward():
  """Without remat, a scanned bf16 model keeps the backward's residuals in bf16: the f32 upcasts inside norms, RoPE
  and SwiGLU are recomputed in the backward, not stacked [count, B, T, ...] in f32 by the forward loop (which
  doubled those bytes and made the scanned step slower than the unrolled one on the GPU)."""
  x = ids()
  model = TextModel(moe_cfg(scan_layers=True, dtype="bfloat16"), rngs=nnx.Rngs(0))
  residuals = _forward_scan_residuals(model, x)
  # [count, B, T, ..., F] with F a feature axis (>= head_dim); the norms' f32 statistics ([count, B, T, heads])
  # are small and stay saved
  activations = [a for a in residuals if a.ndim > 3 and a.shape[1:3] == x.shape and a.shape[-1] >= model.cfg.head_dim]
  assert activations and all(a.dtype == jnp.bfloat16 for a in activations), [a.str_short() for a in activations]


def test_captured_attention_matches():
  """capture_attention: per-layer probabilities (and MSA selections) come out of the stack layer by layer."""
  plain, scanned = pair(CONFIGS["tiny_msa"]())
  x = ids()

  @nnx.jit
  def capture(m):
    _, aux = m(x, capture_attention=True)
    return aux["attention_probs"], aux["block_idx"]

  (probs_p, idx_p), (probs_s, idx_s) = capture(plain), capture(scanned)
  assert idx_s[0] is None and len(probs_s) == 3
  for a, b in zip(probs_p, probs_s):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6)
  for a, b in zip(idx_p[1:], idx_s[1:]):
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


def test_router_bias_update_and_decay_mask_match():
  """moe_layers / update_router_biases update the stack's bias rows as the per-layer MoEs are updated; AdamW's
  weight-decay mask decays the same tensors (a stack of norm scales [L, d] is no matrix)."""
  cfg = moe_cfg(router_bias_update_rate=0.01)
  plain, scanned = pair(cfg, seed=1)
  assert [i for i, _ in scanned.moe_layers()] == [i for i, _ in plain.moe_layers()] == [1, 2]
  load = jnp.asarray(np.random.default_rng(0).dirichlet(np.ones(4), size=2), jnp.float32)  # [2 layers, 4]
  before = per_layer(nnx.to_pure_dict(nnx.state(plain)), cfg)
  for m in (plain, scanned):
    m.update_router_biases(load, 0.5)
  after = per_layer(nnx.to_pure_dict(nnx.state(plain)), cfg)
  assert not np.array_equal(after["layers"][2]["mlp"]["e_score_correction_bias"],
                            before["layers"][2]["mlp"]["e_score_correction_bias"])
  assert_trees_close(per_layer(nnx.to_pure_dict(nnx.state(scanned)), scanned.cfg), after, rtol=0, atol=0)
  mask_p, mask_s = (nnx.to_pure_dict(decay_mask(nnx.state(m, nnx.Param))) for m in (plain, scanned))
  for i, (path, _) in enumerate(layer_locations(scanned.cfg)):  # a stack's mask holds for each of its layers
    sub = mask_s
    for k in path:
      sub = sub[k]
    assert sub == mask_p["layers"][i], i
  assert {k: v for k, v in mask_s.items() if k != "layers"} == {k: v for k, v in mask_p.items() if k != "layers"}
  assert not mask_p["layers"][2]["input_layernorm"]["weight"] and mask_p["layers"][2]["mlp"]["gate_up"]


def test_decoding_with_caches_matches():
  """Prefill + greedy decoding over per-layer caches (a stack runs layer by layer on slices of its variables)."""
  plain, scanned = pair(moe_cfg(), seed=2)
  assert len(decode.init_caches(scanned, 2, 12)) == 3
  prompt = ids(t=9, seed=3)
  outs = [decode.generate(m, prompt, max_new_tokens=2) for m in (plain, scanned)]
  np.testing.assert_array_equal(np.asarray(outs[1]), np.asarray(outs[0]))


def test_hf_checkpoint_into_and_out_of_a_scanned_model(tmp_path):
  """HF import of the text_msa fixture (layers 1-2 MSA + MoE: one stack) into a scanned model, onto a mesh, gives
  the unscanned model's parameters stacked (whose logits are HF's: test_hf_parity; the layouts compute the same:
  the tests above); the export writes the unscanned model's files."""
  from m3_jax.core import sharding  # noqa: PLC0415
  from m3_jax.interop import hf, safetensors_io  # noqa: PLC0415
  path = os.path.join(FIX, "text_msa")
  plain, cfg = hf.load(path)
  mesh = sharding.make_mesh({"data": 1})
  scanned, cfg_s = hf.load(path, mesh=mesh, scan_layers=True)
  assert cfg_s == cfg.replace(scan_layers=True) and isinstance(scanned.layers[1], LayerStack)
  stacked = stack_layers(jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(plain))), cfg_s)
  assert_trees_close(jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(scanned))), stacked, rtol=0, atol=0)
  hf.save(scanned, cfg_s, str(tmp_path / "scanned"))
  hf.save(plain, cfg, str(tmp_path / "plain"))
  a, b = (safetensors_io.Checkpoint(str(tmp_path / d)) for d in ("scanned", "plain"))
  assert sorted(a.names) == sorted(b.names) and any(".layers.2." in n for n in a.names)
  for n in b.names:
    np.testing.assert_array_equal(a.get(n), b.get(n), err_msg=n)
  with open(tmp_path / "scanned" / "config.json") as fa, open(tmp_path / "plain" / "config.json") as fb:
    assert fa.read() == fb.read()


def test_orbax_export_and_warm_start_across_layouts(tmp_path):
  """A scanned model's params save and restore through orbax (stacked layout); an unscanned export warm-starts a
  scanned train state layer by layer (init_from_export)."""
  from m3_jax.core import sharding  # noqa: PLC0415
  from m3_jax.train import checkpoint as ckpt_lib  # noqa: PLC0415
  from m3_jax.train import state as state_lib  # noqa: PLC0415
  cfg = moe_cfg()
  plain, scanned = pair(cfg, seed=4)
  _, p, r = nnx.split(scanned, nnx.Param, ...)
  path = ckpt_lib.export_params(str(tmp_path / "scanned"), {"params": p, "rest": r}, scanned.cfg.to_dict())
  mesh = sharding.make_mesh({"data": 1})
  _, (ap, ar), (psh, rsh) = state_lib.param_shardings(scanned.cfg, mesh)
  back = ckpt_lib.restore_params(path, ckpt_lib.abstract_like({"params": ap, "rest": ar}, {"params": psh,
                                                                                          "rest": rsh}))
  assert_trees_close(jax.tree.map(np.asarray, nnx.to_pure_dict(back["params"])),
                     jax.tree.map(np.asarray, nnx.to_pure_dict(p)), rtol=0, atol=0)
  _, pp, pr = nnx.split(plain, nnx.Param, ...)
  path = ckpt_lib.export_params(str(tmp_path / "plain"), {"params": pp, "rest": pr}, cfg.to_dict())
  _, fresh = pair(cfg, seed=5)  # a scanned model of other values, to be overwritten
  _, fp, fr = jax.tree.map(jnp.asarray, nnx.split(fresh, nnx.Param, ...))
  state = state_lib.TrainState(step=jnp.int32(0), params=fp, rest=fr, opt_state=(), rng=jax.random.key(0))
  state = state_lib.init_from_export(state, path, mesh, scanned.cfg)
  for part, want in (("params", p), ("rest", r)):
    assert_trees_close(jax.tree.map(np.asarray, nnx.to_pure_dict(getattr(state, part))),
                       jax.tree.map(np.asarray, nnx.to_pure_dict(want)), rtol=0, atol=0)
