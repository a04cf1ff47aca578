r"""A ~260M-parameter M3-shaped model for the GPU box (dense or MoE), bf16 compute.

  python -m m3_jax.main --config=configs/small_lm.py --workdir=workdirs/small_lm
  python -m m3_jax.main --config=configs/small_lm.py:moe=True,seq_len=4096 --workdir=workdirs/small_moe

Dense variant: 16 layers, width 1024, GQA 8/2 x 128, SwiGLU-OAI 4096. MoE variant: the first 2 layers dense, then
16 routed experts (top-2, 1024 wide) + one shared expert, as M3 does at 57/60 layers. `attention` is the dense
attention impl: cudnn_packed (default) is cuDNN, on its packed-documents layout when document masks are on
(BENCHMARKS.md, 2026-12-07: 1.43x the unmasked step and 6.4x the boolean-mask route at 32K); cudnn is the mask route.
"""

from m3_jax.train.config_lib import parse_arg
from m3_jax.train.defaults import base_config


def get_config(arg=None):
  a = parse_arg(arg, moe=False, steps=300, batch_size=8, seq_len=4096, layers=16, attention="cudnn_packed",
                remat=False, document_mask=True,
                moe_impl="capacity")
  c = base_config()
  m = c.model
  m.vocab_size = 8192
  m.hidden_size = 1024
  m.num_hidden_layers = a.layers
  m.num_attention_heads = 8
  m.num_key_value_heads = 2
  m.head_dim = 128
  m.rotary_dim = 64
  m.rope_theta = 5e6
  m.dense_intermediate_size = 4096
  m.intermediate_size = 1024
  m.shared_intermediate_size = 1024
  m.num_local_experts = 16
  m.num_experts_per_tok = 2
  m.layer_types = ("full_attention",) * a.layers
  m.mlp_layer_types = ("dense",) * 2 + ("sparse" if a.moe else "dense",) * (a.layers - 2)
  m.attention_impl = a.attention
  m.dtype = "bfloat16"
  m.remat = a.remat
  m.document_mask = a.document_mask
  # ragged_dot's backward runs out of memory on the GPU at this size (BENCHMARKS.md); capacity buffers do not.
  m.moe_impl = a.moe_impl

  c.train.steps = a.steps
  c.train.batch_size = a.batch_size
  c.train.seq_len = a.seq_len
  c.train.log_every = 20
  c.train.eval_every = 100
  c.optim.learning_rate = 1e-3
  c.optim.warmup_steps = 50
  c.checkpoint.every = 200
  c.eval.batch_size = 8
  c.eval.max_batches = 4
  return c
