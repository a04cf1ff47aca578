r"""How an HF MiniMax-M3 checkpoint would be loaded onto a device mesh: every HF tensor's target sharding and the
bytes each device holds, from a shape-only checkpoint on fake CPU devices (nothing is read or allocated).

  python -m m3_jax.interop.plan --config=configs/m3.py --devices=64
  python -m m3_jax.interop.plan --config=configs/m3.py:fsdp=8,tensor=8,expert=2 --devices=128
  python -m m3_jax.interop.plan --config=configs/m3.py --checkpoint=/path/to/MiniMax-M3   # a real directory

The model comes from --config (`TextConfig.from_dict(config.model)`, the model `--mode=aot` compiles) or, with
--checkpoint, from that directory's config.json and safetensors headers; the mesh layout from `config.mesh` (with
--devices, `data` takes what the other axes leave). For each --dtypes entry the plan is `hf.load(..., abstract=True)`
on the shape-only checkpoint: it prints a table per tensor kind and writes the full per-tensor map as JSON (default
experiments/results/m3_load_plan_<devices>dev.json).
"""

from __future__ import annotations

import json
import os
import tempfile

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/m3.py", "model + mesh config", lock_config=False)
_DEVICES = flags.DEFINE_integer("devices", None, "fake CPU devices (default: the config's aot_devices)")
_CKPT = flags.DEFINE_string("checkpoint", None, "an HF checkpoint directory (only config.json + headers are read)")
_LAYOUT = flags.DEFINE_enum("layout", "hf", ["hf", "hf_vl", "minimax"], "tensor names of the shape-only checkpoint")
_DTYPES = flags.DEFINE_list("dtypes", ["bfloat16", "float32"], "parameter dtypes to plan")
_OUT = flags.DEFINE_string("out", None, "JSON output (default experiments/results/m3_load_plan_<devices>dev.json)")

MiB, GiB = 2**20, 2**30


def fake_cpu_devices(n: int) -> None:
  """n CPU devices for planning. Must run before JAX starts its backend (the first jax.devices() call), which is
  when XLA reads XLA_FLAGS."""
  xla_flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in xla_flags:
    os.environ["XLA_FLAGS"] = f"{xla_flags} --xla_force_host_platform_device_count={n}".strip()
  import jax  # noqa: PLC0415
  jax.config.update("jax_platforms", "cpu")


def kind_rows(p) -> list[dict]:
  """One row per tensor kind (layer index folded into `*`), bytes summed over the layers it appears in."""
  rows: dict[str, dict] = {}
  for e in p.entries:
    by_dev = e.bytes_by_device()
    r = rows.setdefault(e.kind, {
        "kind": e.kind, "count": 0, "hf_shape": list(e.rule.hf_shape), "shape": list(e.shape), "dtype": str(e.dtype),
        "logical_axes": list(e.logical_axes or ()), "spec": str(e.sharding.spec) if e.sharding is not None else None,
        "shard_shape": list(e.shard_shape()), "bytes_global": 0, "bytes_per_device_max": 0})
    r["count"] += 1
    r["bytes_global"] += e.bytes_global()
    r["bytes_per_device_max"] += max(by_dev.values())
  return list(rows.values())


def report(p) -> dict:
  per_dev = p.bytes_per_device()
  return {
      "param_dtype": p.config.param_dtype,
      "bytes_per_device_max": max(per_dev.values()), "bytes_per_device_min": min(per_dev.values()),
      "bytes_global": sum(e.bytes_global() for e in p.entries),
      "kinds": kind_rows(p),
  }


def tensor_map(p) -> list[dict]:
  """Every HF tensor (composites: first and last stored name) -> our parameter, its mesh spec and shard shape."""
  return [{"hf": e.source.names if len(e.source.names) <= 2 else [e.source.names[0], "...", e.source.names[-1]],
           "ours": e.ours, "spec": str(e.sharding.spec), "shard_shape": list(e.shard_shape())} for e in p.entries]


def table(rep: dict) -> str:
  lines = [f"{'tensor kind':58s} {'n':>3s} {'HF shape':>20s} {'mesh spec':38s} {'shard':>22s} {'MiB/dev':>10s}"]
  for r in rep["kinds"]:
    lines.append(f"{r['kind']:58s} {r['count']:3d} {str(tuple(r['hf_shape'])):>20s} {r['spec']:38s} "
                 f"{str(tuple(r['shard_shape'])):>22s} {r['bytes_per_device_max'] / MiB:10.1f}")
  return "\n".join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  config = _CONFIG.value
  n = int(_DEVICES.value or config.get("aot_devices", 0) or 0)
  if n <= 0:
    raise app.UsageError("--devices is required (the config has no aot_devices)")
  fake_cpu_devices(n)  # before anything can start JAX's backend: the imports below come after it
  import jax  # noqa: PLC0415
  from m3_jax.core import sharding  # noqa: PLC0415
  from m3_jax.interop import hf  # noqa: PLC0415
  from m3_jax.models.config import TextConfig  # noqa: PLC0415
  from m3_jax.models.flops import param_count  # noqa: PLC0415
  if jax.device_count() < n:
    raise RuntimeError(f"{n} devices requested but JAX started with {jax.device_count()}")
  shape = dict(config.mesh)
  if _DEVICES.value:
    shape["data"] = -1
  mesh = sharding.make_mesh(shape, jax.devices()[:n])
  out = {"devices": n, "mesh": dict(mesh.shape), "plans": {}}
  with tempfile.TemporaryDirectory() as tmp:
    path = _CKPT.value
    if path is None:
      cfg = TextConfig.from_dict(config.model.to_dict())
      path = os.path.join(tmp, "m3_shape_only")
      hf.abstract_checkpoint(cfg, path, layout=_LAYOUT.value)
      out["checkpoint"] = f"shape-only, {_LAYOUT.value} layout, from TextConfig.from_dict(--config's model)"
    else:
      out["checkpoint"] = path
    text_only = _LAYOUT.value != "hf" and _CKPT.value is None
    for dt in _DTYPES.value:
      p = hf.load_plan(path, dt, mesh, text_only=text_only)
      model, _ = hf.load(path, dt, mesh, text_only=text_only, abstract=True)  # what load(abstract=True) builds
      leaves = jax.tree.leaves(model)
      assert all(isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None for x in leaves)
      rep = report(p)
      out["plans"][dt] = rep
      out.setdefault("tensors", tensor_map(p))  # the same specs for every dtype
      counts = param_count(p.config)
      out["params_total"], out["params_active_per_token"] = counts["total"], counts["active"]
      print(f"\n== {counts['total'] / 1e9:.1f}B parameters, {p.config.num_hidden_layers} layers, "
            f"params {dt}, mesh {dict(mesh.shape)} on {n} fake devices ==")
      print(table(rep))
      print(f"per device: {rep['bytes_per_device_max'] / GiB:.2f} GiB (min over devices "
            f"{rep['bytes_per_device_min'] / GiB:.2f} GiB); global {rep['bytes_global'] / GiB:.1f} GiB; "
            f"{len(p.entries)} HF tensors in {len(rep['kinds'])} kinds")
  dest = _OUT.value or os.path.join("experiments", "results", f"m3_load_plan_{n}dev.json")
  os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
  with open(dest, "w") as f:
    json.dump(out, f, indent=1)
  print(f"wrote {dest}")


if __name__ == "__main__":
  app.run(main)
