"""Context parallelism (mesh axis `context`): on 8 fake CPU devices, tiny_lm (dense attention + MoE, also expert
parallel with the token exchange in chunks) and a tiny MSA model with the sequence split over `context` (x `data`,
x `tensor`, x `expert`) give the losses and gradients of one device, with and without packed documents; the zigzag
token layout and its inverse."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from m3_jax.core import context
from tests.train_utils import REPO

EIGHT_DEVICES = r"""
import json
import jax, numpy as np
from flax import nnx
from m3_jax.core.sharding import make_mesh, state_shardings
from m3_jax.train import config_lib
from m3_jax.train.state import abstract_model
from m3_jax.train.steps import cross_entropy, forward, to_global
from tests.model_utils import msa_cfg, numpy_values
from tests.train_utils import small_config

b, t = 4, 64
rng = np.random.default_rng(0)

def make_batch(vocab, packed):
  ids = rng.integers(2, vocab, size=(b, t + 1))
  seg = np.ones((b, t), np.int32)
  pos = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy()
  mask = np.ones((b, t), np.float32)
  if packed:  # documents of uneven lengths, positions restarting, a padded tail (segment 0) off the loss
    for r in range(b):
      cuts = np.sort(rng.choice(np.arange(3, t - 8), size=3, replace=False))
      edges = [0, *cuts, t - 5 * r % 7 - 1, t]
      for j, (s, e) in enumerate(zip(edges[:-1], edges[1:])):
        seg[r, s:e] = j + 1
        pos[r, s:e] = np.arange(e - s)
      seg[r, edges[-2]:] = 0
      mask[r, edges[-2]:] = 0.0
  return {"inputs": ids[:, :-1].astype(np.int32), "targets": ids[:, 1:].astype(np.int32), "positions": pos,
          "segment_ids": seg, "loss_mask": mask}

def loss_and_grads(cfg, params, rest, batch, mesh):
  graphdef = abstract_model(cfg)[0]
  def loss(p, r, bt):
    logits, aux = forward(graphdef, p, r, bt, step=jax.numpy.int32(5))
    ce, _ = cross_entropy(logits, bt["targets"], bt["loss_mask"])
    return ce + cfg.router_aux_loss_coef * aux["moe_aux_loss"] + aux["kl_loss"], aux["kl_loss"]
  fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
  with jax.set_mesh(mesh):
    args = (jax.device_put(params, state_shardings(params, mesh)), jax.device_put(rest, state_shardings(rest, mesh)),
            to_global(batch, mesh))
    compiled = fn.lower(*args).compile()
    (value, kl), grads = compiled(*args)
  return (float(value), float(kl), {"/".join(map(str, k)): np.asarray(v.get_value())
                                    for k, v in nnx.to_flat_state(grads)}, compiled.as_text().count("all-gather"))

lm = config_lib.model_config(small_config("unused"))  # tiny_lm at the test size: dense attention, MoE layer 1
msa = msa_cfg(vocab_size=lm.vocab_size, mlp_layer_types=["dense", "dense"], index_block_size=4, index_topk_blocks=3,
              index_local_blocks=1)  # 16 blocks of 4: each query reads at most 12 of its keys
# expert parallelism beside context: every device's 32 tokens (one row's two chunks) exchanged 8 at a time
lm_ep = lm.replace(moe_impl="expert_parallel", moe_chunk_tokens=8)
# one KV group (M3's layout is G=16 per group): constant diagnostics, and metrics on some steps only (a lax.cond)
msa_g4 = msa.replace(num_key_value_heads=1, index_n_heads=1, msa_metrics_every=3)
# both models, both layouts of the issue (context 4 x data 2, context 8), packed documents and not
cases = [(name, cfg, packed, shape) for name, cfg in (("lm", lm), ("msa", msa)) for packed in (True, False)
         for shape in ({"context": 4, "data": 2}, {"context": 8})]
cases += [("lm_ep", lm_ep, True, {"context": 2, "expert": 2, "data": 2}),
          ("msa", msa, True, {"context": 4, "tensor": 2}), ("msa_g4", msa_g4, True, {"context": 8})]
