"""Loaders for public request traces (their summary statistics: `jaxserve.traces.trace_stats`).

Over 800 lines on purpose: the five formats share one checked row reader and one set of
field parsers that name the file, line and column of every bad value; split by format, each
part would import the others' private helpers.

Every loader reads one CSV file and returns a `jaxserve.core.types.Trace`:

* `arrival_s`: float64 seconds, **rebased** so that the first (earliest) request is at 0.0,
  non-decreasing. Rows are sorted with a *stable* sort, so requests with equal times keep
  their file order.
* `prompt_tokens`, `output_tokens`: int64, every value >= 1.

Supported formats (names accepted by `load(..., format=...)`):

=========================  ==================================================================
``azure_llm_2023``         Azure LLM inference trace (2023 Splitwise files, also the 2024
                           one-week files): ``TIMESTAMP,ContextTokens,GeneratedTokens``.
                           Timestamps are naive datetimes (``2023-11-16 18:15:46.6805900``);
                           a ``T`` separator and a ``Z``/``+HH:MM`` offset (2024 files) are
                           accepted. Parsed exactly to integer nanoseconds, then rebased.
                           Rows must already be sorted (the files promise it).
``azure_llm_reencoded``    The same trace re-encoded by ``microsoft/vidur``:
                           ``arrived_at,num_prefill_tokens,num_decode_tokens`` (relative
                           seconds). Rows must already be sorted.
``burstgpt``               BurstGPT: ``Timestamp,Model,Request tokens,Response tokens,
                           Total tokens,Log Type`` (extra columns are ignored). Filters
                           ``models=``, ``log_types=``; failed rows (``Response tokens == 0``)
                           handled by ``failed=``.
``azure_functions_2021``   Azure Functions invocations 2021: ``app,func,end_timestamp,
                           duration`` (seconds). Arrival = end_timestamp - duration.
``azure_functions_2019``   Azure Functions 2019 per-minute counts: ``HashOwner,HashApp,
                           HashFunction,Trigger,1,...,1440``.
=========================  ==================================================================

Rules (also in ``docs/traces.md``):

* **Zero tokens** (Azure LLM, BurstGPT non-failed rows): ``zero_tokens="clip"`` (default)
  raises a 0 to 1 and counts it in `LoadReport.clipped`; ``"drop"`` drops the row (counted in
  `LoadReport.excluded`); ``"error"`` raises `TraceFormatError`. The real Azure 2023 files
  have no zero token counts.
* **BurstGPT failed rows** (``Response tokens == 0``): ``failed="drop"`` (default) drops
  them, ``"keep_as_one"`` keeps them with output 1 and prompt ``max(1, Request tokens)``,
  ``"error"`` raises. Filters are applied first; each excluded row is counted once, under the
  first reason that applies, in the order model, log_type, failed.
* **Functions -> tokens**: ``output_tokens = max(1, rint(duration_s * tokens_per_second))``
  (``np.rint``: round half to even), default 50 tokens/s; ``prompt_tokens`` is a constant,
  default 512.
* **2019 spreading**: the k-th (k = 0..n-1) of the n invocations counted in minute column m
  (1-based) arrives at ``60*(m-1) + 60*(k+0.5)/n`` seconds. The 2019 count file has no
  durations: each invocation gets ``duration_s`` (default 1.0 s), or the function's
  ``Average`` (milliseconds) from a 2019 ``function_durations_percentiles`` file passed as
  ``durations_path``.

Any defect in a file raises `TraceFormatError` (a `ValueError`) whose message names the file,
the 1-based line (the header is line 1) and the problem; nothing is ever loaded partially.
The engine's bounds (`core.types`) are defects too: a token count over `MAX_TOKENS` (2^24), a
request whose prompt + output exceeds it, a gap between arrivals over `MAX_SECONDS`, or a
timestamp outside int64 nanoseconds, each named with its line.

A file cut short (a copy interrupted mid-write) is caught where its content shows it: a last
row with too few fields, or whose cut field no longer parses (``2023-11-16 18:1``, ``1.5e``).
A cut that leaves a valid shorter value (``55`` cut to ``5``, or text) cannot be told from a
file written without a final newline, which is legal (the published Azure LLM 2023 and
Functions 2021 files end that way); `LoadReport.notes` then says that the last line (named)
could not be checked.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime as _dt
import math
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from jaxserve.core.types import MAX_SECONDS, MAX_TOKENS, Trace, validate_trace
from jaxserve.traces.store import fetch_hint

__all__ = [
    "FORMATS",
    "LoadReport",
    "TraceFormatError",
    "detect_format",
    "load",
    "load_with_report",
    "load_azure_llm_2023",
    "load_azure_llm_reencoded",
    "load_burstgpt",
    "load_burstgpt_with_report",
    "load_azure_functions_2021",
    "load_azure_functions_2019",
]

# Required header columns of each format (extra columns are allowed and ignored).
_COLUMNS: dict[str, tuple[str, ...]] = {
    "azure_llm_2023": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "azure_llm_reencoded": ("arrived_at", "num_prefill_tokens", "num_decode_tokens"),
    "burstgpt": ("Timestamp", "Model", "Request tokens", "Response tokens"),
    "azure_functions_2021": ("app", "func", "end_timestamp", "duration"),
    "azure_functions_2019": ("HashOwner", "HashApp", "HashFunction", "Trigger"),
}
FORMATS: tuple[str, ...] = tuple(_COLUMNS)


class TraceFormatError(ValueError):
    """A trace file is missing, empty or malformed.

    Attributes:
      path: the file, as given.
      line: 1-based line number of the problem (header = line 1), or None when the problem
        concerns the whole file (e.g. it does not exist).
      problem: what is wrong, without the location.
    """

    def __init__(self, path: Any, line: int | None, problem: str):
        self.path = str(path)
        self.line = line
        self.problem = problem
        where = f"{self.path}, line {line}" if line is not None else self.path
        super().__init__(f"{where}: {problem}")


@dataclasses.dataclass
class LoadReport:
    """What a loader read, kept and changed.

    Attributes:
      path: the file read.
      format: the format name used (see `FORMATS`).
      rows_read: data rows in the file (header and trailing blank lines not counted). For the
        2019 format: function rows.
      rows_loaded: requests in the returned trace.
      excluded: rows left out, by reason (e.g. ``{"failed": 1, "model": 7}``); reasons with a
        zero count are listed too where the loader has that option.
      clipped: token counts raised from 0 to 1, by field (``prompt_tokens``/``output_tokens``).
      origin: the first arrival before rebasing, as written in the file (a timestamp string
        for the Azure LLM format, seconds otherwise).
      was_sorted: True when the rows were already in arrival order (no reordering needed).
      notes: free-text notes (e.g. 2019 functions without a duration).
    """

    path: str
    format: str
    rows_read: int = 0
    rows_loaded: int = 0
    excluded: dict[str, int] = dataclasses.field(default_factory=dict)
    clipped: dict[str, int] = dataclasses.field(default_factory=dict)
    origin: str = ""
    was_sorted: bool = True
    notes: list[str] = dataclasses.field(default_factory=list)


# --------------------------------------------------------------------------------------------
# Reading and field parsing
# --------------------------------------------------------------------------------------------


def _open_checked(path: Any) -> Path:
    if isinstance(path, (str, os.PathLike)):
        p = Path(path)
    else:
        raise TraceFormatError(path, None, f"path must be a str or os.PathLike, got "
                                           f"{type(path).__name__}")
    if not p.exists():
        raise TraceFormatError(p, None, "file not found" + fetch_hint(p))
    if not p.is_file():
        raise TraceFormatError(p, None, "not a regular file")
    if p.stat().st_size == 0:
        raise TraceFormatError(p, 1, "empty file (0 bytes); expected a header line")
    return p


def _read_rows(path: Any, fmt: str | None = None, required: Sequence[str] | None = None
               ) -> tuple[Path, list[str], list[tuple[int, list[str]]], str | None]:
    """Reads a CSV file: returns (path, header, [(line_number, fields), ...], end_note).

    `end_note` is None, or (when the file does not end with a newline) the note that its last
    line cannot be checked for a cut (see the module docstring), for `LoadReport.notes`.

    With `fmt`, the header must hold that format's columns (or `required`), checked before
    any data row, so a file of the wrong format is reported at line 1.

    Handles LF and CRLF line endings, a UTF-8 byte-order mark and a missing final newline.
    Header names are stripped of surrounding whitespace. Trailing blank lines are ignored; a
    blank line followed by more data, or a row with the wrong number of fields, is an error.
    """
    p = _open_checked(path)
    rows: list[tuple[int, list[str]]] = []
    blank_line: int | None = None
    last_line = 0
    reader = None
    try:
        with open(p, newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            try:
                header = next(reader)
            except StopIteration:  # only a BOM
                raise TraceFormatError(p, 1, "empty file; expected a header line") from None
            header = [h.strip() for h in header]
            if not any(header):
                raise TraceFormatError(p, 1, "blank header line")
            if fmt is not None:
                _column_index(p, header, fmt, required)
            ncol = len(header)
            for fields in reader:
                line = reader.line_num
                if not fields or all(not x.strip() for x in fields):
                    if blank_line is None:
                        blank_line = line
                    continue
                if blank_line is not None:
                    raise TraceFormatError(p, blank_line, "blank line inside the data")
                if len(fields) != ncol:
                    raise TraceFormatError(
                        p, line, f"expected {ncol} fields as in the header, got {len(fields)}")
                rows.append((line, fields))
            last_line = reader.line_num
    except UnicodeDecodeError as e:
        raise TraceFormatError(p, _first_undecodable_line(p), f"not a UTF-8 text file ({e.reason}"
                                                              f" at byte {e.start})") from None
    except csv.Error as e:
        # The reader has read the offending line when it raises (e.g. a NUL byte).
        line = max(getattr(reader, "line_num", 1), 1)
        raise TraceFormatError(p, line, f"CSV syntax error: {e}") from None
    if not rows:
        raise TraceFormatError(p, 2, "no data rows (header only)")
    end_note = None
    if rows[-1][0] == last_line and not _ends_with_newline(p):
        end_note = (f"line {last_line}: the file does not end with a newline, so a cut inside "
                    f"its last field (e.g. '55' -> '5') could not be detected")
    return p, header, rows, end_note


def _new_report(p: Path, fmt: str, rows: list, end_note: str | None) -> LoadReport:
    report = LoadReport(path=str(p), format=fmt, rows_read=len(rows))
    if end_note is not None:
        report.notes.append(end_note)
    return report


def _first_undecodable_line(p: Path) -> int | None:
    """1-based line of the first bytes that are not UTF-8 (None if every line decodes)."""
    with open(p, "rb") as f:
        for i, raw in enumerate(f, start=1):
            try:
                (raw[3:] if i == 1 and raw.startswith(b"\xef\xbb\xbf") else raw).decode("utf-8")
            except UnicodeDecodeError:
                return i
    return None


def _ends_with_newline(p: Path) -> bool:
    with open(p, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) in (b"\n", b"\r")


def _column_index(p: Path, header: list[str], fmt: str,
                  required: Sequence[str] | None = None) -> dict[str, int]:
    required = _COLUMNS[fmt] if required is None else required
    missing = [c for c in required if c not in header]
    if missing:
        raise TraceFormatError(
            p, 1, f"missing column(s) {', '.join(repr(c) for c in missing)} for format "
                  f"{fmt!r} (header: {_show_header(header)})")
    return {c: header.index(c) for c in required}


def _show_header(header: list[str], limit: int = 200) -> str:
    s = ",".join(header)
    return s if len(s) <= limit else s[:limit] + f"... ({len(header)} columns)"


def _parse_float(p: Path, line: int, col: str, s: str, *, nonneg: bool = False) -> float:
    try:
        v = float(s)
    except ValueError:
        raise TraceFormatError(p, line, f"{col} is not a number: {s!r}") from None
    if not math.isfinite(v):
        raise TraceFormatError(p, line, f"{col} is not finite: {s!r}")
    if nonneg and v < 0:
        raise TraceFormatError(p, line, f"{col} is negative: {s!r}")
    return v


def _parse_count(p: Path, line: int, col: str, s: str, high: int = MAX_TOKENS) -> int:
    """An integer in `[0, high]`; an integral float such as ``12.0`` is accepted.

    `high` defaults to the engine's largest token count (`types.MAX_TOKENS`), which also
    keeps every count far inside int64.
    """
    t = s.strip()
    try:
        return _check_range(p, line, col, s, int(t), high)
    except ValueError:
        pass
    try:
        v = float(t)
    except ValueError:
        raise TraceFormatError(p, line, f"{col} is not an integer: {s!r}") from None
    if not math.isfinite(v) or v != math.floor(v):
        raise TraceFormatError(p, line, f"{col} is not an integer: {s!r}")
    return _check_range(p, line, col, s, int(v), high)


def _check_range(p: Path, line: int, col: str, s: str, v: int, high: int) -> int:
    if v < 0:
        raise TraceFormatError(p, line, f"{col} is negative: {s!r}")
    if v > high:
        raise TraceFormatError(p, line, f"{col} is out of range: {s.strip()!r} > {high} "
                                        f"(the largest count the engine takes)")
    return v


_TS_RE = re.compile(
    r"^\s*(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?"
    r"\s*(Z|[+-]\d{2}:?\d{2})?\s*$")


def _parse_timestamp_ns(p: Path, line: int, col: str, s: str) -> int:
    """Parses ``YYYY-MM-DD HH:MM:SS[.fffffffff][Z|+HH:MM]`` to integer nanoseconds.

    The result counts from 1970-01-01 00:00 of the same (naive) clock; an explicit offset is
    subtracted so that offset timestamps map to UTC. The fraction (up to 9 digits) is parsed as
    an integer, so no digit is lost (float64 seconds since 1970 would keep only ~7 digits).
    """
    m = _TS_RE.match(s)
    if m is None:
        raise TraceFormatError(
            p, line, f"{col} is not a timestamp like '2023-11-16 18:15:46.6805900': {s!r}")
    y, mo, d, hh, mm, ss = (int(m.group(i)) for i in range(1, 7))
    frac = m.group(7) or ""
    try:
        days = _dt.date(y, mo, d).toordinal() - _EPOCH_ORDINAL
    except ValueError as e:
        raise TraceFormatError(p, line, f"{col} has an invalid date {s!r}: {e}") from None
    if hh > 23 or mm > 59 or ss > 60:
        raise TraceFormatError(p, line, f"{col} has an invalid time of day: {s!r}")
    secs = days * 86400 + hh * 3600 + mm * 60 + ss
    tz = m.group(8)
    if tz and tz != "Z":
        sign = -1 if tz[0] == "-" else 1
        digits = tz[1:].replace(":", "")
        secs -= sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)
    ns = secs * 1_000_000_000 + (int(frac.ljust(9, "0")) if frac else 0)
    if not -2 ** 63 <= ns < 2 ** 63:
        raise TraceFormatError(p, line, f"{col} is out of range (int64 nanoseconds since 1970 "
                                        f"cover years 1677 to 2262): {s!r}")
    return ns


_EPOCH_ORDINAL = _dt.date(1970, 1, 1).toordinal()


def _tokens_policy(p: Path, report: LoadReport, lines: np.ndarray, prompt: np.ndarray,
                   output: np.ndarray, zero_tokens: str, names: tuple[str, str]) -> np.ndarray:
    """Applies the zero-token rule in place; returns the boolean mask of rows to keep."""
    if zero_tokens not in ("clip", "drop", "error"):
        raise ValueError(f"zero_tokens must be 'clip', 'drop' or 'error', got {zero_tokens!r}")
    keep = np.ones(prompt.shape[0], dtype=bool)
    zp, zo = prompt == 0, output == 0
    if zero_tokens == "error":
        for z, name in ((zp, names[0]), (zo, names[1])):
            if z.any():
                i = int(np.flatnonzero(z)[0])
                raise TraceFormatError(
                    p, int(lines[i]), f"{name} is 0 (zero_tokens='error'; use 'clip' or "
                                      f"'drop')")
    elif zero_tokens == "drop":
        keep = ~(zp | zo)
        report.excluded["zero_tokens"] = report.excluded.get("zero_tokens", 0) + int(
            (~keep).sum())
    else:
        report.clipped["prompt_tokens"] = report.clipped.get("prompt_tokens", 0) + int(
            zp.sum())
        report.clipped["output_tokens"] = report.clipped.get("output_tokens", 0) + int(
            zo.sum())
        prompt[zp] = 1
        output[zo] = 1
    return keep


def _finish(p: Path, report: LoadReport, arrival: np.ndarray, prompt: np.ndarray,
            output: np.ndarray, origin: str, *, lines: np.ndarray | None = None,
            must_be_sorted: bool = False,
            time_col: str = "time") -> tuple[Trace, LoadReport]:
    """Sorts (stable) or checks order, rebases to the first arrival, validates.

    `lines[i]` is the file line of row `i` (None: a problem is reported without a line).
    The engine's bounds are checked here with the line: prompt + output <= `MAX_TOKENS`, and
    every gap between consecutive (sorted) arrivals <= `MAX_SECONDS`.
    """
    line_of = (lambda i: int(lines[i])) if lines is not None else (lambda i: None)  # noqa: E731
    total = prompt.astype(np.float64) + output.astype(np.float64)
    if np.any(total > MAX_TOKENS):
        i = int(np.flatnonzero(total > MAX_TOKENS)[0])
        raise TraceFormatError(p, line_of(i), f"prompt + output = {total[i]:.0f} tokens exceeds "
                                              f"the engine's largest request ({MAX_TOKENS})")
    if arrival.shape[0] == 0:
        reasons = ", ".join(f"{k}: {v}" for k, v in report.excluded.items() if v)
        raise TraceFormatError(p, None, f"no rows left after exclusions ({reasons})")
    d = np.diff(arrival)
    report.was_sorted = bool(np.all(d >= 0))
    if not report.was_sorted:
        if must_be_sorted:
            i = int(np.flatnonzero(d < 0)[0]) + 1
            ln = int(lines[i]) if lines is not None else None
            prev = int(lines[i - 1]) if lines is not None else None
            raise TraceFormatError(
                p, ln, f"{time_col} goes backwards (earlier than line {prev}); this format "
                       f"promises rows sorted by time (pass check_sorted=False to sort them)")
        order = np.argsort(arrival, kind="stable")
        arrival, prompt, output = arrival[order], prompt[order], output[order]
        lines = None if lines is None else lines[order]
        line_of = (lambda i: int(lines[i])) if lines is not None else (lambda i: None)  # noqa
    big = np.diff(arrival) > MAX_SECONDS
    if np.any(big):
        i = int(np.flatnonzero(big)[0]) + 1
        raise TraceFormatError(p, line_of(i), f"{time_col} comes {arrival[i] - arrival[i - 1]:g} s "
                                              f"after the previous request; gaps must be <= "
                                              f"{MAX_SECONDS:g} s")
    report.rows_loaded = int(arrival.shape[0])
    report.origin = origin
    try:
        trace = validate_trace(Trace(arrival_s=arrival, prompt_tokens=prompt,
                                     output_tokens=output))
    except ValueError as e:  # the checks above name the line; this is a safety net
        raise TraceFormatError(p, None, str(e)) from None
    return trace, report


# --------------------------------------------------------------------------------------------
# Format readers: each returns (Trace, LoadReport)
# --------------------------------------------------------------------------------------------


def _read_azure_llm_2023(path: Any, *, check_sorted: bool = True,
                         zero_tokens: str = "clip") -> tuple[Trace, LoadReport]:
    fmt = "azure_llm_2023"
    p, header, rows, end_note = _read_rows(path, fmt)
    ix = _column_index(p, header, fmt)
    report = _new_report(p, fmt, rows, end_note)
    n = len(rows)
    ns = np.empty(n, dtype=np.int64)
    prompt = np.empty(n, dtype=np.int64)
    output = np.empty(n, dtype=np.int64)
    lines = np.empty(n, dtype=np.int64)
    it, ic, ig = ix["TIMESTAMP"], ix["ContextTokens"], ix["GeneratedTokens"]
    for i, (line, f) in enumerate(rows):
        lines[i] = line
        ns[i] = _parse_timestamp_ns(p, line, "TIMESTAMP", f[it])
        prompt[i] = _parse_count(p, line, "ContextTokens", f[ic])
        output[i] = _parse_count(p, line, "GeneratedTokens", f[ig])
    keep = _tokens_policy(p, report, lines, prompt, output, zero_tokens,
                          ("ContextTokens", "GeneratedTokens"))
    ns, prompt, output, lines = ns[keep], prompt[keep], output[keep], lines[keep]
    if ns.shape[0] and check_sorted and np.any(np.diff(ns) < 0):
        i = int(np.flatnonzero(np.diff(ns) < 0)[0]) + 1
        raise TraceFormatError(
            p, int(lines[i]), f"TIMESTAMP goes backwards (earlier than line {int(lines[i - 1])});"
                              f" this format promises rows sorted by time (pass "
                              f"check_sorted=False to sort them)")
    if ns.shape[0] == 0:
        return _finish(p, report, ns.astype(np.float64), prompt, output, "")
    first = int(np.argmin(ns))  # the stable sort puts the first minimum first
    origin = rows[int(np.flatnonzero(keep)[first])][1][it].strip()
    # Rebase in exact integer nanoseconds, then one rounding to float64 seconds.
    arrival = (ns - ns[first]).astype(np.float64) / 1e9
    return _finish(p, report, arrival, prompt, output, origin, lines=lines)


def _read_azure_llm_reencoded(path: Any, *, check_sorted: bool = True,
                              zero_tokens: str = "clip") -> tuple[Trace, LoadReport]:
    fmt = "azure_llm_reencoded"
    p, header, rows, end_note = _read_rows(path, fmt)
    ix = _column_index(p, header, fmt)
    report = _new_report(p, fmt, rows, end_note)
    n = len(rows)
    t = np.empty(n, dtype=np.float64)
    prompt = np.empty(n, dtype=np.int64)
    output = np.empty(n, dtype=np.int64)
    lines = np.empty(n, dtype=np.int64)
    ia, ip, idc = ix["arrived_at"], ix["num_prefill_tokens"], ix["num_decode_tokens"]
    for i, (line, f) in enumerate(rows):
        lines[i] = line
        t[i] = _parse_float(p, line, "arrived_at", f[ia], nonneg=True)
        prompt[i] = _parse_count(p, line, "num_prefill_tokens", f[ip])
        output[i] = _parse_count(p, line, "num_decode_tokens", f[idc])
    keep = _tokens_policy(p, report, lines, prompt, output, zero_tokens,
                          ("num_prefill_tokens", "num_decode_tokens"))
    t, prompt, output, lines = t[keep], prompt[keep], output[keep], lines[keep]
    t0 = float(t.min()) if t.shape[0] else 0.0
    return _finish(p, report, t - t0, prompt, output, _num_str(t0), lines=lines,
                   must_be_sorted=check_sorted, time_col="arrived_at")


def _read_burstgpt(path: Any, *, models: Iterable[str] | None = None,
                   log_types: Iterable[str] | None = None, failed: str = "drop",
                   zero_tokens: str = "clip") -> tuple[Trace, LoadReport]:
    if failed not in ("drop", "keep_as_one", "error"):
        raise ValueError(f"failed must be 'drop', 'keep_as_one' or 'error', got {failed!r}")
    if isinstance(models, str) or isinstance(log_types, str):
        raise ValueError("models= and log_types= take a sequence of names, e.g. ('ChatGPT',)")
    models_set = None if models is None else set(models)
    logs_set = None if log_types is None else set(log_types)
    fmt = "burstgpt"
    p, header, rows, end_note = _read_rows(path, fmt)
    ix = _column_index(p, header, fmt)
    report = _new_report(p, fmt, rows, end_note)
    report.excluded = {"model": 0, "log_type": 0, "failed": 0}
    if logs_set is not None and "Log Type" not in header:
        raise TraceFormatError(p, 1, "log_types= given but the file has no 'Log Type' column")
    il = header.index("Log Type") if "Log Type" in header else None
    t, prompt, output, lines = [], [], [], []
    kept_failed: list[int] = []
    for line, f in rows:
        ts = _parse_float(p, line, "Timestamp", f[ix["Timestamp"]], nonneg=True)
        req = _parse_count(p, line, "Request tokens", f[ix["Request tokens"]])
        resp = _parse_count(p, line, "Response tokens", f[ix["Response tokens"]])
        model = f[ix["Model"]].strip()
        if models_set is not None and model not in models_set:
            report.excluded["model"] += 1
            continue
        if logs_set is not None and f[il].strip() not in logs_set:
            report.excluded["log_type"] += 1
            continue
        if resp == 0:
            if failed == "error":
                raise TraceFormatError(p, line, "failed request (Response tokens == 0) and "
                                                "failed='error'")
            if failed == "drop":
                report.excluded["failed"] += 1
                continue
            req, resp = max(1, req), 1
            kept_failed.append(line)
        t.append(ts)
        prompt.append(req)
        output.append(resp)
        lines.append(line)
    if kept_failed:
        shown = ", ".join(str(x) for x in kept_failed[:10])
        more = f" and {len(kept_failed) - 10} more" if len(kept_failed) > 10 else ""
        report.notes.append(f"{len(kept_failed)} failed request(s) kept with output 1 and "
                            f"prompt max(1, Request tokens) (failed='keep_as_one'): line(s) "
                            f"{shown}{more}")
    t_a = np.asarray(t, dtype=np.float64)
    prompt_a = np.asarray(prompt, dtype=np.int64)
    output_a = np.asarray(output, dtype=np.int64)
    lines_a = np.asarray(lines, dtype=np.int64)
    keep = _tokens_policy(p, report, lines_a, prompt_a, output_a,
                          zero_tokens, ("Request tokens", "Response tokens"))
    t_a, prompt_a, output_a, lines_a = t_a[keep], prompt_a[keep], output_a[keep], lines_a[keep]
    t0 = float(t_a.min()) if t_a.shape[0] else 0.0
    return _finish(p, report, t_a - t0, prompt_a, output_a, _num_str(t0), lines=lines_a,
                   time_col="Timestamp")


def _check_tokens_per_second(tokens_per_second: float) -> float:
    try:
        v = float(tokens_per_second)
    except (TypeError, ValueError):
        raise ValueError(f"tokens_per_second must be a number, got {tokens_per_second!r}") \
            from None
    if not (math.isfinite(v) and 0 < v <= MAX_TOKENS):
        raise ValueError(f"tokens_per_second must be in (0, {MAX_TOKENS}] tokens/s (a 1 s "
                         f"invocation must fit the engine's largest request), got "
                         f"{tokens_per_second}")
    return v


def _derive_output_tokens(p: Path, lines: np.ndarray, duration_s: np.ndarray,
                          tokens_per_second: float, prompt_tokens: int) -> np.ndarray:
    """`max(1, rint(duration_s * tokens_per_second))`, refusing (with the file line) an
    invocation whose output would make prompt + output exceed `MAX_TOKENS`."""
    out = np.maximum(1.0, np.rint(duration_s * tokens_per_second))
    bad = out + prompt_tokens > MAX_TOKENS
    if np.any(bad):
        i = int(np.flatnonzero(bad)[0])
        raise TraceFormatError(
            p, int(lines[i]), f"a duration of {duration_s[i]:g} s at tokens_per_second="
                              f"{tokens_per_second:g} gives {out[i]:.0f} output tokens; with "
                              f"prompt_tokens={prompt_tokens} that exceeds the engine's largest "
                              f"request ({MAX_TOKENS} tokens): lower tokens_per_second")
    return out.astype(np.int64)


def _check_prompt_tokens(prompt_tokens: int) -> int:
    try:
        ok = int(prompt_tokens) == prompt_tokens and 1 <= prompt_tokens < MAX_TOKENS
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok or isinstance(prompt_tokens, bool):
        raise ValueError(f"prompt_tokens must be an integer in [1, {MAX_TOKENS - 1}], got "
                         f"{prompt_tokens!r}")
    return int(prompt_tokens)


def _read_azure_functions_2021(path: Any, *, tokens_per_second: float = 50.0,
                               prompt_tokens: int = 512) -> tuple[Trace, LoadReport]:
    prompt_tokens = _check_prompt_tokens(prompt_tokens)
    tokens_per_second = _check_tokens_per_second(tokens_per_second)
    fmt = "azure_functions_2021"
    p, header, rows, end_note = _read_rows(path, fmt)
    ix = _column_index(p, header, fmt)
    report = _new_report(p, fmt, rows, end_note)
    n = len(rows)
    end = np.empty(n, dtype=np.float64)
    dur = np.empty(n, dtype=np.float64)
    lines = np.asarray([line for line, _ in rows], dtype=np.int64)
    for i, (line, f) in enumerate(rows):
        end[i] = _parse_float(p, line, "end_timestamp", f[ix["end_timestamp"]], nonneg=True)
        dur[i] = _parse_float(p, line, "duration", f[ix["duration"]], nonneg=True)
        if dur[i] > end[i]:
            raise TraceFormatError(
                p, line, f"duration ({f[ix['duration']]}) exceeds end_timestamp "
                         f"({f[ix['end_timestamp']]}): the arrival would be before 0")
    arrival = end - dur
    output = _derive_output_tokens(p, lines, dur, tokens_per_second, prompt_tokens)
    prompt = np.full(n, prompt_tokens, dtype=np.int64)
    t0 = float(arrival.min())
    return _finish(p, report, arrival - t0, prompt, output, _num_str(t0), lines=lines,
                   time_col="end_timestamp - duration")


def _read_durations_2019(path: Any) -> dict[tuple[str, str, str], float]:
    """Reads a 2019 ``function_durations_percentiles`` file: (owner, app, func) -> Average s."""
    cols = ("HashOwner", "HashApp", "HashFunction", "Average")
    p, header, rows, _ = _read_rows(path, "azure_functions_2019", cols)
    ix = _column_index(p, header, "azure_functions_2019", cols)
    out: dict[tuple[str, str, str], float] = {}
    for line, f in rows:
        ms = _parse_float(p, line, "Average", f[ix["Average"]], nonneg=True)
        out[(f[ix["HashOwner"]], f[ix["HashApp"]], f[ix["HashFunction"]])] = ms / 1000.0
    return out


def _read_azure_functions_2019(path: Any, *, tokens_per_second: float = 50.0,
                               prompt_tokens: int = 512, duration_s: float = 1.0,
                               durations_path: Any = None) -> tuple[Trace, LoadReport]:
    prompt_tokens = _check_prompt_tokens(prompt_tokens)
    tokens_per_second = _check_tokens_per_second(tokens_per_second)
    if not (math.isfinite(duration_s) and duration_s >= 0):
        raise ValueError(f"duration_s must be finite and >= 0, got {duration_s}")
    durations = _read_durations_2019(durations_path) if durations_path is not None else None
    fmt = "azure_functions_2019"
    p, header, rows, end_note = _read_rows(path, fmt)
    _column_index(p, header, fmt)
    if header[:4] != list(_COLUMNS[fmt]):
        raise TraceFormatError(p, 1, f"the first columns must be {','.join(_COLUMNS[fmt])}")
    minutes = header[4:]
    if not minutes:
        raise TraceFormatError(p, 1, "no per-minute count columns after Trigger")
    for j, name in enumerate(minutes):
        if name != str(j + 1):
            raise TraceFormatError(
                p, 1, f"per-minute columns must be named 1,2,3,...; column {j + 5} is "
                      f"{name!r}, expected '{j + 1}'")
    report = _new_report(p, fmt, rows, end_note)
    times, durs, row_lines = [], [], []
    missing = 0
    for line, f in rows:
        counts = np.asarray([_parse_count(p, line, f"minute {j + 1}", s)
                             for j, s in enumerate(f[4:])], dtype=np.int64)
        total = int(counts.sum())
        if total == 0:
            continue
        m = np.repeat(np.arange(counts.shape[0]), counts)            # 0-based minute
        start = np.concatenate([[0], np.cumsum(counts)[:-1]])
        k = np.arange(total) - np.repeat(start, counts)             # index within minute
        nn = np.repeat(counts, counts)
        times.append(60.0 * m + 60.0 * (k + 0.5) / nn)
        d = duration_s
        if durations is not None:
            key = (f[0], f[1], f[2])
            if key in durations:
                d = durations[key]
            else:
                missing += 1
        durs.append(np.full(total, d))
        row_lines.append(np.full(total, line, dtype=np.int64))
    if missing:
        report.notes.append(f"{missing} function(s) not in durations_path; used "
                            f"duration_s={duration_s}")
    if not times:
        raise TraceFormatError(p, None, "no invocations (all per-minute counts are 0)")
    arrival = np.concatenate(times)
    # Rows are concatenated function by function; the stable sort in `_finish` orders them
    # by time and keeps file order among equal times.
    lines = np.concatenate(row_lines)
    output = _derive_output_tokens(p, lines, np.concatenate(durs), tokens_per_second,
                                   prompt_tokens)
    prompt = np.full(arrival.shape[0], prompt_tokens, dtype=np.int64)
    t0 = float(arrival.min())
    return _finish(p, report, arrival - t0, prompt, output, _num_str(t0), lines=lines)


def _num_str(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


_READERS: dict[str, Callable[..., tuple[Trace, LoadReport]]] = {
    "azure_llm_2023": _read_azure_llm_2023,
    "azure_llm_reencoded": _read_azure_llm_reencoded,
    "burstgpt": _read_burstgpt,
    "azure_functions_2021": _read_azure_functions_2021,
    "azure_functions_2019": _read_azure_functions_2019,
}


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def detect_format(path: Any) -> str:
    """Returns the format name of a trace file from its header line (see `FORMATS`).

    Raises TraceFormatError (line 1) when the header matches no known format.
    """
    p = _open_checked(path)
    try:
        with open(p, newline="", encoding="utf-8-sig") as f:
            header = next(csv.reader(f), [])
    except (UnicodeDecodeError, csv.Error) as e:
        raise TraceFormatError(p, 1, f"unreadable header: {e}") from None
    header = [h.strip() for h in header]
    hs = set(header)
    for fmt, cols in _COLUMNS.items():
        if fmt == "azure_functions_2019":
            if header[:4] == list(cols):
                return fmt
        elif hs.issuperset(cols):
            return fmt
    # A partial match names the missing columns of the closest format.
    overlap = {fmt: len(hs.intersection(cols)) for fmt, cols in _COLUMNS.items()}
    best = max(overlap, key=overlap.get)
    if overlap[best] >= 2:
        _column_index(p, header, best)  # raises "missing column(s) ..."
    expected = "; ".join(f"{k}: {','.join(v)}" for k, v in _COLUMNS.items())
    raise TraceFormatError(p, 1, f"unrecognized header {_show_header(header)!r}; expected the "
                                 f"columns of one of the formats ({expected})")


def load_with_report(path: Any, format: str | None = None,
                     **kwargs: Any) -> tuple[Trace, LoadReport]:
    """Like `load`, and also returns the `LoadReport` (rows read, excluded, clipped, origin)."""
    fmt = detect_format(path) if format is None else format
    if fmt not in _READERS:
        raise ValueError(f"unknown trace format {fmt!r}; known: {', '.join(FORMATS)}")
    return _READERS[fmt](path, **kwargs)


def load(path: Any, format: str | None = None, **kwargs: Any) -> Trace:
    """Loads a trace file; detects the format from the header unless `format` names it.

    Returns a `Trace` with arrival seconds rebased to 0 (first request), sorted (stable), and
    token counts >= 1. `kwargs` go to the format's loader (e.g. ``models=`` for BurstGPT,
    ``tokens_per_second=`` for Functions). Raises TraceFormatError on any defect.
    """
    return load_with_report(path, format, **kwargs)[0]


def load_azure_llm_2023(path: Any, *, check_sorted: bool = True,
                        zero_tokens: str = "clip") -> Trace:
    """Azure LLM inference trace (``TIMESTAMP,ContextTokens,GeneratedTokens``).

    Timestamps are parsed exactly (integer nanoseconds) and rebased: arrival seconds count from
    the first row. prompt = ContextTokens, output = GeneratedTokens. The file must be sorted by
    TIMESTAMP (raises naming the first line that goes backwards) unless `check_sorted=False`,
    which sorts stably instead. `zero_tokens`: 'clip' (0 -> 1), 'drop' or 'error'.
    """
    return _read_azure_llm_2023(path, check_sorted=check_sorted, zero_tokens=zero_tokens)[0]


def load_azure_llm_reencoded(path: Any, *, check_sorted: bool = True,
                             zero_tokens: str = "clip") -> Trace:
    """Vidur re-encoding (``arrived_at,num_prefill_tokens,num_decode_tokens``, seconds).

    Times are rebased to the first arrival; rows must be sorted unless `check_sorted=False`.
    """
    return _read_azure_llm_reencoded(path, check_sorted=check_sorted,
                                     zero_tokens=zero_tokens)[0]


def load_burstgpt_with_report(path: Any, *, models: Iterable[str] | None = None,
                              log_types: Iterable[str] | None = None, failed: str = "drop",
                              zero_tokens: str = "clip") -> tuple[Trace, LoadReport]:
    """BurstGPT trace, with the `LoadReport`; see `load_burstgpt`.

    ``report.excluded`` has the keys ``model``, ``log_type`` and ``failed`` (row counts), plus
    ``zero_tokens`` when ``zero_tokens='drop'``.
    """
    return _read_burstgpt(path, models=models, log_types=log_types, failed=failed,
                          zero_tokens=zero_tokens)


def load_burstgpt(path: Any, *, models: Iterable[str] | None = None,
                  log_types: Iterable[str] | None = None, failed: str = "drop",
                  zero_tokens: str = "clip") -> Trace:
    """BurstGPT trace (``Timestamp`` in seconds; ``Request``/``Response tokens``).

    Args:
      models: keep only these ``Model`` values (e.g. ``("ChatGPT",)``); None keeps all.
      log_types: keep only these ``Log Type`` values (e.g. ``("Conversation log",)``).
      failed: rows with ``Response tokens == 0``: 'drop' (default), 'keep_as_one' (output 1,
        prompt max(1, Request tokens)) or 'error'.
      zero_tokens: 'clip' | 'drop' | 'error' for other zero token counts (e.g. a zero
        ``Request tokens`` with a non-zero response).

    Arrival seconds are rebased to the first kept request and stably sorted. The counts of
    excluded rows are in `load_burstgpt_with_report`'s report.
    """
    return load_burstgpt_with_report(path, models=models, log_types=log_types, failed=failed,
                                     zero_tokens=zero_tokens)[0]


def load_azure_functions_2021(path: Any, *, tokens_per_second: float = 50.0,
                              prompt_tokens: int = 512) -> Trace:
    """Azure Functions 2021 (``app,func,end_timestamp,duration``, seconds).

    arrival = end_timestamp - duration (rebased to the first, stably sorted);
    output_tokens = max(1, rint(duration * tokens_per_second)); prompt_tokens constant.
    """
    return _read_azure_functions_2021(path, tokens_per_second=tokens_per_second,
                                      prompt_tokens=prompt_tokens)[0]


def load_azure_functions_2019(path: Any, *, tokens_per_second: float = 50.0,
                              prompt_tokens: int = 512, duration_s: float = 1.0,
                              durations_path: Any = None) -> Trace:
    """Azure Functions 2019 per-minute counts (``HashOwner,HashApp,HashFunction,Trigger,1..``).

    The k-th (k = 0..n-1) of the n invocations in minute column m arrives at
    ``60*(m-1) + 60*(k+0.5)/n`` s; all functions are merged and stably sorted, then rebased to
    the first arrival (so a file whose first invocation is in minute 1 with n = 1 starts at 0,
    not 30 s: see `LoadReport.origin`). Each invocation's duration is `duration_s`, or the
    function's ``Average`` (ms) in the 2019 durations file `durations_path`;
    output_tokens = max(1, rint(duration * tokens_per_second)), prompt_tokens constant.
    """
    return _read_azure_functions_2019(path, tokens_per_second=tokens_per_second,
                                      prompt_tokens=prompt_tokens, duration_s=duration_s,
                                      durations_path=durations_path)[0]
