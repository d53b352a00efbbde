"""What the jaxserve command-line tools share: one-line errors and the `main` wrapper."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Callable, Iterable

from jaxserve.compile_cache import enable_compilation_cache


class CLIError(Exception):
    """A user error: printed as one line on stderr, exit status 2."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are `CLIError`s (one line, no usage dump)."""

    def error(self, message):
        raise CLIError(message)


def parse_value(text: str):
    """A `--set`/`--hp` value: JSON (numbers, true/false, lists) or else the plain string."""
    try:
        return json.loads(text)
    except ValueError:
        low = text.lower()
        if low in ("true", "false"):
            return low == "true"
        return text


def parse_pairs(pairs: list[str], flag: str) -> dict:
    """`["k=v", ...]` from a repeatable `flag` as `{k: parse_value(v)}`; CLIError if malformed."""
    out = {}
    for p in pairs:
        k, sep, v = p.partition("=")
        if not sep or not k.strip():
            raise CLIError(f"{flag} expects KEY=VALUE, got {p!r}")
        out[k.strip()] = parse_value(v.strip())
    return out


def output_file(path: str | None, flag: str) -> Path | None:
    """`path` as a file the tool may write at its end, checked before the work starts (a
    study of an hour should not fail at its last line): its folder is created, and CLIError
    names `flag` if `path` is a folder or its folder cannot be written. None stays None."""
    if path is None:
        return None
    out = Path(path)
    if out.is_dir():
        raise CLIError(f"{flag} {path} is a folder; give a file name")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CLIError(f"{flag} {path}: cannot create its folder ({e.strerror})") from e
    if not os.access(out.parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise CLIError(f"{flag} {path} is not writable")
    return out


def output_dir(path: str | None, flag: str, outputs: Iterable[str], *, overwrite: bool = False,
               overwrite_flag: str = "--overwrite") -> Path | None:
    """`path` as the folder a tool writes its files `outputs` (names) into at its end, checked
    (and created) before the work starts, so that an hour's study cannot fail, or mix its
    files into someone else's folder, at its last line. None stays None.

    A folder that holds only (some of) `outputs` is an earlier run of the same tool: its
    files are replaced. Raises CLIError naming `flag` if `path` exists and is not a folder,
    cannot be created or written, or holds anything else (unless `overwrite`: then `outputs`
    are written there beside it).
    """
    if path is None:
        return None
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise CLIError(f"{flag} {path} exists and is not a folder")
    if out.is_dir() and not overwrite:
        mine = set(outputs)
        other = sorted(e.name for e in out.iterdir() if e.name not in mine)
        if other:
            shown = ", ".join(other[:3]) + (", ..." if len(other) > 3 else "")
            raise CLIError(f"{flag} {path} is not empty and holds files this tool does not "
                           f"write ({shown}): choose another {flag} or pass {overwrite_flag} "
                           f"to write there anyway")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CLIError(f"{flag} {path}: cannot create the folder ({e.strerror})") from e
    if not os.access(out, os.W_OK | os.X_OK):
        raise CLIError(f"{flag} {path} is not writable")
    return out


def run_cli(prog: str, body: Callable[[], int]) -> int:
    """Runs `body()` with the persistent XLA compilation cache on
    (`jaxserve.compile_cache.enable_compilation_cache`: a second run of the same programs
    loads them instead of compiling them; `JAXSERVE_XLA_CACHE=off` turns it off) and turns
    user errors (`CLIError`, ValueError, TypeError, OSError) into `prog: error: <one line>`
    on stderr and exit status 2."""
    enable_compilation_cache()
    try:
        return body()
    except (CLIError, ValueError, TypeError, OSError) as e:
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"{prog}: error: {msg}", file=sys.stderr)
        return 2
