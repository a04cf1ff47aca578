"""Ahead-of-time compilation of one train step on a fake device mesh: how a model too big for this machine would
be sharded, and how many bytes each device would hold. Nothing is allocated: the state is abstract."""

from __future__ import annotations

import json
import math
import os
import time

import jax
import jax.numpy as jnp
import ml_collections

from m3_jax.core import sharding
from m3_jax.core.batch import TEXT_KEYS
from m3_jax.models.flops import param_count
from m3_jax.train import config_lib, memory
from m3_jax.train.checks import check_fits
from m3_jax.train.optimizer import make_optimizer
from m3_jax.train.state import make_init_fn, param_shardings, state_shardings_for
from m3_jax.train.steps import make_train_step


def fake_devices(n: int) -> None:
  """Must run before JAX initialises its backend (the first jax.devices() call)."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
  jax.config.update("jax_platforms", "cpu")


# One H200's memory, the device the M3 step is sized for (the budget the verdict line checks).
H200_BYTES = 141 * 2**30


def _gib(b: float) -> str:
  return f"{b / 2**30:,.2f} GiB"


def device_total(mem) -> int | None:
  """Bytes one device holds while the step runs: its arguments, the outputs that do not reuse a donated argument,
  and the temporaries."""
  if mem is None:
    return None
  return mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes


def compile_report(config: ml_collections.ConfigDict, workdir: str) -> dict:
  n = int(config.get("aot_devices", 0) or jax.device_count())
  if jax.device_count() < n:
    raise RuntimeError(f"aot: {n} devices requested but JAX already started with {jax.device_count()}; "
                       "run --mode=aot in a fresh process")
  cfg = config_lib.model_config(config)
  mesh = sharding.make_mesh(dict(config.mesh), jax.devices()[:n])
  check_fits(cfg, config, mesh)
  tx, schedule = make_optimizer(config_lib.optim_config(config))
  graphdef, _, (p_sh, r_sh) = param_shardings(cfg, mesh)

  init = make_init_fn(cfg, tx)
  abstract = jax.eval_shape(init, jax.random.key(0))
  state_sh = state_shardings_for(abstract, p_sh, r_sh, mesh)
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, state_sh)
  b, t = int(config.train.batch_size), int(config.train.seq_len)
  bsh = sharding.batch_sharding(mesh)
  batch = {k: jax.ShapeDtypeStruct((b, t), jnp.float32 if k == "loss_mask" else jnp.int32, sharding=bsh)
           for k in TEXT_KEYS}
  step = jax.jit(make_train_step(graphdef, tx, schedule, moe_aux_coef=float(cfg.router_aux_loss_coef),
                                 kl_weight=cfg.kl_weight, router_bias_rate=float(cfg.router_bias_update_rate),
                                 loss_chunk=int(config.train.get("loss_chunk", 0))),
                 in_shardings=(state_sh, bsh), out_shardings=(state_sh, None), donate_argnums=(0,))
  t0 = time.time()
  with jax.set_mesh(mesh):
    lowered = step.lower(abstract, batch)
  t_lower = time.time() - t0
  compiled = lowered.compile()
  t_compile = time.time() - t0 - t_lower
  mem = compiled.memory_analysis()
  counts = param_count(cfg)
  params_b = sharding.bytes_per_device(abstract.params)
  opt_b = sharding.bytes_per_device(abstract.opt_state)
  loss_chunk = int(config.train.get("loss_chunk", 0))
  text = config_lib.text_config(cfg)
  modelled = memory.model_bytes(text, dict(mesh.shape), b, t, params_b["per_device"] + opt_b["per_device"],
                                params_b["per_device"], loss_chunk)
  # The longest sequence this mesh and batch would fit by the model (in 64K steps, a multiple of 2 x context).
  step_tokens = math.lcm(65536, 2 * int(mesh.shape.get("context", 1)))
  longest = memory.longest_sequence(text, dict(mesh.shape), b, params_b["per_device"] + opt_b["per_device"],
                                    params_b["per_device"], H200_BYTES, loss_chunk, multiple=step_tokens)
  report = {
      "memory_model_bytes_per_device": modelled, "memory_model_longest_seq_len": longest,
      "mesh": dict(mesh.shape), "devices": n, "batch_size": b, "seq_len": t,
      "params_total": counts["total"], "params_active_per_token": counts["active"],
      "param_bytes_per_device": params_b["per_device"], "param_bytes_global": params_b["global"],
      "opt_state_bytes_per_device": opt_b["per_device"],
      "compiled_argument_bytes_per_device": getattr(mem, "argument_size_in_bytes", None),
      "compiled_output_bytes_per_device": getattr(mem, "output_size_in_bytes", None),
      "compiled_temp_bytes_per_device": getattr(mem, "temp_size_in_bytes", None),
      "compiled_alias_bytes_per_device": getattr(mem, "alias_size_in_bytes", None),  # outputs in donated inputs
      "total_bytes_per_device": device_total(mem), "budget_bytes_per_device": H200_BYTES,
      "scan_layers": cfg.scan_layers, "moe_impl": cfg.moe_impl, "layer_types": sorted(set(cfg.layer_types)),
      "lower_seconds": t_lower, "compile_seconds": t_compile,
  }
  lines = [
      f"model: {counts['total'] / 1e9:,.1f}B parameters ({counts['active'] / 1e9:,.1f}B active per token), "
      f"{cfg.num_hidden_layers} layers",
      f"mesh {dict(mesh.shape)} ({n} {jax.devices()[0].platform} devices), batch {b} x {t} tokens",
      f"params per device     {_gib(params_b['per_device'])}  (global {_gib(params_b['global'])})",
      f"optimizer per device  {_gib(opt_b['per_device'])}",
  ]
  if mem is not None:
    total = device_total(mem)
    lines += [f"compiled step: arguments {_gib(mem.argument_size_in_bytes)} (params, optimizer, batch), outputs "
              f"{_gib(mem.output_size_in_bytes)} ({_gib(mem.alias_size_in_bytes)} of them in donated arguments), "
              f"temporaries {_gib(mem.temp_size_in_bytes)} per device",
              f"total per device      {_gib(total)}: "
              + (f"fits one H200 ({_gib(H200_BYTES)})" if total <= H200_BYTES
                 else f"does NOT fit one H200 ({_gib(H200_BYTES)}), {_gib(total - H200_BYTES)} over"),
              f"memory model          {memory.fmt(modelled)} ({modelled['total'] / total:.2f}x the compiled "
              "total; train/memory.py)",
              f"longest sequence      {longest:,} tokens per sequence at this mesh and batch by the memory model "
              f"(within {_gib(H200_BYTES)} per device)"]
  lines += [f"lowered in {t_lower:.1f}s, compiled in {t_compile:.1f}s"]
  print("\n".join(lines), flush=True)
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, "aot_report.json")
  with open(path, "w") as f:
    json.dump(report, f, indent=2)
  print(f"wrote {path}")
  return report
