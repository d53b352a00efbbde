"""Where the public trace files are on this machine, and how to download them.

The trace files are public data hosted on GitHub (`jaxserve.traces.registry` lists each file's
upstream repository, pinned commit, licence, citation and sha256). They are not shipped with
jaxserve; get them with

    jaxserve-traces fetch azure_llm_2023_conv     # or: jaxserve-traces fetch --all

which downloads them (with pooch, hash-checked) into the user cache
(`pooch.os_cache("jaxserve")/traces`, e.g. `~/.cache/jaxserve/traces` on Linux).

`path(name)` finds a file, in this order:

  1. `$JAXSERVE_TRACES_DIR/<relpath>` (the one override: a folder laid out like the trace
     mirror, e.g. `../shared/traces` beside a checkout of the repository);
  2. the user cache, `cache_dir()/<relpath>`;

and checks its sha256 against the registry (ValueError naming the file and both hashes on a
mismatch). A file found nowhere raises `TraceNotFoundError` (a FileNotFoundError, and a
ValueError for the callers that report missing traces as bad input) naming the command
`jaxserve-traces fetch NAME` and the variable.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import zlib
from pathlib import Path
from typing import Any, Optional
from urllib.parse import unquote, urlparse
from urllib.request import url2pathname

from jaxserve.traces.registry import REGISTRY, TraceFile, entry_for

__all__ = ["ENV_VAR", "TraceNotFoundError", "cache_dir", "fetch", "find", "locate", "path",
           "resolve", "verify_file", "file_sha256", "fetch_hint"]

#: The environment variable naming a folder laid out like the trace mirror.
ENV_VAR = "JAXSERVE_TRACES_DIR"
_DOWNLOADS = "_downloads"  # where processed entries are downloaded to (removed after), in the cache


class TraceNotFoundError(FileNotFoundError, ValueError):
    """A registered trace file is neither under `$JAXSERVE_TRACES_DIR` nor in the cache.

    Both a FileNotFoundError and a ValueError: callers that report a missing trace as bad
    input (`except ValueError`) and those that treat it as a missing file both catch it."""


def cache_dir() -> Optional[Path]:
    """The user cache folder for trace files (`pooch.os_cache("jaxserve") / "traces"`, the
    platform's user cache; platformdirs' `user_cache_dir` if pooch is absent); None when
    neither package is installed."""
    try:
        import pooch  # deferred: optional dependency (only downloads need it)
        return Path(pooch.os_cache("jaxserve")) / "traces"
    except ImportError:
        pass
    try:
        import platformdirs  # deferred: optional dependency (pooch's)
        return Path(platformdirs.user_cache_dir("jaxserve")) / "traces"
    except ImportError:
        return None


def _cache(cache: Any) -> Optional[Path]:
    return Path(cache) if cache is not None else cache_dir()


# --- hashes ----------------------------------------------------------------------------

_HASHES: dict[tuple, str] = {}  # (path, size, mtime_ns, kind) -> hex digest


def _digest(p: Path, gunzip: bool) -> str:
    st = p.stat()
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns, gunzip)
    if key not in _HASHES:
        h = hashlib.sha256()
        opener = gzip.open if gunzip else open
        with opener(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        _HASHES[key] = h.hexdigest()
    return _HASHES[key]


def file_sha256(p: Any) -> str:
    """sha256 (hex) of the file's bytes."""
    return _digest(Path(p), False)


