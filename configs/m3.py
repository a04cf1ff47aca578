r"""The real MiniMax-M3 text tower (60 layers, width 6144, 64/4 GQA x 128, 128 experts top-4): for ahead-of-time
compilation and memory analysis on a fake device mesh, not for training here.

  python -m m3_jax.main --config=configs/m3.py --workdir=/tmp/m3_aot --mode=aot
  python -m m3_jax.main --config=configs/m3.py:devices=128,fsdp=16 --workdir=/tmp/m3_aot --mode=aot

`--mode=aot` fakes `devices` CPU devices, builds the sharded train state abstractly (nothing is allocated),
compiles one train step and prints bytes per device.
"""

from m3_jax.models.config import TextConfig
from m3_jax.train.config_lib import parse_arg
from m3_jax.train.defaults import base_config


def get_config(arg=None):
  a = parse_arg(arg, devices=64, fsdp=4, tensor=4, expert=4, seq_len=4096, batch_size=16, dense_attention=False,
                layers=60)
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
  c.mesh.data = a.devices // (a.fsdp * a.tensor * a.expert)
  c.mesh.fsdp, c.mesh.tensor, c.mesh.expert = a.fsdp, a.tensor, a.expert
  c.train.seq_len = a.seq_len
  c.train.batch_size = a.batch_size
  c.aot_devices = a.devices
  return c
