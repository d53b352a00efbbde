"""The continuous-batching engine checked against a real vLLM run (docs/fidelity.md).

`validate_run(run_dir)` reads a run folder in the `llmservingsim_vllm_bench` format
(`traces.vllm_run`), builds the replica from the run's engine configuration, derives its
iteration-time coefficients from the kernel profiles measured on the same GPU and model
(`core.kernel_fit`; nothing is fitted to the run's latencies), replays the exact workload with
prefix caching and chunked prefill through the JAX engine (`evaluation.replay.replay_prefix`),
and compares per-request TTFT / TPOT / E2E and the running / waiting / KV time series with the
real run and, where the folder has it, with LLMServingSim's prediction.

Three simulations, all of the same workload and scheduler:

* `jaxserve`: the JAX engine with the fitted iteration form (the product being validated);
* `reference (form)`: the pure-Python reference (`jaxserve.reference.prefix`) with the same
  coefficients; it equals the engine per request (the contract; checked here, `max_diff_s`)
  and gives the iteration log and time series;
* `reference (profile)`: the reference with each iteration's time read from the kernel
  profiles directly: what the form's fit costs is the gap between it and `jaxserve`.

Times are seconds unless a name says `_ms`.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from jaxserve.core.kernel_fit import (FORM_FIELDS, MODEL_SHAPES, KernelProfile,
                                      composition_features, fit_iteration_form,
                                      load_kernel_profile)
from jaxserve.core.replica import ReplicaProfile, validate_replica
from jaxserve.evaluation.replay import replay_prefix
from jaxserve.policies.llm_routing import vllm_dp_engine
from jaxserve.reference.continuous import split_schedule
from jaxserve.reference.prefix import simulate_prefix
from jaxserve.traces.vllm_run import (VllmRun, chained_block_hashes, load_vllm_run,
                                      prefix_trace_of, real_request_metrics, summarize)

__all__ = ["FidelityOptions", "validate_run", "derive_kv_blocks", "locate_profile_dir",
           "reference_dp_router", "error_rows", "write_report", "METRICS", "STATS"]

METRICS = ("ttft", "tpot", "e2e")
STATS = ("mean", "p50", "p90", "p99")
GIB = 1024 ** 3


@dataclass(frozen=True)
class FidelityOptions:
    """How a run is replayed.

    Attributes:
      arrivals: "workload" (the offsets the client sent: the prediction) or "queued" (when
        vLLM queued each request: takes the front end's ingest delay from the run, a
        diagnostic).
      step_overhead_s: seconds added to every iteration (host time the kernel profiles cannot
        see); 0 unless estimated on another run (docs/fidelity.md).
      reserve_full_prompt: admit a waiting request only when its whole sequence's blocks are
        free (vLLM 0.19's `scheduler_reserve_full_isl`); run in the reference only, to measure
        what the engine's chunk-only check costs.
      kv_blocks: KV blocks per replica, overriding the run's record or the derivation.
      tp: tensor-parallel profile to read (default: the run's).
      layers: the model's decoder layers (default: `kernel_fit.MODEL_SHAPES`).
      ep_collectives: add expert-parallel collectives to each MoE layer, over the link of
        `llmservingsim_cluster_config.json` (`link_bw` GB/s, `link_latency` ns); a measurement
        of what leaving them out costs, not the default.
      engine: False skips the JAX engine (variants measured on the reference alone).
      skew: apply the profile's decode-skew correction (`kernel_fit`; on by default where
        the profile measured it).
      prefix_caching: override the run's prefix caching (None: as the run had it).
      dp_lockstep: data-parallel ranks iterate in lockstep, an idle rank running a one-token
        dummy batch (vLLM's MoE data parallelism); run in the reference only, a measurement
        of what independent replicas leave out, not the default.
    """

    arrivals: str = "workload"
    step_overhead_s: float = 0.0
    reserve_full_prompt: bool = False
    kv_blocks: int | None = None
    tp: int | None = None
    layers: int | None = None
    ep_collectives: bool = False
    engine: bool = True
    skew: bool = True
    prefix_caching: bool | None = None
    dp_lockstep: bool = False


# --------------------------------------------------------------------------- configuration

def _cluster_config(run: VllmRun) -> dict:
    p = run.path / "llmservingsim_cluster_config.json"
    return json.loads(p.read_text()) if p.is_file() else {}


def _hardware_name(run: VllmRun) -> str | None:
    cfg = _cluster_config(run)
    for node in cfg.get("nodes", []):
        for inst in node.get("instances", []):
            if inst.get("hardware"):
                return str(inst["hardware"])
    return run.name.split("__")[0] if "__" in run.name else None


def _gpu_memory_bytes(run: VllmRun) -> tuple[float | None, str]:
    hw = run.meta.get("hardware") or {}
    if hw.get("device_total_memory_bytes"):
        return float(hw["device_total_memory_bytes"]), "vllm_meta.json hardware"
    for node in _cluster_config(run).get("nodes", []):
        for inst in node.get("instances", []):
            mem = (inst.get("npu_mem") or {}).get("mem_size")
            if mem:
                return float(mem) * GIB, "llmservingsim_cluster_config.json npu_mem (GiB)"
    return None, "unknown"


def derive_kv_blocks(run: VllmRun, activation_bytes: float = 0.0) -> tuple[int | None, str]:
    """KV blocks per engine by vLLM 0.19's rule (`Worker.determine_available_memory`,
    `vllm/v1/worker/gpu_worker.py`; `get_num_blocks`, `vllm/v1/core/kv_cache_utils.py`):

        blocks = floor((total * gpu_memory_utilization - weights - activation) /
                       (2 * layers * kv_heads * head_dim * dtype_bytes * block_size))

    with bf16 weights of the model's parameters (split by expert parallelism across the data
    parallel ranks of an MoE model) and `activation_bytes` for the profile run's peak
    activations and non-torch memory, which only a run shows (0 by default: an upper bound).
    Returns (blocks, how) or (None, why not)."""
    model = run.meta.get("model") or run.engine.get("model")
    shape = MODEL_SHAPES.get(model or "")
    total, where = _gpu_memory_bytes(run)
    if shape is None or total is None:
        return None, f"cannot derive (model {model!r} shape or GPU memory unknown)"
    kv = run.meta.get("kv_cache") or {}
    util = float(kv.get("gpu_memory_utilization") or 0.9)
    weights = 2.0 * shape["params"] / run.tensor_parallel
    if shape.get("experts") and run.engine.get("enable_expert_parallel") and run.data_parallel > 1:
        weights = 2.0 * (shape["params"] / run.data_parallel)  # experts dominate: ~1/DP each
    per_block = 2 * shape["layers"] * shape["kv_hidden"] * 2 * run.block_size / run.tensor_parallel
    free = math.ceil(total * util) - weights - activation_bytes
    blocks = int(free // per_block)
    how = (f"derived: ceil({total / GIB:.2f} GiB ({where}) x {util}) - {weights / 1e9:.2f} GB "
           f"bf16 weights - {activation_bytes / 1e9:.2f} GB activations, / {per_block / 2**20:.2f} "
           f"MiB per block")
    return (blocks if blocks >= 1 else None), how


def locate_profile_dir(run: VllmRun, profiles=None) -> Path:
    """The kernel-profile directory (`.../<org>/<model>/bf16`) of the run's model and GPU.

    `profiles` may be that directory, or a root holding `<GPU>/<org>/<model>/bf16/` (default:
    `profiles/` beside the run's `runs/` folder). Raises ValueError naming what was looked for.
    """
    model = run.meta.get("model") or run.engine.get("model")
    if profiles is not None and (Path(profiles) / "meta.yaml").is_file():
        return Path(profiles)
    root = Path(profiles) if profiles is not None else run.path.parent.parent / "profiles"
    gpu = _hardware_name(run)
    cands = sorted(root.glob(f"*/{model}/bf16")) if model else []
    if gpu:
        exact = [c for c in cands if c.relative_to(root).parts[0] == gpu]
        cands = exact or cands
    if len(cands) != 1:
        raise ValueError(f"kernel profile of model {model!r} on GPU {gpu!r} not found under "
                         f"{root} ({len(cands)} candidates); pass --profiles DIR")
    return cands[0]


# --------------------------------------------------------------------------- simulations

def reference_dp_router(i, replicas) -> int:
    """vLLM's data-parallel balancer on the reference's replicas: the lowest `4 * waiting +
    running` (waiting includes preempted requests), ties to the lowest index
    (`policies.llm_routing.vllm_dp_score` gives the source)."""
    scores = [4 * len(rp.waiting) + len(rp.running) for rp in replicas]
    return int(np.argmin(scores))


def _reference(run: VllmRun, lists, prof: dict, step_time, opts: FidelityOptions,
               caching: bool = True, tick_s: float = 1.0) -> dict:
    """Runs the reference; returns per-request times, the iteration compositions, the peak
    running count and the time series sampled at `tick_s` s. With `opts.dp_lockstep` the
    ranks iterate in lockstep and an idle rank's dummy batch is one token (vLLM's
    `execute_dummy_batch` runs a one-token forward), timed by `step_time` or the form."""
    n_rep = run.data_parallel
    comps, seen = [], {}
    events = []  # (t, waiting, running, held blocks) after every event instant

    def on_iteration(rp, t, sched, T):
        seen[id(rp)] = rp
        comps.append(split_schedule(sched))

    def check(t, arrived, completed, waiting, running, dropped):
        held = sum(rp.M - len(rp.queue) for rp in seen.values())
        events.append((t, waiting, running, held))

    idle_s = None
    if opts.dp_lockstep and n_rep > 1:
        idle_s = (step_time([(1, 0)], []) if step_time is not None
                  else prof["c0"] + prof["alpha"] + prof["alpha2"])
    tr = run.trace(opts.arrivals)
    p = dict(prof, reserve_full=opts.reserve_full_prompt)
    out = simulate_prefix(tr.arrival_s, tr.prompt_tokens, tr.output_tokens,
                          np.zeros(len(run), np.int64), [p] * n_rep, lists,
                          caching=caching, step_time=step_time, on_iteration=on_iteration,
                          accounting=False, check=check,
                          router=reference_dp_router if n_rep > 1 else None,
                          lockstep_idle_s=idle_s)
    ev = np.array(events, float).reshape(-1, 4)
    horizon = float(np.nanmax(out["finish"])) if np.isfinite(out["finish"]).any() else 0.0
    ticks = np.arange(tick_s, horizon + tick_s, tick_s)
    idx = np.searchsorted(ev[:, 0], ticks, side="right") - 1
    ok = idx >= 0
    series = {"t": ticks}
    for j, k in enumerate(("waiting", "running", "held_blocks"), start=1):
        series[k] = np.where(ok, ev[np.maximum(idx, 0), j], 0.0)
    series["kv_cache_pct"] = 100.0 * series.pop("held_blocks") / (prof["kv_blocks"] * n_rep)
    return {"first_token": out["first_token"], "finish": out["finish"],
            "preemptions": out["preemptions"], "compositions": comps,
            "peak_running": int(ev[:, 2].max()) if len(ev) else 0, "series": series,
            "arrival": tr.arrival_s}


def _metrics(arrival, first, finish, output) -> dict[str, np.ndarray]:
    o = np.asarray(output, float)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(o > 1, (finish - first) / np.maximum(o - 1, 1), np.nan)
    return {"ttft": first - arrival, "tpot": tpot, "e2e": finish - arrival}


def _pow2_at_least(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()


# --------------------------------------------------------------------------- tables

def error_rows(real: dict, sims: dict[str, dict]) -> list[dict]:
    """One row per (metric, statistic): the real value and each simulation's value with its
    signed error in percent (`(sim - real) / real * 100`); values in milliseconds."""
    rows = []
    for m in METRICS:
        r = summarize(real[m])
        s = {name: summarize(v[m]) for name, v in sims.items()}
        for st in STATS:
            row = {"metric": m, "stat": st, "real_ms": r[st] * 1e3}
            for name in sims:
                v = s[name][st]
                row[f"{name}_ms"] = v * 1e3
                row[f"{name}_err_pct"] = (v - r[st]) / r[st] * 100.0 if r[st] else float("nan")
            rows.append(row)
    return rows


def _parse_summary(path: Path) -> dict | None:
    """The bench's own summary (`llmservingsim_vs_vllm_summary.txt`): metric -> stat -> ms."""
    if not path.is_file():
        return None
    names = {"TTFT": "ttft", "TPOT": "tpot", "Latency": "e2e"}
    stats = {"Mean": "mean", "Median": "p50", "P90": "p90", "P95": "p95", "P99": "p99"}
    out: dict = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^(TTFT|TPOT|Latency)\s+(Mean|Median|P90|P95|P99)\s+([-\d.]+)\s+", line)
        if m:
            out.setdefault(names[m.group(1)], {})[stats[m.group(2)]] = float(m.group(3))
    return out or None