def verify_file(name: str, p: Any) -> Path:
    """Checks that the file `p` is the registered trace `name`; returns `p` as a Path.

    A file verifies if its sha256 is the registry's (the stored file's). For a gzip entry
    (`content_sha256` set) it also verifies if its decompressed bytes hash to
    `content_sha256`: a copy made by `fetch` is not the mirror's gzip byte for byte, but
    decompresses to the same upstream file.

    Raises:
      ValueError: naming the file and both hashes, if it does not verify.
    """
    e = entry_for(name)
    p = Path(p)
    got = file_sha256(p)
    if got == e.sha256:
        return p
    msg = f"{p}: sha256 {got} does not match the registered trace {e.name!r} (expected {e.sha256}"
    if e.content_sha256 is not None:
        try:
            content = _digest(p, True)
        except (OSError, EOFError, zlib.error):
            content = "(not gzip data)"
        if content == e.content_sha256:
            return p
        msg += f", or decompressed {e.content_sha256}; decompressed it is {content}"
    raise ValueError(msg + f"). Replace it: delete it and run `jaxserve-traces fetch {e.name}`"
                     f" (or fix the copy under ${ENV_VAR}).")


# --- finding files ---------------------------------------------------------------------


def locate(name: str, *, cache: Any = None) -> tuple[str, Optional[Path]]:
    """Where the trace `name` is, without checking it: `("mirror", path)` under
    `$JAXSERVE_TRACES_DIR`, `("cached", path)` in the cache, or `("missing", None)`."""
    e = entry_for(name)
    env = os.environ.get(ENV_VAR)
    if env:
        p = Path(env).expanduser() / e.relpath
        if p.is_file():
            return "mirror", p
    root = _cache(cache)
    if root is not None and (root / e.relpath).is_file():
        return "cached", root / e.relpath
    return "missing", None


def _not_found(e: TraceFile, cache: Any, where: Optional[Path] = None) -> TraceNotFoundError:
    if where is not None:
        return TraceNotFoundError(
            f"trace file {where} not found ({e.name!r}, expected at <traces_dir>/{e.relpath}); "
            f"run `jaxserve-traces fetch {e.name}` to download it into the user cache and "
            f"leave traces_dir unset, or copy it there")
    looked = []
    env = os.environ.get(ENV_VAR)
    looked.append(f"${ENV_VAR}/{e.relpath}" + (f" = {Path(env) / e.relpath}" if env
                                               else f" (${ENV_VAR} is not set)"))
    root = _cache(cache)
    looked.append(f"the cache {root / e.relpath}" if root is not None
                  else "no user cache (pooch is not installed: pip install pooch)")
    return TraceNotFoundError(
        f"trace {e.name!r} ({e.relpath}) is not available: run `jaxserve-traces fetch {e.name}` "
        f"to download it ({e.url or 'no upstream URL'}), or set {ENV_VAR} to a folder laid out "
        f"like the trace mirror. Looked in: {'; '.join(looked)}.")


def path(name: str, *, cache: Any = None) -> Path:
    """The local file of the registered trace `name` (a short name such as
    "azure_llm_2023_conv", or its relative path as in the mirror), hash-checked.

    Looks under `$JAXSERVE_TRACES_DIR/<relpath>`, then in the user cache (`cache`, default
    `cache_dir()`).

    Raises:
      ValueError: unknown name (listing the known ones), or the file found fails its sha256
        check (naming the file and both hashes).
      TraceNotFoundError: the file is in neither place; the message names the command
        `jaxserve-traces fetch NAME` and `JAXSERVE_TRACES_DIR`.
    """
    e = entry_for(name)
    _, p = locate(e.name, cache=cache)
    if p is None:
        raise _not_found(e, cache)
    return verify_file(e.name, p)


def find(name: str, *, cache: Any = None) -> Optional[Path]:
    """`path(name)`, or None if the file is not available (a hash mismatch still raises)."""
    try:
        return path(name, cache=cache)
    except TraceNotFoundError:
        return None


def resolve(name: str, traces_dir: Any = None) -> Path:
    """The file of trace `name` under `traces_dir` (a folder laid out like the mirror, read
    as is: no hash check, so that a variant of a file can be used), or `path(name)` when
    `traces_dir` is None. Raises TraceNotFoundError naming `jaxserve-traces fetch NAME` if it
    does not exist."""
    e = entry_for(name)
    if traces_dir is None:
        return path(e.name)
    p = Path(traces_dir) / e.relpath
    if not p.is_file():
        raise _not_found(e, None, where=p)
    return p


