"""experiments.trace_summary --hlo: kernels named back to the source lines of a real compiled program (XLA:CPU
here; the GPU dump has the same instruction names and frame tables)."""

import inspect

import jax
import jax.numpy as jnp

from experiments import trace_summary


def _program(x, y):
  z = jnp.sin(x) * y  # line A: fused with the sum below
  return jnp.sum(z * 2.0 + 1.0, axis=0) @ y.T  # line B


def test_hlo_sources_name_each_kernel_and_the_lines_fused_into_it():
  text = jax.jit(_program).lower(jnp.ones((64, 64)), jnp.ones((64, 64))).compile().as_text()
  src = trace_summary.hlo_sources(text)
  first = inspect.getsourcelines(_program)[1]
  line_a, line_b = f"test_trace_summary.py:{first + 1} (_program)", f"test_trace_summary.py:{first + 2} (_program)"
  fusions = {name: s for name, s in src.items() if "fusion" in name}
  assert fusions, sorted(src)
  # the fusion holding the sin carries both lines; every fusion's own line is one of the program's
  assert any(line_a in s["inside"] and line_b in s["inside"] for s in fusions.values()), fusions
  assert all(s["at"] in (line_a, line_b) for s in fusions.values()), fusions
  res = {"ops": [{"name": name, "ms_per_step": 1.0} for name in fusions] + [{"name": "cudnn_kernel", "ms_per_step": 2.0}]}
  trace_summary.attribute(res, src)
  assert res["by_source"]["[cudnn_kernel]"]["ms_per_step"] == 2.0  # not in the HLO: kept under its own name
  assert abs(sum(v["share"] for v in res["by_source"].values()) - 1.0) < 1e-9
  assert sum(v["ms_per_step"] for k, v in res["by_source"].items() if k != "[cudnn_kernel]") == len(fusions)
