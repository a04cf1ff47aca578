r"""Tiny MSA model for a 2-core CPU: indexer warmup (dense attention, dense KL target), then sparse training.

  python -m m3_jax.main --config=configs/tiny_msa.py --workdir=workdirs/tiny_msa
  python -m m3_jax.main --config=configs/tiny_msa.py:steps=100,warmup=30 --workdir=/tmp/msa
  python -m m3_jax.main --config=configs/tiny_msa.py:selection=shared --workdir=/tmp/msa_shared

Layer 0 is dense attention (M3 keeps its first 3 layers dense), the rest are `minimax_m3_sparse` with block 32,
top-4 blocks, 1 local block, at sequence 512 (16 blocks: each query reads at most a quarter of its history).
metrics.jsonl logs per MSA layer the KL, the attention-mass recall of the selection, the same recall for a random
selection with the same forced local block, the block recall against the oracle top blocks, and the groups'
agreement (group_jaccard). Ablations: `selection=shared` (one block set per query for both KV groups),
`detach=False` (the KL reaches the trunk), `block=8,topk=16` (token-granular at the same 128-token budget).
"""

from m3_jax.train.config_lib import parse_arg
from m3_jax.train.defaults import base_config


def get_config(arg=None):
  a = parse_arg(arg, steps=300, warmup=100, batch_size=8, seq_len=512, layers=3, topk=4, block=32, local=1,
                detach=True, selection="per_group")
  c = base_config()
  m = c.model
  m.vocab_size = 8192
  m.hidden_size = 128
  m.num_hidden_layers = a.layers
  m.num_attention_heads = 4
  m.num_key_value_heads = 2
  m.head_dim = 32
  m.rotary_dim = 16
  m.rope_theta = 10000.0
  m.dense_intermediate_size = 384
  m.layer_types = ("full_attention",) + ("minimax_m3_sparse",) * (a.layers - 1)
  m.mlp_layer_types = ("dense",) * a.layers
  m.index_n_heads = 2
  m.index_head_dim = 32
  m.index_block_size = a.block
  m.index_topk_blocks = a.topk
  m.index_local_blocks = a.local
  m.warmup_steps = a.warmup
  m.detach_index_input = a.detach
  m.msa_selection = a.selection
  m.kl_weight = 1.0

  c.train.steps = a.steps
  c.train.batch_size = a.batch_size
  c.train.seq_len = a.seq_len
  c.train.log_every = 10
  c.train.eval_every = 100
  c.optim.learning_rate = 3e-3
  c.optim.warmup_steps = 30
  c.checkpoint.every = 100
  c.eval.batch_size = 8
  c.eval.max_batches = 2
  return c