def fetch_hint(p: Any) -> str:
    """For a missing file whose name is that of a registered trace: " (the public trace NAME:
    run `jaxserve-traces fetch NAME` and read jaxserve.traces.path(NAME))"; else ""."""
    base = Path(str(p)).name
    for e in REGISTRY.values():
        if Path(e.relpath).name == base:
            return (f" (the public trace {e.name!r}: run `jaxserve-traces fetch {e.name}` and "
                    f"read jaxserve.traces.path({e.name!r}))")
    return ""


# --- downloading -----------------------------------------------------------------------


def _file_downloader(url: str, output_file: Any, pooch: Any = None, check_only: bool = False):
    """A pooch downloader for `file://` URLs (pooch's own handle HTTP(S), FTP, SFTP, DOI):
    copies the local file."""
    src = Path(url2pathname(unquote(urlparse(url).path)))
    if check_only:
        return src.is_file()
    if not src.is_file():
        raise FileNotFoundError(f"{url}: no such file")
    if hasattr(output_file, "write"):
        with open(src, "rb") as f:
            shutil.copyfileobj(f, output_file)
    else:
        shutil.copyfile(src, output_file)
    return None


def _pooch():
    try:
        import pooch  # deferred: optional dependency (only downloads need it)
    except ImportError:
        raise ImportError("downloading traces needs pooch: pip install 'pooch>=1.8'") from None
    return pooch


def fetch(name: str, *, force: bool = False, cache: Any = None,
          progressbar: bool = False) -> Path:
    """Downloads the registered trace `name` into the user cache (unless a copy there already
    verifies) and returns its path.

    Uses `pooch.retrieve` with the upstream file's sha256 as `known_hash` and, where the stored
    file differs from the download (Mooncake gzip, BurstGPT first rows, a zip member), the
    entry's pooch processor; the resulting file's hash is checked too (`verify_file`).
    `file://` URLs are copied. `cache` replaces `cache_dir()`; `force` downloads again.

    Raises:
      ValueError: unknown name, or a download or its product fails its hash check (nothing is
        left in the cache then).
      TraceNotFoundError: the entry has no confirmed upstream URL (the message says where to
        get the file by hand).
      OSError: the download failed (network, HTTP error).
    """
    e = entry_for(name)
    root = _cache(cache)
    if root is None:
        _pooch()  # raises the ImportError naming pooch
    final = root / e.relpath
    if final.is_file() and not force:
        try:
            return verify_file(e.name, final)
        except ValueError:
            pass  # a damaged copy: download again
    if e.url is None:
        raise TraceNotFoundError(
            f"trace {e.name!r} has no confirmed download URL ({e.url_note}); get "
            f"{e.relpath} by hand and put it under ${ENV_VAR}/{e.relpath}")
    pooch = _pooch()
    downloader = _file_downloader if urlparse(e.url).scheme == "file" else None
    base = Path(unquote(urlparse(e.url).path)).name or "download"
    if force:
        final.unlink(missing_ok=True)
    try:
        if e.processor is None:
            got = Path(pooch.retrieve(e.url, known_hash=e.known_hash, fname=final.name,
                                      path=final.parent, downloader=downloader,
                                      progressbar=progressbar))
        else:
            dl_dir = root / _DOWNLOADS
            if force:
                (dl_dir / f"{e.name}-{base}").unlink(missing_ok=True)
            out = pooch.retrieve(e.url, known_hash=e.known_hash, fname=f"{e.name}-{base}",
                                 path=dl_dir, processor=e.processor, downloader=downloader,
                                 progressbar=progressbar)
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(out, final)
            (dl_dir / f"{e.name}-{base}").unlink(missing_ok=True)  # keep only the stored file
            got = final
    except ValueError as err:
        raise ValueError(f"trace {e.name!r}: the download from {e.url} was refused: "
                         f"{' '.join(str(err).split())}") from err
    try:
        return verify_file(e.name, got)
    except ValueError:
        got.unlink(missing_ok=True)
        raise