def _summary_check(run: VllmRun, real: dict) -> dict | None:
    """Our real statistics against the folder's own summary, at its printed precision."""
    ref = _parse_summary(run.path / "llmservingsim_vs_vllm_summary.txt")
    if ref is None:
        return None
    worst = 0.0
    for m, st in ref.items():
        ours = summarize(real[m])
        for k, v in st.items():
            worst = max(worst, abs(round(ours[k] * 1e3, 1) - v))
    return {"max_abs_diff_ms": worst, "reproduced": worst < 0.051}


# --------------------------------------------------------------------------- the validation

@dataclass
class FidelityResult:
    """Everything `validate_run` measured (see its docstring); `to_json()` for files."""

    run: str
    options: dict
    replica: dict
    kv_blocks_source: str
    kv_blocks_derived: str
    profile_dir: str
    fit: dict
    fit_check: dict
    rows: list
    summary_check: dict | None
    engine_vs_reference_max_diff_s: float
    per_request: dict = field(repr=False)
    series_real: dict | None = field(repr=False)
    series_sim: dict = field(repr=False)
    seconds: dict = field(default_factory=dict)
    slots: int = 0
    profile_skew: bool = False  # whether the kernel profile measured decode skew
    ep: int = 1  # expert-parallel ranks of the MoE layers
    data_parallel: int = 1  # engine replicas behind vLLM's data-parallel balancer

    def to_json(self) -> dict:
        d = asdict(self)
        d["per_request"] = {k: np.asarray(v).tolist() for k, v in self.per_request.items()}
        for k in ("series_real", "series_sim"):
            if d[k] is not None:
                d[k] = {a: np.asarray(b).tolist() for a, b in d[k].items()}
        return d


