"""The house's layering (STYLE.md), checked by reading imports, not by running them (milliseconds).

core and pallas_kernels import nothing of the project; models imports core and pallas_kernels; data imports core;
interop imports core and models; train imports those four; drivers (m3_jax/main.py, generate.py, ...) and
experiments/ import anything. No import circle between project modules, lazy (in-function) imports included:
a lazy import hides a circle from Python's loader, not from a reader.
"""

from __future__ import annotations

import ast
import os
import shutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# package -> the project packages it may import (itself always allowed)
ALLOWED: dict[str, set[str]] = {
    "m3_jax.core": set(),
    "pallas_kernels": set(),
    "m3_jax.models": {"m3_jax.core", "pallas_kernels"},
    "m3_jax.data": {"m3_jax.core"},
    "m3_jax.interop": {"m3_jax.core", "m3_jax.models"},
    "m3_jax.train": {"m3_jax.core", "m3_jax.models", "m3_jax.data", "m3_jax.interop"},
}
PROJECT_ROOTS = ("m3_jax", "pallas_kernels")


def _modules(root: str) -> dict[str, str]:
  """Dotted module name -> file, for every .py under the project packages of `root`."""
  out = {}
  for top in PROJECT_ROOTS:
    for dirpath, _, files in os.walk(os.path.join(root, top)):
      for f in files:
        if f.endswith(".py"):
          path = os.path.join(dirpath, f)
          rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
          out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
  return out


def _imports(name: str, path: str, known: set[str]) -> set[str]:
  """Project modules that `name` imports anywhere in its file (module level or inside functions)."""
  is_pkg = path.endswith("__init__.py")
  found = set()
  for node in ast.walk(ast.parse(open(path).read(), path)):
    targets = []
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:  # relative import
        parts = name.split(".") if is_pkg else name.split(".")[:-1]
        parts = parts[:len(parts) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
      # `from pkg import sub` imports the module pkg.sub; `from pkg import name` imports pkg itself
      targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    for t in targets:
      if t.split(".")[0] not in PROJECT_ROOTS:
        continue
      while t and t not in known:  # `from pkg import func` names the package
        t = t.rpartition(".")[0]
      if t and t != name:
        found.add(t)
  return found


def _layer(module: str) -> str | None:
  for layer in sorted(ALLOWED, key=len, reverse=True):
    if module == layer or module.startswith(layer + "."):
      return layer
  return None  # a driver (m3_jax/main.py, m3_jax/generate.py, m3_jax/__init__.py)


def violations(root: str) -> list[str]:
  """Every forbidden import and every import circle under `root`, as readable lines ([] when the house is tidy)."""
  mods = _modules(root)
  graph = {m: _imports(m, p, set(mods)) for m, p in mods.items()}
  bad = []
  for m, deps in sorted(graph.items()):
    layer = _layer(m)
    if layer is None:
      continue
    for d in sorted(deps):
      dl = _layer(d)
      if dl is None:
        bad.append(f"{m} imports the driver {d}")
      elif dl != layer and dl not in ALLOWED[layer]:
        bad.append(f"{m} imports {d}: {layer} may import only {sorted(ALLOWED[layer]) or 'nothing of the project'}")
  # circles: strongly connected components of more than one module (Tarjan)
  index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        comps.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  bad += [f"import circle: {' <-> '.join(c)}" for c in comps]
  return bad


def test_the_tree_keeps_its_layers():
  assert violations(REPO) == []


def _copy_tree(tmp_path) -> str:
  for top in PROJECT_ROOTS:
    shutil.copytree(os.path.join(REPO, top), tmp_path / top, ignore=shutil.ignore_patterns("__pycache__"))
  return str(tmp_path)


def _append(path, line: str) -> None:
  with open(path, "a") as f:
    f.write(f"\n\ndef _probe():\n  {line}\n")


def test_a_forbidden_import_is_caught(tmp_path):
  root = _copy_tree(tmp_path)
  _append(os.path.join(root, "m3_jax", "core", "sharding.py"), "from m3_jax.train import trainer")
  _append(os.path.join(root, "m3_jax", "data", "tokenizer.py"), "import m3_jax.models.config")
  found = violations(root)
  assert any(v.startswith("m3_jax.core.sharding imports m3_jax.train.trainer") for v in found), found
  assert any(v.startswith("m3_jax.data.tokenizer imports m3_jax.models.config") for v in found), found


def test_an_import_circle_is_caught(tmp_path):
  root = _copy_tree(tmp_path)
  # core.batch -> core.sharding -> core.batch: allowed layers, but a circle
  _append(os.path.join(root, "m3_jax", "core", "batch.py"), "from m3_jax.core import sharding")
  _append(os.path.join(root, "m3_jax", "core", "sharding.py"), "from m3_jax.core.batch import TEXT_KEYS")
  found = violations(root)
  assert "import circle: m3_jax.core.batch <-> m3_jax.core.sharding" in found, found
