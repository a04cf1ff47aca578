"""pallas_kernels.flash_attention: every implementation against the float64 oracle of tests/oracles.py (np_visible's
mask, np_attention's output and gradients), the causal skip, context parallelism inside jax.shard_map on 2 fake
devices, the compiled memory at 32K and 64K tokens, and the input checks.

Small shapes with blocks of 16 queries and 32 keys, so that every case runs several query and key blocks, a partial
last block on both axes (padding), blocks that straddle the causal diagonal and, with T < S, key blocks after the
queries that the causal skip drops.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.flash_attention import IMPLEMENTATIONS, flash_attention
from tests.oracles import assert_close, np_attention, np_causal, np_visible

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCKS = dict(block_q=16, block_k=32)


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  T: int
  S: int
  q_offset: int | None = None  # None: the default S - T
  traced: bool = False  # pass q_offset as an int32 argument of a jitted function (a tracer inside)
  packed: bool = False  # segment_ids from _segments
  Hq: int = 4
  Hkv: int = 2
  B: int = 2
  D: int = 16
  blocks: tuple[tuple[str, int], ...] = tuple(BLOCKS.items())

  @property
  def offset(self) -> int:
    return self.S - self.T if self.q_offset is None else self.q_offset


CASES = [
    # T = S = 70: 5 query blocks (the last one 6 rows), 3 key blocks (the last one 6 slots), offset 0.
    Case("square", T=70, S=70),
    # The queries are slots 17..64 of 100: keys 65..99 lie after every query and must stay invisible. Query blocks
    # end at slots 32, 48 and 64, two of them on the first slot of a key block: only their last query sees it.
    Case("middle_static", T=48, S=100, q_offset=17),
    Case("middle_traced", T=48, S=100, q_offset=17, traced=True),
    Case("suffix_default_g4", T=40, S=100, Hq=4, Hkv=1),
    Case("packed", T=64, S=64, packed=True),
    Case("packed_middle_traced", T=48, S=100, q_offset=33, traced=True, packed=True),
    # Default blocks are capped by T and S: one block each.
    Case("default_blocks", T=50, S=50, blocks=()),
]


def _segments(B: int, S: int) -> np.ndarray:
  """int32 [B, S]: packed documents of uneven lengths, with padding runs of id 0 between and after them; ids repeat
  across rows and are not sorted (only equality matters)."""
  runs = [[(3, 11), (0, 4), (1, 20), (2, 7), (0, 9), (5, 30), (0, 25)], [(7, 30), (0, 3), (9, 25), (4, 6), (0, 50)]]
  return np.stack([np.concatenate([np.full(n, sid) for sid, n in runs[b % 2]])[:S] for b in range(B)]).astype(
      np.int32)


def _inputs(c: Case, seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
  return dict(q=f(c.B, c.T, c.Hq, c.D), k=f(c.B, c.S, c.Hkv, c.D), v=f(c.B, c.S, c.Hkv, c.D),
              dout=f(c.B, c.T, c.Hq, c.D), segment_ids=_segments(c.B, c.S) if c.packed else None)


def _run(impl: str, x: dict, c: Case, dtype=jnp.float32) -> list[np.ndarray]:
  """(out, dq, dk, dv) for the cotangent x['dout'], all under one jax.jit; a traced case passes q_offset as an int32
  argument of that jit, so the op sees a tracer."""
  seg = None if x["segment_ids"] is None else jnp.asarray(x["segment_ids"])

  def fwd_bwd(q, k, v, dout, offset):
    f = lambda q, k, v: flash_attention(q, k, v, q_offset=offset, segment_ids=seg, implementation=impl,  # noqa
                                        **dict(c.blocks))
    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(dout))

  arrays = [jnp.asarray(x[n], dtype) for n in ("q", "k", "v", "dout")]
  if c.traced:
    got = jax.jit(fwd_bwd)(*arrays, jnp.int32(c.offset))
  else:
    got = jax.jit(lambda *a: fwd_bwd(*a, c.q_offset))(*arrays)
  return [np.asarray(g.astype(jnp.float32)) for g in got]


def _oracle(x: dict, c: Case) -> tuple[np.ndarray, ...]:
  support = np_visible(c.T, c.S, c.offset, x["segment_ids"])[:, None]  # [B or 1, 1, T, S]
  return np_attention(x["q"], x["k"], x["v"], support, c.D ** -0.5, x["dout"])


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("c", CASES, ids=lambda c: c.name)
def test_matches_oracle_with_gradients(impl, c):
  x = _inputs(c)
  for name, got, want in zip(("out", "dq", "dk", "dv"), _run(impl, x, c), _oracle(x, c)):
    assert np.isfinite(got).all(), name
    assert_close(got, want, f"{c.name} {name}")


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_bf16_inputs(impl):
  """bf16 q, k, v (and cotangent) against the oracle on the same bf16-rounded values. The implementations round the
  outputs to bf16 (both), and p and ds before their matmuls and the stored O that enters delta (xla): each rounding
  is a relative error <= 2^-9 ~ 0.2%, and a few of them stack (measured: <= 0.41% of each array's largest entry for
  xla, <= 0.31% for reference). Bound: 2^-6 ~ 1.6% of the largest entry. A mask shifted by one slot (q_offset 34
  instead of 33) changes every array by ~100% of that scale."""
  c = Case("packed_middle_traced_bf16", T=48, S=100, q_offset=33, traced=True, packed=True)
  x = _inputs(c)
  for n in ("q", "k", "v", "dout"):
    x[n] = np.asarray(jnp.asarray(x[n], jnp.bfloat16).astype(jnp.float32))
  for name, got, want in zip(("out", "dq", "dk", "dv"), _run(impl, x, c, jnp.bfloat16), _oracle(x, c)):
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 2 ** -6 * scale, (name, np.abs(got - want).max(), scale)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_row_without_keys_gives_zero_and_finite_gradients(impl):
  """A traced offset of -3 (the API cannot check it) puts queries 0..2 before slot 0: they see no key. Output 0 and
  zero gradients from those rows, no NaN anywhere, and the other rows still match the oracle."""
  c = Case("negative_offset", T=40, S=40, q_offset=-3, traced=True)
  x = _inputs(c)
  got = _run(impl, x, c)
  want = np_attention(x["q"], x["k"], x["v"], np_causal(c.T, c.S, -3)[None, None], c.D ** -0.5, x["dout"])
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    assert np.isfinite(g).all(), name
    assert_close(g, w, name)
  assert not got[0][:, :3].any() and not got[1][:, :3].any()


def test_causal_skip_never_reads_future_blocks():
  """The xla implementation skips key blocks that start after a query block's last query (lax.cond), instead of
  computing and masking them. Proof: NaN keys and values from the first key block after the last query on. A masked
  block would still compute 0 * NaN = NaN in p @ v; a skipped one is never read. The result equals the oracle on the
  finite prefix, and the skipped keys get zero gradients."""
  c = Case("middle_nan_tail", T=48, S=100, q_offset=17)
  x = _inputs(c)
  first_skipped = -(-(c.offset + c.T) // BLOCKS["block_k"]) * BLOCKS["block_k"]  # 96: key block 3 starts past slot 64
  assert first_skipped < c.S
  x["k"][:, first_skipped:] = np.nan
  x["v"][:, first_skipped:] = np.nan
  got = _run("xla", x, c)
  finite = {n: x[n][:, :first_skipped] for n in ("k", "v")}
  want = np_attention(x["q"], finite["k"], finite["v"], np_causal(c.T, first_skipped, c.offset)[None, None],
                      c.D ** -0.5, x["dout"])
  for name, g, w in zip(("out", "dq"), got[:2], want[:2]):
    assert_close(g, w, name)
  for name, g, w in zip(("dk", "dv"), got[2:], want[2:]):
    assert_close(g[:, :first_skipped], w, name)
    assert not g[:, first_skipped:].any(), name


# Context parallelism on 2 fake CPU devices (the flag must be set before jax is imported, hence a subprocess): each
# device holds T / 2 queries and S / 2 keys of a packed sequence; its query offset comes from axis_index (a tracer that
# varies over the mesh axis). Two layouts: keys all-gathered inside (they vary over the axis like the queries), and
# keys, values and segment ids replicated (invariant over the axis: the custom VJP must still return cotangents of
# their type, and the gradients of the replicated keys are summed over devices). Output and gradients against the
# float64 oracle of the whole sequence.
TWO_DEVICES = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from pallas_kernels.flash_attention import flash_attention
from tests.oracles import np_attention, np_visible
from tests.test_flash_attention import _segments

mesh = Mesh(np.array(jax.devices()), ("seq",))
B, T, Hq, Hkv, D = 2, 96, 4, 2, 16
rng = np.random.default_rng(0)
q, dout = (rng.standard_normal((B, T, Hq, D)).astype(np.float32) for _ in range(2))
k, v = (rng.standard_normal((B, T, Hkv, D)).astype(np.float32) for _ in range(2))
seg = _segments(B, T)
want = np_attention(q, k, v, np_visible(T, T, 0, seg)[:, None], D ** -0.5, dout)

def attend(q, k, v, seg, gather):
  if gather:
    k, v, seg = (jax.lax.all_gather(a, "seq", axis=1, tiled=True) for a in (k, v, seg))
  offset = jax.lax.axis_index("seq") * q.shape[1]
  return flash_attention(q, k, v, q_offset=offset, segment_ids=seg, block_q=16, block_k=32)

out = {"devices": jax.device_count()}
for gather in (True, False):
  kv = P(None, "seq") if gather else P()
  f = jax.shard_map(lambda q, k, v, s: attend(q, k, v, s, gather), mesh=mesh,
                    in_specs=(P(None, "seq"), kv, kv, kv), out_specs=P(None, "seq"))

  def fwd_bwd(q, k, v):
    o, vjp = jax.vjp(lambda q, k, v: f(q, k, v, seg), q, k, v)
    return (o, *vjp(jnp.asarray(dout)))

  got = jax.jit(fwd_bwd)(q, k, v)
  out["gather" if gather else "replicated"] = [float(np.abs(np.asarray(g) - w).max() / np.abs(w).max())
                                               for g, w in zip(got, want)]
print(json.dumps(out))
"""


