"""Captions: the templated captions of image items and the captions of synthetic motion clips.

    image_caption("fashion_mnist", 7, "", "", template=1)              # "A photo of a sneaker."
    clip_caption(["a sneaker", "the digit 7"], ["left", "up"], 0)      # [("A sneaker", "object"), (" moves", ""), ...]

Captions are plain English built from the item's label, title or keywords (see m3_jax.data.vision_sources); the
templates vary the wording so that a model cannot learn one fixed sentence per class.
"""
from __future__ import annotations

from collections.abc import Sequence

__all__ = ["clip_caption", "image_caption", "item_phrase"]

_FASHION_PHRASES = ("a T-shirt", "a pair of trousers", "a pullover", "a dress", "a coat", "a sandal", "a shirt",
                    "a sneaker", "a bag", "an ankle boot")
_DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def _article(noun: str) -> str:
  return ("an " if noun[:1].lower() in "aeiou" else "a ") + noun


def item_phrase(source: str, label: int, title: str) -> str:
  """A noun phrase with its article for an item ("a sneaker", "the digit 7", "a red apple emoji")."""
  if source == "fashion_mnist":
    return _FASHION_PHRASES[label]
  if source in ("opencv_digits", "sklearn_digits"):
    return f"the digit {label}"
  if source == "emoji":
    return _article(f"{title} emoji")
  if source == "openclipart":
    return f'a drawing of "{title}"'
  raise ValueError(f"item_phrase: unknown source {source!r}")


_IMAGE_TEMPLATES: dict[str, tuple[str, ...]] = {
    "fashion_mnist": ("{P}.", "A photo of {p}.", "A small grayscale picture of {p}.", "This is {p}.",
                      "An item of clothing: {p}."),
    "opencv_digits": ("The digit {d}.", "A handwritten {w}.", "The number {w}, written by hand.", "{d}",
                      "This digit is a {d}."),
    "sklearn_digits": ("The digit {d}.", "A tiny 8 by 8 picture of a handwritten {w}.", "The number {w}.", "{d}",
                       "A blurry, low resolution {d}."),
    "emoji": ("{T} emoji.", "An emoji: {t}.", "The {t} emoji.", "A colorful icon of {t}.", "{T}."),
    "openclipart": ("{T}.", "Clip art: {t}.", 'A drawing titled "{t}".', "{T}. Tags: {k}.", "An illustration of {t}."),
}


def image_caption(source: str, label: int, title: str, keywords: str, template: int) -> str:
  """The caption of an image item with template number `template` (any int; taken modulo the template count)."""
  if source not in _IMAGE_TEMPLATES:
    raise ValueError(f"image_caption: unknown source {source!r}; expected one of {sorted(_IMAGE_TEMPLATES)}")
  temps = _IMAGE_TEMPLATES[source]
  if source == "openclipart" and not keywords:
    temps = tuple(t for t in temps if "{k}" not in t)
  tmpl = temps[template % len(temps)]
  fields: dict[str, str] = {"t": title, "T": title[:1].upper() + title[1:], "k": keywords}
  if label >= 0:
    phrase = item_phrase(source, label, title)
    fields.update(p=phrase, P=phrase[:1].upper() + phrase[1:], d=str(label),
                  w=_DIGIT_WORDS[label] if label < 10 else str(label))
  return tmpl.format(**fields)


_ORDINALS = ("first", "second", "third", "fourth", "fifth")
_COUNT_WORDS = ("no", "one", "two", "three", "four", "five")


def clip_caption(names: Sequence[str], directions: Sequence[str], template: int) -> list[tuple[str, str]]:
  """The caption of a synthetic clip as pieces [(text, tag)], tag "object", "direction" or "" (the caption is
  their concatenation). `names`/`directions` are in order of appearance; names are noun phrases with articles.

  Pieces start at word boundaries (a leading space or punctuation), so tokenising piece by piece gives the same
  ids as tokenising the whole caption with the project's byte-level BPE, and the tags locate the tokens that need
  temporal information: directions (motion) and object names (their order is the order of appearance).
  """
  if len(names) != len(directions) or not names:
    raise ValueError(f"clip_caption: {len(names)} names and {len(directions)} directions; expected equal, >= 1")
  cap = lambda s: s[:1].upper() + s[1:]  # noqa: E731
  k = len(names)
  out: list[tuple[str, str]] = []
  t = template % 4
  if t == 0:  # "A sneaker moves left. Then the digit 7 appears and moves up. Finally ..."
    for i, (n, d) in enumerate(zip(names, directions)):
      if i == 0:
        out += [(cap(n), "object"), (" moves", ""), (" " + d, "direction"), (".", "")]
      else:
        out += [(" Finally" if i == k - 1 and k > 2 else " Then", ""), (" " + n, "object"),
                (" appears and moves", ""), (" " + d, "direction"), (".", "")]
  elif t == 1:  # "First a sneaker goes left, then the digit 7 goes up."
    for i, (n, d) in enumerate(zip(names, directions)):
      out += [("First" if i == 0 else ", then", ""), (" " + n, "object"), (" goes", ""), (" " + d, "direction")]
    out.append((".", ""))
  elif t == 2:  # "In order of appearance: a sneaker (left), the digit 7 (up)."
    out.append(("In order of appearance:", ""))
    for i, (n, d) in enumerate(zip(names, directions)):
      out += [("," if i else "", ""), (" " + n, "object"), (" (", ""), (d, "direction"), (")", "")]
    out.append((".", ""))
  else:  # "Two objects move. The first is a sneaker, moving left. The second is ..."
    out.append((f"{cap(_COUNT_WORDS[k]) if k < len(_COUNT_WORDS) else k} object{'s' if k > 1 else ''} "
                f"move{'' if k > 1 else 's'}.", ""))
    for i, (n, d) in enumerate(zip(names, directions)):
      out += [(f" The {_ORDINALS[i] if i < len(_ORDINALS) else str(i + 1) + 'th'} is", ""), (" " + n, "object"),
              (", moving", ""), (" " + d, "direction"), (".", "")]
  return [(s, tag) for s, tag in out if s]