def validate_run(run_dir, profiles=None, options: FidelityOptions | None = None,
                 progress=None) -> FidelityResult:
    """Replays a real vLLM run and compares (module docstring).

    Steps: the run's workload and timings (`load_vllm_run`); its prefix identity (chained
    16-token block hashes of the prompt ids); the replica from the engine config (vLLM v1 keeps
    no admission watermark, its waiting queue is unbounded); KV blocks from the run, else
    derived (`derive_kv_blocks`); the iteration form fitted to the kernel profile's step times
    over the compositions the reference sees with profile step times; the JAX engine and the
    reference with those coefficients; the errors.

    Args:
      run_dir: the run folder.
      profiles: kernel-profile directory or root (`locate_profile_dir`).
      options: `FidelityOptions`.
      progress: optional `progress(message)` callback.
    """
    opts = options or FidelityOptions()
    say = progress or (lambda msg: None)
    clock = {}
    t0 = time.perf_counter()
    run = load_vllm_run(run_dir)
    real = real_request_metrics(run)
    ep = (run.data_parallel * run.tensor_parallel
          if run.engine.get("enable_expert_parallel") else 1)
    link = None
    cfg = _cluster_config(run)
    if opts.ep_collectives:
        if "link_bw" not in cfg or "link_latency" not in cfg:
            raise ValueError(f"{run.name}: ep_collectives needs link_bw and link_latency in "
                             "llmservingsim_cluster_config.json")
        link = (float(cfg["link_bw"]) * 1e9, float(cfg["link_latency"]) * 1e-9)
    kp: KernelProfile = load_kernel_profile(locate_profile_dir(run, profiles),
                                            tp=opts.tp or run.tensor_parallel,
                                            layers=opts.layers, ep=ep, ep_link=link)
    has_skew = kp.skew is not None
    if not opts.skew:
        kp = dataclasses.replace(kp, skew=None)
    caching = run.prefix_caching if opts.prefix_caching is None else bool(opts.prefix_caching)
    derived, how = derive_kv_blocks(run)
    if opts.kv_blocks is not None:
        blocks, source = int(opts.kv_blocks), "given (--kv-blocks)"
    elif run.num_gpu_blocks is not None:
        # vLLM keeps one of its blocks aside (the null block), so num_gpu_blocks - 1 hold KV.
        blocks, source = run.num_gpu_blocks - 1, "run (vllm_meta.json num_gpu_blocks - 1)"
    elif derived is not None:
        blocks, source = derived, "derived"
    else:
        raise ValueError(f"{run.name}: no KV block count recorded and none derivable ({how}); "
                         "pass kv_blocks")
    eng = run.engine
    n = len(run)
    sched = dict(kv_blocks=int(blocks), block_size=run.block_size,
                 max_seqs=int(eng.get("max_num_seqs", 256)),
                 max_tokens=int(eng.get("max_num_batched_tokens", 2048)),
                 chunked_prefill=True, watermark=0.0, queue_cap=n)
    lists = [chained_block_hashes(ids, run.block_size) for ids in run.prompt_ids]
    if not caching:
        lists = [[] for _ in lists]
    overhead = float(opts.step_overhead_s)

    def profile_step(pf, dec):
        return kp.step_time(pf, dec) + overhead

    say(f"{run.name}: reference with profile step times")
    ref_prof = _reference(run, lists, dict(sched, **{k: 0.0 for k in FORM_FIELDS}),
                          profile_step, opts, caching)
    clock["reference_profile"] = time.perf_counter() - t0
    fit = fit_iteration_form(kp, ref_prof["compositions"])
    coef = {k: fit[k] for k in FORM_FIELDS}
    coef["c0"] += overhead
    coef["moe_tokens"] = int(fit["moe_tokens"])
    prof = dict(sched, **coef)
    validate_replica(ReplicaProfile(name="fit", **prof))
    say(f"{run.name}: reference with the fitted form")
    t1 = time.perf_counter()
    ref_form = _reference(run, lists, prof, None, opts, caching)
    clock["reference_form"] = time.perf_counter() - t1
    # Residuals of the fit on the batches the fitted model itself produces.
    y = np.array([kp.step_time(p, d) for p, d in ref_form["compositions"]]) + overhead
    x = np.stack([composition_features(p, d, coef["moe_tokens"])
                  for p, d in ref_form["compositions"]])
    w = np.array([coef["c0"], coef["alpha"], coef["alpha2"], coef["beta"],
                  coef["alpha"] + coef["gamma"], coef["delta"], coef["moe"]])
    rel = (x @ w - y) / y
    fit_check = {"rms": float(np.sqrt(np.mean(rel ** 2))), "mean": float(rel.mean()),
                 "max_abs": float(np.abs(rel).max()), "n": int(len(rel))}

    # The engine's running slots: the cap never binds below the reference's peak, so a
    # narrower static width (power of two above it) gives identical results, faster.
    slots = min(sched["max_seqs"], _pow2_at_least(ref_form["peak_running"] + 1))
    say(f"{run.name}: JAX engine ({slots} running slots, {blocks} KV blocks)")
    t2 = time.perf_counter()
    replica = ReplicaProfile(name=run.name, **dict(prof, max_seqs=slots,
                                                    queue_cap=min(n, 65536)))
    pt = prefix_trace_of(run, arrivals=opts.arrivals)
    if opts.reserve_full_prompt or opts.dp_lockstep or not opts.engine:
        jax_out = None  # the engine has no such option; the reference stands in (documented)
    else:
        jax_out = replay_prefix([replica] * run.data_parallel, pt,
                                None if run.data_parallel > 1 else np.zeros(n, np.int64),
                                router=vllm_dp_engine if run.data_parallel > 1 else None,
                                caching=caching, queue_buffer=n)
    clock["jax_engine"] = time.perf_counter() - t2
    arr = ref_form["arrival"]
    sims = {}
    if jax_out is not None:
        sims["jaxserve"] = _metrics(arr, jax_out["first_token"], jax_out["finish"],
                                    run.output_tokens)
        diff = max(np.nanmax(np.abs(jax_out["first_token"] - ref_form["first_token"])),
                   np.nanmax(np.abs(jax_out["finish"] - ref_form["finish"])))
    else:
        sims["jaxserve"] = _metrics(arr, ref_form["first_token"], ref_form["finish"],
                                    run.output_tokens)
        diff = float("nan")
    sims["ref_profile"] = _metrics(arr, ref_prof["first_token"], ref_prof["finish"],
                                   run.output_tokens)
    if run.other_sim is not None:
        sims["llmservingsim"] = run.other_sim
    rows = error_rows(real, sims)
    per_request = {"request": np.arange(n), "prompt_tokens": run.prompt_tokens,
                   "output_tokens": run.output_tokens}
    for k in METRICS:
        per_request[f"real_{k}"] = real[k]
        for name, v in sims.items():
            per_request[f"{name}_{k}"] = np.asarray(v[k], float)
    per_request["jaxserve_preemptions"] = (jax_out or ref_form)["preemptions"]
    clock["total"] = time.perf_counter() - t0
    return FidelityResult(
        run=run.name, options=asdict(opts),
        replica={k: (float(v) if isinstance(v, float) else v) for k, v in prof.items()},
        kv_blocks_source=source, kv_blocks_derived=f"{derived} ({how})",
        profile_dir=str(kp.name), fit={k: v for k, v in fit.items()}, fit_check=fit_check,
        rows=rows, summary_check=_summary_check(run, real),
        engine_vs_reference_max_diff_s=float(diff), per_request=per_request,
        series_real=run.timeseries, series_sim=ref_form["series"], seconds=clock, slots=slots,
        profile_skew=has_skew, ep=ep, data_parallel=run.data_parallel)


