"""What is read and measured from a finished run: its held-out evaluations and text stream (metrics.jsonl), and,
from its final checkpoint, the text->visual attention mass per layer and the attention maps of a few examples."""

from __future__ import annotations

import json

import jax
import numpy as np

from experiments.lib import metrics, training
from m3_jax.core.batch import IMAGE, MM_KEYS, VIDEO

# held-out batches per modality for the attention mass (each holds many examples)
ATTENTION_BATCHES = 2


def read_text_stream(workdir: str) -> list[list]:
  """[[step, text tokens, text hash]] at every logged train step."""
  rows = metrics.rows_by_step(metrics.read(workdir), "data/text_hash")
  return [[s, rows[s]["data/text_tokens"], rows[s]["data/text_hash"]] for s in sorted(rows)]


def reduce_mass(masses, counts) -> list[float]:
  """Per-batch text->visual attention mass [n_batches, layers, heads] (each the mean over that batch's text queries
  that see visual tokens) and their query counts [n_batches] -> mass per layer: the mean over all those queries of
  all batches (batches weighted by their query counts), then over heads. Batches without such queries add nothing."""
  m = np.asarray(masses, np.float64)
  c = np.asarray(counts, np.float64)
  if m.ndim != 3 or c.shape != m.shape[:1]:
    raise ValueError(f"reduce_mass: masses {m.shape} must be [n_batches, layers, heads] and counts {c.shape} "
                     f"[n_batches]")
  if c.sum() <= 0:
    raise ValueError("reduce_mass: no text query sees a visual token in any batch")
  per_head = np.einsum("blh,b->lh", m, c) / c.sum()  # [layers, heads]
  return per_head.mean(axis=1).tolist()


def uniform_mass(inputs, segment_ids):
  """The text->visual mass [1] of attention spread evenly over each query's visible tokens (causal, same segment):
  the share of visual tokens in what each text query sees, the reference for the learned masses."""
  ids, seg = np.asarray(inputs), np.asarray(segment_ids)
  t = ids.shape[1]
  visible = np.tril(np.ones((t, t), bool))[None] & (seg[:, :, None] == seg[:, None, :])  # [B, T, S]
  probs = visible / visible.sum(-1, keepdims=True)
  mass, _ = training.text_to_visual_mass(probs[:, None].astype(np.float32), np.isin(ids, (IMAGE, VIDEO)), seg)
  return mass


def example_map(probs, inputs, segment_ids, row: int) -> dict | None:
  """The first visual span of `row` (its first segment holding one): its caption's attention over its visual tokens.

  probs: [layers, B, T, T] head-mean attention of a batch. Queries are the segment's tokens after the span's end
  marker (the caption and <|endoftext|>); returns {"kind", "layers": [layers][n_visual] mean over those queries,
  "mass": [layers] their total on the span} or None when the row has no visual span followed by text."""
  ids, seg = np.asarray(inputs[row]), np.asarray(segment_ids[row])
  for s in np.unique(seg[seg > 0]):
    idx = np.flatnonzero(seg == s)
    vis = idx[np.isin(ids[idx], (IMAGE, VIDEO))]
    if not vis.size:
      continue
    queries = idx[idx > vis[-1] + 1]  # after the end marker
    if not queries.size:
      continue
    p = np.asarray(probs[:, row], np.float64)[:, queries][:, :, vis]  # [layers, Q, n_visual]
    per_key = p.mean(axis=1)  # [layers, n_visual]
    return {"kind": "image" if ids[vis[0]] == IMAGE else "video", "layers": per_key.tolist(),
            "mass": per_key.sum(axis=1).tolist()}
  return None


def analyse_attention(config, workdir: str, sources: dict[str, list[str]], examples_path: str | None) -> dict:
  """Text->visual attention mass per layer (image and video batches) and attention maps of a few examples, from
  the final checkpoint of `workdir`. Writes the examples' pixels to `examples_path` (the same for every run)."""
  mesh, graphdef, params, rest = training.load_trained(config, workdir)
  capture = training.attention_capture(graphdef)
  out: dict = {"attention": {}, "maps": []}
  pictures = []
  with jax.set_mesh(mesh):
    for kind in ("image", "video"):
      masses, counts, uniform = [], [], []
      names = sources[kind] + (sources["real"] if kind == "video" else [])
      for name in names:
        batches = training.eval_batches(config, name)[:ATTENTION_BATCHES]
        for i, b in enumerate(batches):
          host = {k: b[k] for k in MM_KEYS if k in b}
          mass, n, probs = jax.device_get(capture(params, rest, training.to_devices(host, mesh)))
          masses.append(mass)
          counts.append(float(n))
          uniform.append(np.asarray(uniform_mass(host["inputs"], host["segment_ids"]))[None])  # [1 layer, 1 head]
          # maps: the first example of the first batch of the first two image sources and of synthetic video
          want_map = i == 0 and name in (sources["image"][:2] + sources["video"][:1])
          if want_map:
            m = example_map(probs, host["inputs"], host["segment_ids"], 0)
            if m is not None:
              m["source"] = name
              out["maps"].append(m)
              pictures.append(_example_pixels(host, m["kind"]))
      if counts and sum(counts) > 0:
        out["attention"][kind] = {"layers": reduce_mass(masses, counts), "queries": sum(counts),
                                  "uniform": reduce_mass(uniform, counts)[0], "sources": names}
  if examples_path and pictures:
    with open(examples_path, "w") as f:
      json.dump([{"source": m["source"], "kind": m["kind"], "frames": p} for m, p in zip(out["maps"], pictures)], f)
  return out


def _example_pixels(batch: dict, kind: str) -> list:
  """uint8 frames of row 0's first item: [1, H, W, 3] for an image, one frame per temporal patch for a video."""
  x = batch["images"][0, 0, :1] if kind == "image" else batch["videos"][0, 0, ::2]
  return np.clip(np.round((np.asarray(x) + 1.0) * 127.5), 0, 255).astype(np.uint8).tolist()


def analyse_run(config, workdir: str, examples_path: str | None) -> dict:
  """{"sources", "evals", "text_stream", "attention", "maps"} of the finished run in `workdir`."""
  sources = training.source_kinds(config)
  out = {"sources": sources, "evals": metrics.evals(workdir), "text_stream": read_text_stream(workdir)}
  out.update(analyse_attention(config, workdir, sources, examples_path))
  return out
