r"""Long-context training of a small M3-shaped model with MSA or dense attention, for the GPU box (bf16, batch 1).

  python -m m3_jax.main --config=configs/small_msa.py --workdir=workdirs/small_msa                  # MSA, G=4, 32K
  python -m m3_jax.main --config=configs/small_msa.py:attention=dense --workdir=workdirs/small_dense  # cuDNN dense
  python -m m3_jax.main --config=configs/small_msa.py:heads=16/1,seq_len=131072 --workdir=workdirs/msa_g16_128k
  python -m m3_jax.main --config=configs/small_msa.py --workdir=workdirs/prof \
      --config.train.steps=12 --config.train.profile_steps=8,10   # a jax.profiler trace in WORKDIR/profile

8 layers, width 1024, SwiGLU-OAI 4096 (small_lm's shape), head dim 128. attention=msa: layer 0 dense, layers 1-7
`minimax_m3_sparse` (block 128, top 16 blocks, 1 local block, Pallas kernels for selection, sparse attention and
KL; no indexer warmup unless warmup_steps > 0); attention=dense: every layer cuDNN dense attention. `heads` is
q/kv heads: 8/2 (G=4) or 16/1 (G=16, M3's group size). `remat` wraps each layer in jax.checkpoint;
`remat_policy=save_selection` keeps the MSA block selection from the forward (the backward skips the index scoring);
`remat_policy=save_matmuls` keeps every matmul, attention and kernel output (dense 8/2 at 32K: 46.0% MFU against
37.8% with `full`, for 185 KiB more per token; BENCHMARKS.md).
`loss_chunk=N` computes the output layer and loss N positions at a time (`train.loss_chunk`).
Issue-19 ablations: `selection=shared` (one block set per query for all KV groups), `detach=False`, and the
granularity at M3's 2048-token budget: `block_size=16,topk=128` or `block_size=64,topk=32` (128 x 16 is M3's).
Context parallelism: `context=N` splits each sequence over N devices; its ahead-of-time check at 1M tokens (`scan`:
the MSA layers as one scanned stack, which XLA's buffer assignment serves with about half the temporaries):

  python -m m3_jax.main --config=configs/small_msa.py:seq_len=1048576,context=8,devices=8,scan=True,msa_impl=xla,attention_impl=xla,loss_chunk=8192 \
      --workdir=/tmp/small_msa_1m --mode=aot
"""

from m3_jax.train.config_lib import parse_arg
from m3_jax.train.defaults import base_config

LAYERS = 8


def get_config(arg=None):
  a = parse_arg(arg, attention="msa", heads="8/2", seq_len=32768, remat=True, remat_policy="full", document_mask=False,
                steps=200, batch_size=1, warmup_steps=0, msa_impl="pallas", block_size=128, topk=16, local_blocks=1,
                metrics_every=10, loss_chunk=0, attention_impl="cudnn_packed", selection="per_group", detach=True,
                context=1, devices=0, scan=False)
  if a.attention not in ("msa", "dense"):
    raise ValueError(f"configs/small_msa.py: attention={a.attention!r}; expected 'msa' or 'dense'")
  hq, _, hkv = a.heads.partition("/")
  try:
    hq, hkv = int(hq), int(hkv)
  except ValueError:
    raise ValueError(f"configs/small_msa.py: heads={a.heads!r} is not Q/KV (e.g. 8/2 or 16/1)") from None
  c = base_config()
  m = c.model
  m.vocab_size = 8192
  m.hidden_size = 1024
  m.num_hidden_layers = LAYERS
  m.num_attention_heads = hq
  m.num_key_value_heads = hkv
  m.head_dim = 128
  m.rotary_dim = 64
  m.rope_theta = 5e6
  m.dense_intermediate_size = 4096
  m.layer_types = ("full_attention",) + ("minimax_m3_sparse" if a.attention == "msa" else "full_attention",) * (
      LAYERS - 1)
  m.mlp_layer_types = ("dense",) * LAYERS
  m.index_n_heads = hkv
  m.index_head_dim = 128
  m.index_block_size = a.block_size
  m.index_topk_blocks = a.topk
  m.index_local_blocks = a.local_blocks
  m.msa_selection = a.selection
  m.detach_index_input = a.detach
  m.warmup_steps = a.warmup_steps
  m.msa_impl = a.msa_impl
  m.msa_metrics_every = a.metrics_every  # the recall diagnostics on the logged steps only (log_every 10)
  # cudnn_packed: cuDNN on its packed-documents layout with document masks, plain cuDNN without them; xla (and
  # msa_impl=xla) for a CPU smoke run
  m.attention_impl = a.attention_impl
  m.dtype = "bfloat16"
  m.remat = a.remat
  m.remat_policy = a.remat_policy
  m.scan_layers = a.scan  # one jax.lax.scan over the 7 MSA layers (the dense layer 0 alone)
  m.document_mask = a.document_mask

  c.train.steps = a.steps
  c.train.batch_size = a.batch_size
  c.train.seq_len = a.seq_len
  c.train.loss_chunk = a.loss_chunk  # e.g. 4096 for the longest contexts: the logits are never held whole
  c.train.log_every = 10
  c.train.eval_every = 0
  c.optim.learning_rate = 1e-3
  c.optim.warmup_steps = 20
  c.checkpoint.every = 0
  c.eval.batch_size = 1
  c.eval.max_batches = 2
  # context > 1 splits each sequence over that many devices (the rest of the devices go to data); devices: the
  # fake CPU devices of --mode=aot
  c.mesh.context = a.context
  if a.devices:
    c.aot_devices = a.devices
  return c
