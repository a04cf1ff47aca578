r"""Tiny M3-shaped text model for a 2-core CPU: the `make run` default.

  python -m m3_jax.main --config=configs/tiny_lm.py --workdir=workdirs/tiny_lm
  python -m m3_jax.main --config=configs/tiny_lm.py:moe=False,steps=50 --workdir=/tmp/t
  python -m m3_jax.main --config=configs/tiny_lm.py:balance=aux_free,seed=1 --workdir=/tmp/t_free

Expert load balancing (`balance=`): `loss` (the default: HF's router_aux_loss_coef x the balance loss), `aux_free`
(no balance loss; M3 / DeepSeek-V3's router-bias sign step at `bias_rate` per step), `both`, or `none`.
`python -m experiments.moe_balance` compares them over seeds.

Same layer recipe as M3 (dense first layers, then MoE with a shared expert; Gemma q/k norms, partial RoPE,
SwiGLU-OAI), on the package-shipped English corpus with an 8k BPE.
"""

from m3_jax.train.config_lib import parse_arg
from m3_jax.train.defaults import base_config

BALANCE = ("loss", "aux_free", "both", "none")


def get_config(arg=None):
  a = parse_arg(arg, moe=True, steps=300, batch_size=16, seq_len=256, layers=4, balance="loss", bias_rate=0.003,
                seed=0)
  if a.balance not in BALANCE:
    raise ValueError(f"tiny_lm: balance={a.balance!r}; expected one of {BALANCE}")
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
  m.intermediate_size = 128
  m.shared_intermediate_size = 128
  m.num_local_experts = 8
  m.num_experts_per_tok = 2
  m.layer_types = ("full_attention",) * a.layers
  m.mlp_layer_types = ("dense",) + ("sparse" if a.moe else "dense",) * (a.layers - 1)
  if a.balance in ("aux_free", "none"):
    m.router_aux_loss_coef = 0.0
  if a.balance in ("aux_free", "both"):
    m.router_bias_update_rate = a.bias_rate

  c.train.steps = a.steps
  c.train.batch_size = a.batch_size
  c.train.seq_len = a.seq_len
  c.train.seed = a.seed
  c.train.log_every = 10
  c.train.eval_every = 100
  c.optim.learning_rate = 3e-3
  c.optim.warmup_steps = 30
  c.checkpoint.every = 100
  c.eval.batch_size = 16
  c.eval.max_batches = 4
  return c