def test_context_parallel_shard_map_two_devices():
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
  p = subprocess.run([sys.executable, "-c", TWO_DEVICES], cwd=REPO, env=env, capture_output=True, text=True,
                     timeout=300)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  out = json.loads(p.stdout.strip().splitlines()[-1])
  assert out["devices"] == 2
  for layout in ("gather", "replicated"):
    # f32: relative to each array's largest entry, the same accuracy as the one-device cases.
    assert max(out[layout]) <= 1e-5, (layout, out[layout])


def test_memory_stays_linear_at_64k_tokens():
  """Compiled, not run: the gradient of T = S tokens in bf16 (B=1, Hq=2, Hkv=1, D=64) at 32K and 64K.

  Closed form: temporaries grow as T, not T * S. Per token: the residual out and the stacked dq of the query-block
  map (Hq * D * 2 B = 256 B each), the stacked dk and dv of the key-block map (128 B each), lse and delta (8 B each):
  784 B, i.e. 49 MiB at 64K, plus a few [Hq, 512, 512] f32 block buffers (2 MiB each, reused across iterations).
  Measured on CPU: 30.7 MiB at 32K, 59.0 MiB at 64K. One f32 score matrix would be T * S * 4 B = 16 GiB per head
  at 64K; the bound asserted is 1/50 of that (328 MiB), and doubling T must not much more than double the
  temporaries (a T x S buffer would quadruple them).
  """
  loss = lambda q, k, v: jnp.sum(flash_attention(q, k, v).astype(jnp.float32))  # noqa: E731
  temp = {}
  for T in (32768, 65536):
    q = jax.ShapeDtypeStruct((1, T, 2, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, T, 1, 64), jnp.bfloat16)
    compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, kv, kv).compile()
    temp[T] = compiled.memory_analysis().temp_size_in_bytes
    print(f"temporaries at T = S = {T}: {temp[T] / 2**20:.1f} MiB")
  assert temp[65536] < 65536 * 65536 * 4 / 50, temp
  assert temp[65536] <= 2.1 * temp[32768], temp