out = {"devices": jax.device_count(), "cases": []}
refs = {}
for name, cfg, packed, shape in cases:
  if (name, packed) not in refs:
    params = numpy_values(abstract_model(cfg)[1], seed=0, std=0.1)
    rest = numpy_values(abstract_model(cfg)[2], seed=1, std=0.05)
    batch = make_batch(cfg.vocab_size, packed)
    refs[(name, packed)] = (params, rest, batch, loss_and_grads(cfg, params, rest, batch,
                                                                 make_mesh({"data": 1}, jax.devices()[:1])))
  params, rest, batch, (ref_loss, ref_kl, ref_grads, _) = refs[(name, packed)]
  value, kl, grads, gathers = loss_and_grads(cfg, params, rest, batch, make_mesh(shape))
  err = {k: float(np.max(np.abs(grads[k] - ref_grads[k])) / max(float(np.max(np.abs(ref_grads[k]))), 1e-30))
         for k in ref_grads}
  worst = max(err, key=err.get)
  out["cases"].append({"model": name, "packed": packed, "mesh": shape, "loss": value, "ref_loss": ref_loss,
                       "kl": kl, "ref_kl": ref_kl, "worst_grad": worst, "worst_rel": err[worst],
                       "grads_nonzero": int(sum(np.any(g != 0) for g in grads.values())), "grads": len(grads),
                       "all_gather": gathers})
print(json.dumps(out))
"""


@pytest.mark.slow
def test_context_parallel_matches_one_device():
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()}
  p = subprocess.run([sys.executable, "-c", EIGHT_DEVICES], cwd=REPO, env=env, capture_output=True, text=True,
                     timeout=600)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
  out = json.loads(p.stdout.strip().splitlines()[-1])
  assert out["devices"] == 8
  for c in out["cases"]:
    what = f"{c['model']} packed={c['packed']} mesh={c['mesh']}"
    print(f"{what}: loss {c['loss']:.7f} vs {c['ref_loss']:.7f}, kl {c['kl']:.6f} vs {c['ref_kl']:.6f}; worst "
          f"gradient {c['worst_grad']} rel {c['worst_rel']:.1e}; {c['all_gather']} all-gathers")
    assert c["all_gather"] > 0, f"{what}: nothing gathered (the sequence was not split over context)"
    assert abs(c["loss"] - c["ref_loss"]) <= 2e-6 * abs(c["ref_loss"]), what
    if c["model"].startswith("msa"):
      assert c["ref_kl"] > 1e-4, f"{what}: the KL is ~0, so its match proves nothing"
      assert abs(c["kl"] - c["ref_kl"]) <= 1e-5 * abs(c["ref_kl"]), what
    # f32: the gathers, the reduce-scatters of the K/V gradients and the sharded token sums change only the order
    # of the summations
    assert c["worst_rel"] <= 2e-5, (what, c)
    assert c["grads_nonzero"] == c["grads"], f"{what}: a parameter got no gradient"


def test_zigzag_layout():
  """Device i holds chunks (i, 2n - 1 - i); the inverse restores the sequence; the all-gathered device order maps
  back to the sequence by reshapes (the path attention takes)."""
  T, n = 16, 4
  order = context.device_order(T, n)
  assert order.tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
  x = np.arange(2 * T).reshape(2, T) * 10
  dev = context.to_device_order(x, n)
  np.testing.assert_array_equal(context.to_sequence_order(dev, n), x)
  np.testing.assert_array_equal(np.asarray(context.gathered_to_sequence(dev[..., None], n)[..., 0]), x)
  # causal work per device is equal: sum over its slots of (slot + 1) keys
  work = [(order[i * T // n:(i + 1) * T // n] + 1).sum() for i in range(n)]
  assert len(set(work)) == 1, work
  np.testing.assert_array_equal(context.to_device_order(x, 1), x)
  with pytest.raises(ValueError, match="2 x context = 8"):
    context.device_order(12, 4)