# --------------------------------------------------------------------------- reports

def _fmt(v: float, digits: int = 1) -> str:
    return "n/a" if v is None or not np.isfinite(v) else f"{v:,.{digits}f}"


def table_markdown(result: FidelityResult) -> str:
    """The error table as Markdown: real, jaxserve, the profile-exact reference and
    LLMServingSim (where present), values in ms and signed errors in %."""
    sims = [s for s in ("jaxserve", "ref_profile", "llmservingsim")
            if f"{s}_ms" in result.rows[0]]
    label = {"jaxserve": "jaxserve", "ref_profile": "profile steps (ref.)",
             "llmservingsim": "LLMServingSim"}
    head = "| metric | real (ms) | " + " | ".join(f"{label[s]} (ms) | err %" for s in sims) + " |"
    sep = "|" + "---|" * (2 + 2 * len(sims))
    lines = [head, sep]
    for r in result.rows:
        cells = [f"{r['metric'].upper()} {r['stat']}", _fmt(r["real_ms"])]
        for s in sims:
            cells += [_fmt(r[f"{s}_ms"]), f"{r[f'{s}_err_pct']:+.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_report(result: FidelityResult, out_dir) -> list[Path]:
    """Writes `per_request.csv`, `summary.json`, `table.md`, `cdf.png` and `timeseries.png`
    into `out_dir` (created); returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    pr = result.per_request
    p = out / "per_request.csv"
    with open(p, "w", newline="") as f:
        w = csv.writer(f)
        keys = list(pr)
        w.writerow(keys)
        for i in range(len(pr["request"])):
            w.writerow([pr[k][i] for k in keys])
    paths.append(p)
    p = out / "summary.json"
    d = result.to_json()
    d.pop("per_request")
    p.write_text(json.dumps(d, indent=1, default=float))
    paths.append(p)
    p = out / "table.md"
    p.write_text(table_markdown(result) + "\n")
    paths.append(p)

    fig = Figure(figsize=(13, 3.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    names = [("real", "real vLLM", "k"), ("jaxserve", "jaxserve", "C0"),
             ("llmservingsim", "LLMServingSim", "C1")]
    for ax, m in zip(axes, METRICS):
        for key, lab, col in names:
            col_key = f"{key}_{m}"
            if col_key not in pr:
                continue
            v = np.sort(np.asarray(pr[col_key], float))
            v = v[np.isfinite(v)]
            ax.plot(v * (1e3 if m == "tpot" else 1.0), np.linspace(0, 1, len(v)), label=lab,
                    color=col, lw=1.4 if key == "real" else 1.1)
        ax.set_xlabel(f"{m.upper()} ({'ms' if m == 'tpot' else 's'})")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    paths.append(_finish(fig, axes, f"{result.run}: per-request CDFs", out / "cdf.png"))

    fig = Figure(figsize=(13, 3.4))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    sim, real = result.series_sim, result.series_real
    for ax, k, lab in zip(axes, ("running", "waiting", "kv_cache_pct"),
                          ("running", "waiting", "KV cache used (%)")):
        if real is not None and k in real and not (k == "kv_cache_pct"
                                                   and np.nanmax(real[k]) <= 0):
            ax.plot(real["t"], real[k], color="k", label="real vLLM", lw=1.2)
        ax.plot(sim["t"], sim[k], color="C0", label="jaxserve", lw=1.1)
        ax.set_xlabel("time (s)")
        ax.set_ylabel(lab)
        ax.grid(alpha=0.3)
    paths.append(_finish(fig, axes, f"{result.run}: engine state at 1-s ticks",
                         out / "timeseries.png"))
    return paths


def _finish(fig, axes, title: str, path: Path) -> Path:
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