def test_memory_inside_scanned_layers():
  """Compiled, not run: the gradient of two layers of attention under jax.lax.scan (scanned layer stacks) at 4096
  tokens, against one layer without the scan. Nothing may be stacked per block pair: when the masks depended on
  nothing the scan carries, JAX's partial evaluation hoisted them out of the loops and kept them for all 8 x 8
  block pairs ([8, 8, 1, 1, 2, 512, 512] bool and f32: 208 MiB here against 11 MiB unscanned; 2 TiB per device
  for M3's dense layers at 1M tokens over 16 devices). Measured since the fix: 11 MiB and 22 MiB."""
  shape = jax.ShapeDtypeStruct((1, 4096, 2, 64), jnp.bfloat16)

  def layer(x):  # self-attention of x as q, k and v (GQA 2:2), a residual add
    return x + flash_attention(x, x, x).astype(x.dtype)

  def temps(fn):
    loss = lambda x: jnp.sum(fn(x).astype(jnp.float32))  # noqa: E731
    return jax.jit(jax.grad(loss)).lower(shape).compile().memory_analysis().temp_size_in_bytes

  one = temps(layer)
  scanned = temps(lambda x: jax.lax.scan(lambda c, _: (layer(c), None), x, None, length=2)[0])
  print(f"temporaries: one layer {one / 2**20:.1f} MiB, two scanned layers {scanned / 2**20:.1f} MiB")
  assert scanned <= 3 * one, (one, scanned)

