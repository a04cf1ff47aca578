r"""The real MiniMax-M3 text tower (60 layers, width 6144, 64/4 GQA x 128, 128 experts top-4): for ahead-of-time
compilation and memory analysis on a fake device mesh, not for training here.

  python -m m3_jax.main --config=configs/m3.py --workdir=/tmp/m3_aot --mode=aot
  python -m m3_jax.main --config=configs/m3.py:devices=256 --workdir=/tmp/m3_aot --mode=aot
  python -m m3_jax.main --config=configs/m3.py:dense_attention=True,scan=False,moe_impl=ragged ...  # the first AOT

`--mode=aot` fakes `devices` CPU devices, builds the sharded train state abstractly (nothing is allocated),
compiles one train step and prints bytes per device against one H200.

Defaults: the real layer recipe (layers 0-2 dense attention + dense MLP, 3-59 MSA + MoE), the layers scanned
(`scan`: two stacks, so compile time does not grow with depth), the experts expert-parallel (shard_map +
all-to-all over `expert`; `matmul`: their grouped matmul, `tiled` by default), bf16 compute on f32 master weights and AdamW moments, full remat, 4096 tokens per
sequence. Mesh: tensor=4 x expert=4, and every other device in `fsdp` (fsdp=0: devices / (tensor x expert), so
the f32 state shrinks as 1 / devices; data=1). Batch: one sequence per batch-parallel shard (batch_size=0:
data x fsdp x expert), so the activations of a device stay those of one 4096-token sequence at every size.

1M tokens per sequence with context parallelism (`context`: the sequence split over that many devices; `moe_chunk`:
the expert-parallel exchange 4096 tokens at a time; `loss_chunk`: the output layer 8192 positions at a time):

  python -m m3_jax.main --config=configs/m3.py:devices=256,context=16,seq_len=1048576,moe_chunk=4096,loss_chunk=8192 \
      --workdir=/tmp/m3_1m --mode=aot
"""

from m3_jax.models.config import TextConfig
from m3_jax.train.config_lib import parse_arg
from m3_jax.train.defaults import base_config


def get_config(arg=None):
  a = parse_arg(arg, devices=64, fsdp=0, tensor=4, expert=4, seq_len=4096, batch_size=0, dense_attention=False,
                layers=60, scan=True, moe_impl="expert_parallel", matmul="tiled", context=1, moe_chunk=0,
                loss_chunk=0)
  c = base_config()
  m3 = TextConfig()
  layer_types = list(m3.layer_types[:a.layers])
  if a.dense_attention:
    layer_types = ["full_attention"] * a.layers
  c.model.num_hidden_layers = a.layers
  c.model.layer_types = tuple(layer_types)
  c.model.mlp_layer_types = tuple(m3.mlp_layer_types[:a.layers])
  c.model.dtype = "bfloat16"
  c.model.param_dtype = "float32"
  c.model.remat = True
  c.model.scan_layers = a.scan
  c.model.moe_impl = a.moe_impl
  # tiled: the memory-bounded grouped matmul that compiles for any backend (the fake CPU mesh included); on H100 /
  # H200s matmul=mosaic runs the Hopper kernels with the same O(rows) footprint.
  c.model.grouped_matmul_impl = a.matmul
  c.model.moe_chunk_tokens = a.moe_chunk
  fsdp = a.fsdp or max(1, a.devices // (a.tensor * a.expert * a.context))
  c.mesh.data = a.devices // (fsdp * a.tensor * a.expert * a.context)
  c.mesh.fsdp, c.mesh.tensor, c.mesh.expert, c.mesh.context = fsdp, a.tensor, a.expert, a.context
  c.train.loss_chunk = a.loss_chunk
  c.train.seq_len = a.seq_len
  c.train.batch_size = a.batch_size or c.mesh.data * fsdp * a.expert
  c.eval.batch_size = c.train.batch_size
  c.aot_devices = a.devices
  return c
