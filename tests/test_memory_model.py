"""train/memory.py, the closed-form per-device bytes of a training step: its terms against hand arithmetic for the
shapes BENCHMARKS.md reports (small_msa at 1M tokens over 8 devices, M3's expert-parallel MoE with and without
exchange chunks), and `longest_sequence` as the exact inverse of the model."""

from configs import m3 as m3_config
from configs import small_msa
from m3_jax.train import config_lib, memory

GIB = 2**30


def _text(module, arg):
  return config_lib.text_config(config_lib.model_config(module.get_config(arg)))


def test_small_msa_terms_at_one_million_tokens_match_hand_arithmetic():
  cfg = _text(small_msa, "seq_len=1048576,context=8,devices=8")
  t, n = 1048576, 1048576 // 8  # one sequence, 8 context shards: 131072 local tokens
  terms = memory.activation_bytes(cfg, {"context": 8}, batch=1, seq_len=t, loss_chunk=8192)
  # 8 layers' bf16 inputs of width 1024 for the local tokens
  assert terms["layer_inputs"] == 8 * n * 1024 * 2 == 2 * GIB
  # the recall diagnostics: 64 sampled queries x 8 heads against every key, f32 scores, probabilities and masks;
  # the whole sequence's K and V (2 KV heads x 128): gathered and block-major bf16 copies, f32 upcasts and
  # gradients; the MSA index key (128): bf16, f32 and its f32 gradient
  diagnostics = 64 * 8 * t * 4 * 3
  gathered = t * 2 * 2 * 128 * (2 + 2 + 4 + 4) + t * 128 * (2 + 4 + 4) + diagnostics
  assert terms["whole_sequence"] == gathered
  # per local token: q and out (8 x 128 each), k and v (2 x 128 each), index queries (2 groups) and key (128
  # each), 4 residual-width values; each in bf16 with an f32 gradient
  assert terms["attention"] == n * (2 * 8 * 128 + 2 * 2 * 128 + 3 * 128 + 4 * 1024) * 6 + gathered
  # the MLP's gate, up and hidden (3 x 4096), bf16 + f32 gradient
  assert terms["mlp"] == n * 3 * 4096 * 6
  # f32 logits, softmax and gradient of one 8192-position chunk over the 8192-token vocabulary
  assert terms["logits"] == 8192 * 8192 * 4 * 3
  # parameters are sharded over context as over fsdp, so one layer's bf16 weights are gathered twice (forward and
  # the recompute): between the layer without its MSA index projections (MLP 3 x 1024 x 4096, q and o 1024 x 1024,
  # k and v 1024 x 256) and with them (index queries 1024 x 256, index key 1024 x 128), averaged over the layers
  core = 3 * 1024 * 4096 + 2 * 1024 * 1024 + 2 * 1024 * 256
  assert 2 * 2 * core <= terms["weight_gather"] <= 2 * 2 * (core + 1024 * 384 + 4 * 1024)
  # the phases are not live together: the total takes the largest (attention here) beside what is always live
  total = memory.model_bytes(cfg, {"context": 8}, 1, t, 3.0, 1.0, 8192)
  assert total["total"] == 4.0 + terms["layer_inputs"] + terms["weight_gather"] + terms["attention"]
  # context=1: no gathered keys (the diagnostics remain, over the 8x shorter sequence), nothing gathered per layer
  one = memory.activation_bytes(cfg, {"context": 1}, batch=1, seq_len=t // 8, loss_chunk=8192)
  assert one["whole_sequence"] == diagnostics / 8 and one["weight_gather"] == 0
  assert one["layer_inputs"] == terms["layer_inputs"]
  assert one["attention"] == terms["attention"] - gathered + diagnostics / 8


def test_moe_exchange_chunks_bound_the_expert_parallel_buffers():
  """M3 on tensor=4 x expert=4 x context=16: 65536 local tokens; with 4096-token exchange chunks the send, receive
  and return buffers (3 x expert x top-4 slots per token, each d + 3 I / tp wide) are those of one chunk."""
  arg = "devices=256,context=16,seq_len=1048576,moe_chunk={}"
  mesh = {"fsdp": 1, "tensor": 4, "expert": 4, "context": 16}
  whole = memory.activation_bytes(_text(m3_config, arg.format(0)), mesh, batch=4, seq_len=1048576)
  chunked = memory.activation_bytes(_text(m3_config, arg.format(4096)), mesh, batch=4, seq_len=1048576)
  n, slots, width = 65536, 3 * 4 * 4, 6144 + 3 * 3072 / 4
  assert whole["mlp"] - chunked["mlp"] == (n - 4096) * slots * width * (2 + 4)
  for k in ("layer_inputs", "attention", "logits", "weight_gather"):
    assert whole[k] == chunked[k], k


def test_longest_sequence_is_the_models_inverse():
  cfg = _text(small_msa, "context=8,devices=8")
  mesh, state = {"context": 8}, 3 * GIB
  for budget in (20 * GIB, 141 * GIB):
    t = memory.longest_sequence(cfg, mesh, 1, state, state / 3, budget, loss_chunk=8192, multiple=16)
    assert t % 16 == 0 and t > 0
    assert memory.model_bytes(cfg, mesh, 1, t, state, state / 3, 8192)["total"] <= budget
    assert memory.model_bytes(cfg, mesh, 1, t + 16, state, state / 3, 8192)["total"] > budget
  assert memory.longest_sequence(cfg, mesh, 1, state, state / 3, GIB) == 0  # the state alone does not fit
