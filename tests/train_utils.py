"""Shared pieces of the training tests: a small real-text corpus and a config small enough for 2 CPU cores."""

import glob
import os
import sys

import ml_collections

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def license_texts() -> list[str]:
  """Real English prose that every Debian/Python install ships: the licence texts."""
  files = sorted(f for f in glob.glob("/usr/share/common-licenses/*") if os.path.isfile(f))
  if len(files) < 3:  # not Debian: Python's own licence files
    files = sorted(glob.glob(os.path.join(sys.prefix, "lib", "python3*", "site-packages", "*", "LICEN[CS]E*")))
  return files[:12]


def small_config(data_dir: str, **overrides) -> ml_collections.ConfigDict:
  sys.path.insert(0, REPO)
  from configs import tiny_lm  # noqa: PLC0415
  c = tiny_lm.get_config("steps=6,batch_size=8,seq_len=32,layers=2")
  m = c.model
  m.vocab_size = 512
  m.hidden_size = 32
  m.num_attention_heads = 4
  m.num_key_value_heads = 2
  m.head_dim = 8
  m.rotary_dim = 4
  m.dense_intermediate_size = 64
  m.intermediate_size = 16
  m.shared_intermediate_size = 16
  m.num_local_experts = 4
  c.data.dir = data_dir
  c.data.use_builtin = False
  c.data.text_files = "licenses=" + ",".join(license_texts())
  c.data.vocab_size = 512
  c.train.log_every = 1
  c.train.eval_every = 0
  c.optim.warmup_steps = 2
  c.checkpoint.every = 2
  c.checkpoint.async_save = False
  c.eval.batch_size = 8
  c.eval.max_batches = 2
  for k, v in overrides.items():
    node = c
    *path, last = k.split(".")
    for p in path:
      node = node[p]
    node[last] = v
  return c


def overrides_to_flags(config_arg: str, overrides: dict) -> list[str]:
  return [f"--config={config_arg}"] + [f"--config.{k}={v}" for k, v in overrides.items()]