def test_bad_inputs_name_the_problem():
  q, k = jnp.ones((1, 8, 4, 16)), jnp.ones((1, 8, 2, 16))
  with pytest.raises(ValueError, match=r"q: shape \(8, 4, 16\) has rank 3, expected rank 4"):
    flash_attention(q[0], k, k)
  with pytest.raises(ValueError, match="Hq=3 heads .* not a multiple of Hkv=2"):
    flash_attention(jnp.ones((1, 8, 3, 16)), k, k)
  with pytest.raises(ValueError, match=r"k: shape \(1, 8, 2, 8\), expected \[B=1, S, Hkv, D=16\]"):
    flash_attention(q, jnp.ones((1, 8, 2, 8)), k)
  with pytest.raises(ValueError, match="v: shape .* expected the shape of k"):
    flash_attention(q, k, jnp.ones((1, 9, 2, 16)))
  with pytest.raises(TypeError, match="expected the dtype of q"):
    flash_attention(q, k.astype(jnp.bfloat16), k)
  with pytest.raises(ValueError, match="T=8 queries but k has only S=4 keys"):
    flash_attention(q, k[:, :4], k[:, :4])
  for bad in (-1, 1, jnp.int32(3)):  # S - T = 0 for these shapes
    with pytest.raises(ValueError, match=r"q_offset=-?\d with T=8 queries and S=8 keys: expected 0 <= q_offset"):
      flash_attention(q, k, k, q_offset=bad)
  with pytest.raises(TypeError, match="q_offset=2.0"):
    flash_attention(q, k, k, q_offset=2.0)
  with pytest.raises(TypeError, match=r"q_offset: array of shape \(2,\)"):
    flash_attention(q, k, k, q_offset=jnp.zeros(2, jnp.int32))
  with pytest.raises(ValueError, match=r"segment_ids: shape \(1, 7\), expected \[B=1, S=8\]"):
    flash_attention(q, k, k, segment_ids=jnp.zeros((1, 7), jnp.int32))
  with pytest.raises(TypeError, match="segment_ids: dtype float32"):
    flash_attention(q, k, k, segment_ids=jnp.zeros((1, 8)))
  with pytest.raises(ValueError, match="block_k=0: expected None or an int >= 1"):
    flash_attention(q, k, k, block_k=0)
  with pytest.raises(ValueError, match="implementation='pallas'"):
    flash_attention(q, k, k, implementation="pallas")
