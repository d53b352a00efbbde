"""Loader for the Mooncake FAST'25 traces (JSON lines) with their prefix identity.

The files: registry entries "mooncake_conversation" and "mooncake_synthetic" of
`jaxserve.traces.registry` (kvcache-ai/Mooncake, FAST25-release/traces, Apache-2.0), stored
gzip-compressed; `jaxserve-traces fetch mooncake_conversation` downloads one and
`load_mooncake(jaxserve.traces.path("mooncake_conversation"))` reads it.

Format (section mooncake_2025 of the trace mirror's README): one JSON object per line with
``timestamp`` (ms, relative), ``input_length`` (prompt tokens), ``output_length`` (tokens) and
``hash_ids`` (ids of the prompt's 512-token blocks, ``ceil(input_length / 512)`` of them, the
last one covering a partial block; equal ids mean equal prefix content). Files may be gzip
compressed (detected by their magic bytes, not by the name).

The prefix identity is returned as a `jaxserve.traces.prefix.PrefixTrace`: the trace's prefix
tree (per-node `parent`, `depth`, `hash_id`; see `traces/prefix.py`) and per request its deepest
node (`node`, -1 for an empty list) and `full_blocks = input_length // 512` (only the deepest
block can be partial). Nodes are numbered in arrival order of first appearance.

Conventions as in `jaxserve.traces.loaders`: arrivals are float64 seconds rebased so that the
earliest request is at 0.0, rows stably sorted by time (the upstream files are already sorted);
token counts are int64 >= 1. Any defect raises `TraceFormatError` naming the file and the
1-based line; nothing is loaded partially. The engine's bounds are defects too (as in
`loaders`): a length over `MAX_TOKENS`, a prompt + output over it, a gap between (sorted)
arrivals over `MAX_SECONDS`, and a hash id outside int64 (the tree's `hash_id` dtype).
"""

from __future__ import annotations

import gzip
import json
import math
import os
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.core.types import MAX_SECONDS, MAX_TOKENS, Trace, validate_trace
from jaxserve.traces.loaders import TraceFormatError
from jaxserve.traces.prefix import (PrefixTrace, PrefixTree, build_prefix_tree,
                                    infinite_cache_reuse, kv_prefix, path_nodes)
from jaxserve.traces.store import fetch_hint

__all__ = ["MOONCAKE_BLOCK_TOKENS", "PrefixTrace", "PrefixTree", "load_mooncake",
           "infinite_cache_reuse", "path_nodes", "kv_prefix"]

MOONCAKE_BLOCK_TOKENS = 512
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def _read_lines(path: Any) -> tuple[Path, list[tuple[int, str]]]:
    if not isinstance(path, (str, os.PathLike)):
        raise TraceFormatError(path, None,
                               f"path must be a str or os.PathLike, got {type(path).__name__}")
    p = Path(path)
    if not p.exists():
        raise TraceFormatError(p, None, "file not found" + fetch_hint(p))
    if not p.is_file():
        raise TraceFormatError(p, None, "not a regular file")
    with open(p, "rb") as f:
        magic = f.read(2)
    try:
        if magic == b"\x1f\x8b":
            with gzip.open(p, "rt", encoding="utf-8") as f:
                text = f.read()
        else:
            text = p.read_text(encoding="utf-8")
    except (OSError, EOFError, zlib.error) as e:
        kind = "gzip-compressed " if magic == b"\x1f\x8b" else ""
        raise TraceFormatError(p, None, f"cannot read the {kind}data ({e})") from None
    except UnicodeDecodeError as e:
        raise TraceFormatError(p, None, f"not a UTF-8 text file ({e})") from None
    rows = []
    blank = None
    for num, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            blank = num if blank is None else blank
            continue
        if blank is not None:
            raise TraceFormatError(p, blank, "blank line inside the data")
        rows.append((num, line))
    if not rows:
        raise TraceFormatError(p, 1, "no data rows (empty file)")
    return p, rows


_INT64 = (-(2 ** 63), 2 ** 63 - 1)


def _count(p: Path, line: int, obj: dict, key: str, minimum: int) -> int:
    """`obj[key]` as an integer in `[minimum, MAX_TOKENS]`, else TraceFormatError."""
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TraceFormatError(p, line, f"{key} must be an integer, got {v!r}")
    if isinstance(v, float) and (not math.isfinite(v) or v != math.floor(v)):
        raise TraceFormatError(p, line, f"{key} must be an integer, got {v!r}")
    if v < minimum:
        raise TraceFormatError(p, line, f"{key} must be >= {minimum}, got {v!r}")
    if v > MAX_TOKENS:
        raise TraceFormatError(p, line, f"{key} = {v!r} tokens exceeds the engine's largest "
                                        f"token count ({MAX_TOKENS})")
    return int(v)


