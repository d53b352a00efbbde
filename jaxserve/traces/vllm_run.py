"""Reads a real vLLM serving run recorded in the `llmservingsim_vllm_bench` format.

A run folder (see `../shared/fidelity/llmservingsim_vllm_bench/README.md`, from
casys-kaist/LLMServingSim, MIT) holds:

* `vllm_meta.json`: vLLM version, `engine_kwargs` (max_num_seqs, max_num_batched_tokens,
  tensor/data parallel sizes), `dataset_path` and `dataset_hash` (sha256 of the uncompressed
  workload), and where recorded `kv_cache` (num_gpu_blocks, block_size, gpu_memory_utilization,
  enable_prefix_caching) and `hardware` (device name and memory).
* `vllm_requests.jsonl`: one line per request, `request_id` "bench-<i>" (`i` the line of the
  workload file), `queued_ts`, `scheduled_ts`, `first_token_ts`, `last_token_ts` (vLLM's engine
  clock, s).
* `vllm_timeseries.csv` (optional): 1-s ticks of `running`, `waiting`, `kv_cache_pct`.
* `llmservingsim_per_request.csv` (optional): the other simulator's per-request times (ns).

The workload (`input_toks`, `output_toks`, `arrival_time_ns` offsets, `input_tok_ids`) is a JSON
lines file, plain or gzipped, found beside the run or at `dataset_path` relative to the run's
grandparent folder (the bench layout `runs/<name>/` + `workloads/`), or given explicitly.

Definitions (the bench's README, and LLMServingSim's validator): TTFT = first_token_ts -
queued_ts, TPOT = (last_token_ts - first_token_ts) / (output_tokens - 1), E2E = last_token_ts -
queued_ts; every time in this module is in seconds.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from jaxserve.core.types import Trace
from jaxserve.traces.prefix import PrefixTrace, build_prefix_tree

__all__ = ["VllmRun", "load_vllm_run", "chained_block_hashes", "prefix_trace_of",
           "real_request_metrics", "summarize"]


@dataclass(frozen=True)
class VllmRun:
    """One real vLLM run: its engine configuration, exact workload and measured timings.

    Attributes:
      name: the run folder's name.
      path: the run folder.
      meta: `vllm_meta.json` as read.
      arrival_s: `(n,)` workload arrival offsets (s, from the workload's first request).
      prompt_tokens, output_tokens: `(n,)` int64 token counts.
      prompt_ids: per request, the prompt's token ids (`(p_i,)` int64 arrays).
      queued, scheduled, first_token, last_token: `(n,)` engine-clock timestamps (s), in
        workload order (the request ids' index).
      timeseries: columns of `vllm_timeseries.csv` (float arrays), or None.
      other_sim: LLMServingSim's per-request `ttft`, `tpot`, `e2e` (s) in workload order, or None.
    """

    name: str
    path: Path
    meta: dict
    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    prompt_ids: list = field(repr=False)
    queued: np.ndarray = field(repr=False)
    scheduled: np.ndarray = field(repr=False)
    first_token: np.ndarray = field(repr=False)
    last_token: np.ndarray = field(repr=False)
    timeseries: dict | None = field(repr=False, default=None)
    other_sim: dict | None = field(repr=False, default=None)

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def engine(self) -> dict:
        """`meta["engine_kwargs"]` (empty dict if absent)."""
        return dict(self.meta.get("engine_kwargs") or {})

    @property
    def block_size(self) -> int:
        """KV block size (tokens): the recorded one, else vLLM's default 16."""
        kv = self.meta.get("kv_cache") or {}
        return int(kv.get("block_size") or self.engine.get("block_size") or 16)

    @property
    def num_gpu_blocks(self) -> int | None:
        """KV blocks vLLM allocated per engine, when the run recorded them."""
        kv = self.meta.get("kv_cache") or {}
        v = kv.get("num_gpu_blocks")
        return None if v is None else int(v)

    @property
    def prefix_caching(self) -> bool:
        """Whether automatic prefix caching was on (vLLM v1's default: on)."""
        kv = self.meta.get("kv_cache") or {}
        v = kv.get("enable_prefix_caching", self.engine.get("enable_prefix_caching", True))
        return bool(v)

    @property
    def data_parallel(self) -> int:
        return int(self.engine.get("data_parallel_size", 1) or 1)

    @property
    def tensor_parallel(self) -> int:
        return int(self.engine.get("tensor_parallel_size", 1) or 1)

    def trace(self, arrivals: str = "workload") -> Trace:
        """The requests as a `Trace`.

        Args:
          arrivals: "workload" (the offsets the client sent) or "queued" (when vLLM's engine
            queued each request, relative to the first, made non-decreasing in request order:
            includes the front end's ingest delay, a diagnostic, not a prediction).
        """
        if arrivals == "workload":
            a = self.arrival_s
        elif arrivals == "queued":
            # Data-parallel engines queue in parallel, so neighbours may swap by under a
            # millisecond: each time is lifted to the previous one, keeping the workload's order.
            a = np.maximum.accumulate(self.queued - self.queued.min())
        else:
            raise ValueError(f"arrivals must be 'workload' or 'queued', got {arrivals!r}")
        return Trace(arrival_s=np.asarray(a, np.float64), prompt_tokens=self.prompt_tokens,
                     output_tokens=self.output_tokens)


def _sha256_of(path: Path) -> str:
    """sha256 of a file's (uncompressed, if gzipped) bytes."""
    h = hashlib.sha256()
    with (gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")) as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _find_workload(run_dir: Path, meta: dict, workload: Path | None) -> Path:
    if workload is not None:
        p = Path(workload)
        if not p.is_file():
            raise ValueError(f"workload {p} is not a file")
        return p
    ds = meta.get("dataset_path")
    if not ds:
        raise ValueError(f"{run_dir}/vllm_meta.json has no dataset_path; pass the workload file")
    ds = Path(ds)
    candidates = []
    for base in (run_dir, run_dir.parent, run_dir.parent.parent):
        for rel in (ds, Path(ds.name)):
            candidates += [base / rel, base / (str(rel) + ".gz")]
    for c in candidates:
        if c.is_file():
            return c
    # A mirror may keep one copy of byte-identical workloads under another name: match by hash.
    want = meta.get("dataset_hash")
    if want:
        for folder in {run_dir, (run_dir.parent.parent / ds).parent}:
            for c in sorted(folder.glob("*.jsonl*")) if folder.is_dir() else []:
                if _sha256_of(c) == want:
                    return c
    raise ValueError(f"workload {ds} of run {run_dir.name} not found (looked beside the run and "
                     f"at {run_dir.parent.parent / ds}[.gz], and for a file with its "
                     "dataset_hash); pass it explicitly")


def _read_workload(path: Path, expected_sha256: str | None) -> list[dict]:
    h = hashlib.sha256()
    rows = []
    with (gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")) as f:
        for line_no, raw in enumerate(f, 1):
            h.update(raw)
            line = raw.decode()
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not JSON ({e.msg})") from None
            for k in ("input_toks", "output_toks", "arrival_time_ns", "input_tok_ids"):
                if k not in row:
                    raise ValueError(f"{path}:{line_no}: missing field {k!r}")
            if len(row["input_tok_ids"]) != int(row["input_toks"]):
                raise ValueError(f"{path}:{line_no}: input_toks {row['input_toks']} but "
                                 f"{len(row['input_tok_ids'])} input_tok_ids")
            if int(row["input_toks"]) < 1 or int(row["output_toks"]) < 1:
                raise ValueError(f"{path}:{line_no}: input_toks and output_toks must be >= 1")
            rows.append(row)
    if expected_sha256 and h.hexdigest() != expected_sha256:
        raise ValueError(f"workload {path}: sha256 {h.hexdigest()} does not match the run's "
                         f"dataset_hash {expected_sha256}")
    if not rows:
        raise ValueError(f"workload {path} holds no requests")
    return rows


def _read_requests(path: Path, n: int) -> dict[str, np.ndarray]:
    keys = ("queued_ts", "scheduled_ts", "first_token_ts", "last_token_ts")
    out = {k: np.full(n, np.nan) for k in keys}
    seen = np.zeros(n, bool)
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            rid = str(row.get("request_id", ""))
            try:
                i = int(rid.rsplit("-", 1)[-1])
            except ValueError:
                raise ValueError(f"{path}:{line_no}: request_id {rid!r} is not '<name>-<index>'") \
                    from None
            if not 0 <= i < n:
                raise ValueError(f"{path}:{line_no}: request index {i} outside the workload's "
                                 f"{n} requests")
            if seen[i]:
                raise ValueError(f"{path}:{line_no}: request {rid} recorded twice")
            seen[i] = True
            for k in keys:
                if row.get(k) is None:
                    raise ValueError(f"{path}:{line_no}: {k} missing")
                out[k][i] = float(row[k])
    if not seen.all():
        raise ValueError(f"{path}: {int((~seen).sum())} of the workload's {n} requests have no "
                         f"timings (first missing: bench-{int(np.argmin(seen))})")
    return out


def _read_csv_columns(path: Path) -> dict[str, np.ndarray]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return {}
    return {k: np.array([float(r[k]) if r[k] not in ("", None) else np.nan for r in rows])
            for k in rows[0]}


def _read_other_sim(path: Path, n: int) -> dict[str, np.ndarray] | None:
    if not path.is_file():
        return None
    cols = _read_csv_columns(path)
    need = ("request_id", "TTFT_ns", "TPOT_ns", "latency_ns")
    if not all(k in cols for k in need):
        return None
    out = {k: np.full(n, np.nan) for k in ("ttft", "tpot", "e2e")}
    idx = cols["request_id"].astype(np.int64)
    ok = (idx >= 0) & (idx < n)
    out["ttft"][idx[ok]] = cols["TTFT_ns"][ok] * 1e-9
    out["tpot"][idx[ok]] = cols["TPOT_ns"][ok] * 1e-9
    out["e2e"][idx[ok]] = cols["latency_ns"][ok] * 1e-9
    return out


def load_vllm_run(run_dir, workload=None) -> VllmRun:
    """Reads a run folder (module docstring). Raises ValueError naming the file and line of
    anything missing or inconsistent (a workload whose sha256 differs from the run's
    `dataset_hash`, a request without timings, out-of-order timestamps)."""
    run_dir = Path(run_dir)
    meta_path = run_dir / "vllm_meta.json"
    if not meta_path.is_file():
        raise ValueError(f"{run_dir} is not a run folder: no vllm_meta.json")
    meta = json.loads(meta_path.read_text())
    wl_path = _find_workload(run_dir, meta, None if workload is None else Path(workload))
    rows = _read_workload(wl_path, meta.get("dataset_hash"))
    n = len(rows)
    arrival_ns = np.array([int(r["arrival_time_ns"]) for r in rows], np.int64)
    if np.any(np.diff(arrival_ns) < 0):
        raise ValueError(f"workload {wl_path}: arrival_time_ns must be non-decreasing")
    req_path = run_dir / "vllm_requests.jsonl"
    if not req_path.is_file():
        raise ValueError(f"{run_dir}: no vllm_requests.jsonl")
    ts = _read_requests(req_path, n)
    for a, b in (("queued_ts", "first_token_ts"), ("first_token_ts", "last_token_ts")):
        bad = ts[b] < ts[a]
        if bad.any():
            raise ValueError(f"{req_path}: {b} before {a} for bench-{int(np.argmax(bad))}")
    tsv = run_dir / "vllm_timeseries.csv"
    return VllmRun(
        name=run_dir.name, path=run_dir, meta=meta,
        arrival_s=(arrival_ns - arrival_ns[0]).astype(np.float64) * 1e-9,
        prompt_tokens=np.array([int(r["input_toks"]) for r in rows], np.int64),
        output_tokens=np.array([int(r["output_toks"]) for r in rows], np.int64),
        prompt_ids=[np.asarray(r["input_tok_ids"], np.int64) for r in rows],
        queued=ts["queued_ts"], scheduled=ts["scheduled_ts"],
        first_token=ts["first_token_ts"], last_token=ts["last_token_ts"],
        timeseries=_read_csv_columns(tsv) if tsv.is_file() else None,
        other_sim=_read_other_sim(run_dir / "llmservingsim_per_request.csv", n))


def chained_block_hashes(token_ids, block_size: int) -> list[int]:
    """Identity of each *full* block of a prompt, chained as vLLM's prefix cache hashes them:
    block `j`'s id digests block `j - 1`'s id and the block's `block_size` token ids, so two
    prompts share id `j` iff their first `(j + 1) * block_size` tokens are equal. A trailing
    partial block gets no id (docs/prefix_caching.md section 1). Ids are 63-bit integers (the
    first 8 bytes of a sha256)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    ids = np.asarray(token_ids, np.int64)
    out = []
    parent = b""
    for j in range(len(ids) // block_size):
        d = hashlib.sha256(parent + ids[j * block_size:(j + 1) * block_size].tobytes()).digest()
        parent = d
        out.append(int.from_bytes(d[:8], "little") & ((1 << 63) - 1))
    return out


def prefix_trace_of(run: VllmRun, block_size: int | None = None,
                    arrivals: str = "workload") -> PrefixTrace:
    """The run's workload as a `PrefixTrace`: each request's full prompt blocks, identified by
    `chained_block_hashes`, as a path of a prefix tree whose nodes are `block_size`-token
    blocks (default: the run's block size)."""
    b = run.block_size if block_size is None else int(block_size)
    lists = [chained_block_hashes(ids, b) for ids in run.prompt_ids]
    tree, node = build_prefix_tree(lists, b)
    full = np.array([len(x) for x in lists], np.int64)
    return PrefixTrace(trace=run.trace(arrivals), node=node, full_blocks=full, tree=tree)


def real_request_metrics(run: VllmRun) -> dict[str, np.ndarray]:
    """Per-request `ttft`, `tpot` (NaN for one output token), `e2e` and `queue_wait`
    (scheduled - queued), in seconds, from the run's engine timestamps."""
    o = run.output_tokens.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(o > 1, (run.last_token - run.first_token) / np.maximum(o - 1, 1), np.nan)
    return {"ttft": run.first_token - run.queued, "tpot": tpot,
            "e2e": run.last_token - run.queued, "queue_wait": run.scheduled - run.queued}


def summarize(values) -> dict[str, float]:
    """Mean, median (p50), p90, p95 and p99 of the finite entries (NaN when none), in the
    input's units. Percentiles interpolate linearly (numpy's default, as the bench's
    validator)."""
    v = np.asarray(values, np.float64)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return {k: float("nan") for k in ("mean", "p50", "p90", "p95", "p99")}
    p50, p90, p95, p99 = np.percentile(v, [50, 90, 95, 99])
    return {"mean": float(v.mean()), "p50": float(p50), "p90": float(p90), "p95": float(p95),
            "p99": float(p99)}