def load_mooncake(path: Any, *, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> PrefixTrace:
    """Reads a Mooncake JSONL(.gz) trace; returns its requests and prefix tree.

    Args:
      path: the file (plain or gzip-compressed JSON lines).
      block_tokens: tokens per hash block (512 in the Mooncake release); each row must have
        exactly `ceil(input_length / block_tokens)` hash ids.

    Raises:
      TraceFormatError (a ValueError) naming the file and line: unreadable or empty file,
      invalid JSON, a row that is not an object, a missing field, a non-finite or negative
      timestamp, lengths that are not integers in `[1, MAX_TOKENS]` or whose sum exceeds
      `MAX_TOKENS`, a gap after the previous (sorted) arrival over `MAX_SECONDS`, `hash_ids`
      not a list of int64 integers or of the wrong length.
      ValueError: `block_tokens` < 1.
    """
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
        raise ValueError(f"block_tokens must be an integer >= 1, got {block_tokens!r}")
    p, lines = _read_lines(path)
    ts, prompt, output, hashes = [], [], [], []
    for num, line in lines:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceFormatError(p, num, f"invalid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise TraceFormatError(p, num, f"expected a JSON object, got {type(obj).__name__}")
        missing = [k for k in _FIELDS if k not in obj]
        if missing:
            raise TraceFormatError(p, num, f"missing field(s) {', '.join(missing)}")
        t = obj["timestamp"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
            raise TraceFormatError(p, num, f"timestamp must be a finite number, got {t!r}")
        if t < 0:
            raise TraceFormatError(p, num, f"timestamp is negative: {t!r}")
        pin = _count(p, num, obj, "input_length", 1)
        pout = _count(p, num, obj, "output_length", 1)
        if pin + pout > MAX_TOKENS:
            raise TraceFormatError(p, num, f"input_length + output_length = {pin + pout} tokens "
                                           f"exceeds the engine's largest request "
                                           f"({MAX_TOKENS})")
        ids = obj["hash_ids"]
        if not isinstance(ids, list) or any(isinstance(h, bool) or not isinstance(h, int)
                                            for h in ids):
            raise TraceFormatError(p, num, "hash_ids must be a list of integers")
        wide = [j for j, h in enumerate(ids) if not _INT64[0] <= h <= _INT64[1]]
        if wide:
            raise TraceFormatError(p, num, f"hash_ids[{wide[0]}] = {ids[wide[0]]} is outside "
                                           f"int64 [{_INT64[0]}, {_INT64[1]}]")
        want = -(-pin // block_tokens)
        if len(ids) != want:
            raise TraceFormatError(
                p, num, f"hash_ids has {len(ids)} entries but input_length {pin} needs "
                        f"ceil({pin} / {block_tokens}) = {want}")
        ts.append(float(t))
        prompt.append(pin)
        output.append(pout)
        hashes.append(ids)
    ts_arr = np.asarray(ts, np.float64)
    order = np.argsort(ts_arr, kind="stable")
    arrival = (ts_arr[order] - ts_arr[order[0]]) / 1000.0
    prompt_arr = np.asarray(prompt, np.int64)[order]
    output_arr = np.asarray(output, np.int64)[order]
    line_arr = np.asarray([num for num, _ in lines], np.int64)[order]
    big = np.diff(arrival) > MAX_SECONDS
    if np.any(big):
        i = int(np.flatnonzero(big)[0]) + 1
        raise TraceFormatError(p, int(line_arr[i]),
                               f"timestamp comes {arrival[i] - arrival[i - 1]:g} s after the "
                               f"previous request (line {int(line_arr[i - 1])}); gaps must be "
                               f"<= {MAX_SECONDS:g} s")

    tree, node = build_prefix_tree([hashes[i] for i in order], block_tokens)
    try:
        trace = validate_trace(Trace(arrival_s=arrival, prompt_tokens=prompt_arr,
                                     output_tokens=output_arr))
    except ValueError as e:  # the checks above name the line; this is a safety net
        raise TraceFormatError(p, None, str(e)) from None
    return PrefixTrace(trace=trace, node=node, full_blocks=prompt_arr // block_tokens,
                         tree=tree)


