"""The BLIS set: 16 real vLLM runs on H100, BLIS's predictions of
them, and jaxserve's, side by side.

Data: `$JAXSERVE_FIDELITY_DIR/blis_anchor/` (default `<repo root>/../shared/fidelity`; its
README gives provenance and formats): `h30_h32/h30_real_vs_blis_16exp.csv` (per run: split,
model, TP, workload spec, real / BLIS-blackbox / BLIS-crossmodel mean TTFT and E2E in ms and
completed req/s), `h30_h32/per_model_blackbox_iter2.csv` (BLIS's per-model coefficients, us),
`trained_physics/model_configs/*/config.json` (HF configs) and `trainval15/` (KV blocks
vLLM reported for 7 more (model, TP) pairs: the check of the KV derivation).

**Step time.** BLIS's blackbox model (`sim/latency/latency.go`,
`BlackboxLatencyModel.StepTime`, inference-sim @ `b05154c4992db35b5e89d946b26d8d7dc6748b5b`,
the commit of the H30 runs) is `beta0 + beta1 * P + beta2 * D` us, `P` the prefill tokens
computed in the step (prefix-cache misses: `NumNewTokens` of the prefilling requests) and `D`
the decoding requests (one token each). Ours (`core.replica.iteration_time`) is `c0 + alpha *
tokens + alpha2 * prefill_attention + beta * [D > 0] + gamma * D + delta * decode_context`
with `tokens = P + D` (a decode computes one token). So `c0 = beta0`, `beta = 0`, `alpha =
beta1`, `gamma = beta2 - beta1` (a decode token already pays `alpha`), `alpha2 = delta = 0`
gives `c0 + beta1 (P + D) + (beta2 - beta1) D = beta0 + beta1 P + beta2 D` exactly
(the direct mapping "`c0 + beta = beta0, alpha = beta1, gamma = beta2`" counts a decode token's
`alpha` twice; `gamma >= -alpha` holds as `beta2 >= 0`). BLIS truncates a step to whole us;
we do not.

**Overheads** (same file and commit; `sim/event.go`, `sim/simulator.go`): BLIS delays each
arrival by `QueueingTime = alpha0 + alpha1 * input_len` before it enters the queue
(`ArrivalEvent.Execute`), and adds `OutputTokenProcessingTime = alpha2` to the first token
(`FirstTokenTime = now + step + alpha2 - ArrivalTime`) and to every inter-token entry
(`executeBatchStep`; `processCompletions` appends one more entry, `step + alpha2`, at the
completing step); E2E is `FirstTokenTime + sum(ITL)` (`recordRequestCompletion`). With `N`
output tokens BLIS therefore adds `alpha0 + alpha1 L + alpha2` to TTFT and
`alpha0 + alpha1 L + (N + 1) alpha2` to E2E; we add exactly that to our per-request times
after the replay. That is exact, not an approximation, here: every prompt of a run has the
same length `L`, so the pre-queue delay shifts all arrivals by one constant and leaves the
engine's schedule unchanged. Not reproduced: the completing step's duration, which BLIS's
E2E counts twice (the last decode step's ITL entry plus the completion entry; one step, 6-25
ms, of a 2-5 s E2E).

**KV blocks** (16-token blocks): the public values (README: Llama-2-7B TP1 7463, CodeLlama-34B
TP2 26602); else DERIVED with `core.replica.kv_blocks_for` from the HF config: `(80 GiB *
0.9 - weights / TP - 2 GB activations)` over one block's bytes (`2 * layers * (kv_heads *
head_dim / TP) * 2 bytes * 16`), 16-bit weights. The card's memory is `hardware_config.json`'s
80 GiB (85.9e9 bytes; `kv_blocks_for` divides decimal GB). `kv_check_rows` compares the rule
with the 9 values vLLM reported (the two above and 7 of `trainval15/`). Llama-2-70B has no
config in the folder: Llama-3.1-70B-Instruct's (the same 80 layers, 8192 hidden, 64 heads, 8
KV heads, 28672 FFN) with Llama-2's vocabulary of 32000.

**Scheduler**: vLLM v1 (0.15.1): `max_num_seqs = 128`, `max_num_batched_tokens = 2048`,
chunked prefill, prefix caching, block 16, no admission watermark (`watermark = 0`), an
unbounded waiting queue (`queue_cap` = the replay's requests: nothing is dropped).

**Workload**: `traces.inference_perf.shared_prefix_trace` (the generator's semantics, read
from its source, are in that module). Arrivals two ways: `even` (exactly `1/rate` apart in
each stage, the literal reading of the "constant" load type) and `poisson` (a Poisson process
of the stage's rate, as BLIS regenerates arrivals; inference-perf's own "constant" timer is a
Poisson process conditioned on its count, statistically the same). Prompts cycle as
inference-perf cycles them (whole prompts repeat); BLIS instead drew a fresh question per
request, at the stages' mean rate (the `blis` mode, not in the default table).

**What is replayed** (a full replay of the set does not fit 2 CPU cores in minutes: the
whole 1200-s llama-2-7b `general` run alone took 129 s, its sample 17 s; the timings are in
`main`'s docstring): a run under moderate load as each stage's first `window_requests`
(1024) requests, replayed from an empty replica (the real harness also starts each stage on
a drained server: it waits for the previous stage's last request, then 1 s); the stage's mean
is estimated from a steady sample of the window (`_stage_estimate`): the first stage counts
its head (cold-cache cycle and ramp-up, as in the real run) as replayed and its other
requests at the sample's mean, a later stage (warm cache in the real run) all its requests
at the sample's mean; the run's mean weights its stages by their requests. Measured against
whole-run replays (even arrivals; window / whole): llama-2-7b general TTFT 29.72 / 29.69 ms,
E2E 3334 / 3328 ms; llama-2-7b roleplay 20.77 / 20.77 ms, 1911.1 / 1911.0 ms; mixtral-8x7b
general 44.74 / 44.74 ms, 4748.0 / 4747.2 ms. With Poisson arrivals a window is one
sample of a random process: codellama-34b codegen 37.12 / 37.19 ms, 3672 / 3664 ms, but
llama-2-7b general (its 20-req/s stage is KV-bound, where E2E is most sensitive to load)
31.27 / 30.17 ms, 3597 / 3422 ms (+5 %, seed 0). An overloaded run (the `reasoning` profile: one
1200-s stage at 4 req/s) is not stationary (its queue grows), so it is replayed as a prefix:
the requests arriving in its first `overload_s` seconds (default 600), from an empty replica
until all of them finished; its means are over those requests (the real means are over the
whole run's completed requests: in three of the four real runs 33-85 % failed or timed out,
which no simulator here models). Throughput is the requests over `the stages' durations (the
prefix's length) + the drains + 1 s per stage change`, a drain being the time from a stage's
last arrival to its last finish (the harness waits for it; its 1-s polling is not
modelled); for an overloaded prefix that is the replica's service rate.

**Engine block**: the replay's prefix cache costs time linear in its blocks (thousands of
16-token blocks per GPU here), so it runs at `engine_block` = `16 * 2^k` tokens, the smallest
with at most `max_pool_blocks` (2048) blocks, keeping the KV cache's tokens (`floor(blocks *
16 / engine_block)` blocks): 64 tokens for Llama-2-7B, 256 for the others. Identity is then
over full engine blocks, so a repeated prompt recomputes up to one engine block instead of
one 16-token block, and partial-block waste grows. Measured with `engine_block_check` (16
against the engine block, even arrivals, plain means): llama-2-7b general, first 256
requests at 8 req/s: TTFT +0.7 %, E2E +0.07 %; its 20-req/s stage (KV-bound: evictions),
first 512 requests: TTFT -0.2 %, E2E +0.3 %; codellama-34b roleplay (750-token prompts, the
largest recompute), first 256 requests, 256-token blocks: TTFT +1.9 %, E2E +0.3 %.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from jaxserve.compile_cache import enable_compilation_cache
from jaxserve.core.replica import ReplicaProfile, kv_blocks_for, validate_replica
from jaxserve.core.types import Trace
from jaxserve.evaluation.replay import replay_prefix
from jaxserve.traces.inference_perf import SharedPrefixSpec, shared_prefix_trace
from jaxserve.traces.prefix import PrefixTrace, PrefixTree, prefix_window

__all__ = ["FIDELITY_ENV", "fidelity_dir", "BlisCoefficients", "BlisExperiment",
           "load_coefficients", "load_experiments", "model_config", "model_params",
           "derived_kv_blocks", "kv_blocks", "kv_check_rows", "blis_replica", "engine_block",
           "blis_overheads", "replay_trace", "replay_experiment", "blis_rows",
           "blis_markdown", "engine_block_check", "main"]

FIDELITY_ENV = "JAXSERVE_FIDELITY_DIR"
US = 1e-6
H100_GIB = 80.0  # trained_physics/hardware_config.json, "MemoryGiB"
GPU_MEM_UTIL = 0.9
BLOCK = 16
SCHED = dict(max_seqs=128, max_tokens=2048, chunked_prefill=True, watermark=0.0)
TREE_DEPTH = 64  # tables' depth padded to this (1034-token prompts / 16): one compiled program
STAGE_RESTART_S = 1.0  # inference-perf's run_stage: the timer starts 1 s after the call

# model_short -> (folder under trained_physics/model_configs, overrides of its config)
MODEL_CONFIGS = {
    "llama-2-7b": ("llama-2-7b-hf", {}),
    "llama-2-70b": ("llama-3.1-70b-instruct", {"vocab_size": 32000}),
    "mixtral-8x7b": ("mixtral-8x7b-v0.1", {}),
    "codellama-34b": ("codellama-34b-instruct-hf", {}),
}
# trainval15 model ids -> config folders, for the KV check
TRAINVAL_CONFIGS = {
    "meta-llama/Llama-2-7b-hf": "llama-2-7b-hf",
    "meta-llama/Llama-3.1-70B-Instruct": "llama-3.1-70b-instruct",
    "mistralai/Mistral-Nemo-Instruct-2407": "mistral-nemo-instruct-2407",
    "Qwen/Qwen2.5-7B-Instruct": "qwen2.5-7b-instruct",
    "01-ai/Yi-34B": "yi-34b",
}


def fidelity_dir() -> Path:
    """The fidelity data folder: `$JAXSERVE_FIDELITY_DIR`, else `<repo root>/../shared/fidelity`
    (relative to this file). Raises FileNotFoundError naming the variable when it is missing."""
    env = os.environ.get(FIDELITY_ENV)
    path = Path(env) if env else Path(__file__).resolve().parents[2] / ".." / "shared" / "fidelity"
    if not path.is_dir():
        raise FileNotFoundError(f"fidelity data folder not found: {path} (set {FIDELITY_ENV} "
                                f"to the folder holding blis_anchor/)")
    return path


def _blis_root(root: Path | str | None) -> Path:
    return Path(root) if root is not None else fidelity_dir() / "blis_anchor"


@dataclasses.dataclass(frozen=True)
class BlisCoefficients:
    """BLIS's blackbox coefficients for one model (all in us): step time `beta0 + beta1 *
    prefill tokens + beta2 * decode tokens`; pre-queue delay `alpha0 + alpha1 * input
    tokens`; `alpha2` per output token."""

    beta0: float
    beta1: float
    beta2: float
    alpha0: float
    alpha1: float
    alpha2: float

    def step_us(self, prefill_tokens, decode_tokens):
        """BLIS's step time (us, not truncated) of a step with these token counts."""
        return self.beta0 + self.beta1 * prefill_tokens + self.beta2 * decode_tokens


@dataclasses.dataclass(frozen=True)
class BlisExperiment:
    """One of the 16 runs. `real`, `blackbox`, `crossmodel`: dicts `ttft_ms`, `e2e_ms`, `rps`
    (NaN where BLIS timed out). `kv_public`: 16-token GPU KV blocks if public, else None."""

    split: str
    model: str
    profile: str
    tp: int
    kv_public: int | None
    spec: SharedPrefixSpec
    real: dict
    blackbox: dict
    crossmodel: dict

    @property
    def name(self) -> str:
        return f"{self.model} {self.profile}"

    @property
    def overloaded(self) -> bool:
        """The 4-req/s reasoning runs that overloaded the real server (README)."""
        return self.profile == "reasoning"

    @property
    def num_requests(self) -> int:
        """Requests inference-perf sends: `sum int(rate * duration)` over the stages."""
        return int(sum(int(r * d) for r, d in self.spec.stages))


def load_coefficients(root: Path | str | None = None) -> dict[str, BlisCoefficients]:
    """`per_model_blackbox_iter2.csv`: model_short -> `BlisCoefficients` (us)."""
    path = _blis_root(root) / "h30_h32" / "per_model_blackbox_iter2.csv"
    out = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            out[r["model_short"]] = BlisCoefficients(
                beta0=float(r["beta0_us_per_step"]), beta1=float(r["beta1_us_per_prefill_token"]),
                beta2=float(r["beta2_us_per_decode_token"]),
                alpha0=float(r["alpha0_us_per_request"]),
                alpha1=float(r["alpha1_us_per_input_token"]),
                alpha2=float(r["alpha2_us_per_output_token"]))
    return out


def _num(s: str) -> float:
    try:
        return float(s)
    except ValueError:  # "timeout", "—"
        return float("nan")


def load_experiments(root: Path | str | None = None) -> list[BlisExperiment]:
    """The 16 runs of `h30_real_vs_blis_16exp.csv`, in file order."""
    path = _blis_root(root) / "h30_h32" / "h30_real_vs_blis_16exp.csv"
    out = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            rates = [float(x) for x in r["stages_rate_rps"].split(";")]
            durs = [float(x) for x in r["stages_duration_s"].split(";")]
            spec = SharedPrefixSpec(
                num_unique_system_prompts=int(r["num_unique_system_prompts"]),
                num_users_per_system_prompt=int(r["num_users_per_system_prompt"]),
                system_prompt_len=int(r["system_prompt_len"]),
                question_len=int(r["question_len"]), output_len=int(r["output_len"]),
                stages=tuple(zip(rates, durs)))
            spec.validate()
            kv = r["total_kv_blocks_gpu_if_public"].strip()

            def trio(prefix):
                return {"ttft_ms": _num(r[f"{prefix}_ttft_mean_ms"]),
                        "e2e_ms": _num(r[f"{prefix}_e2e_mean_ms"]), "rps": _num(r[f"{prefix}_rps"])}

            out.append(BlisExperiment(
                split=r["split"], model=r["model_short"], profile=r["profile"], tp=int(r["tp"]),
                kv_public=int(kv) if kv else None, spec=spec, real=trio("real"),
                blackbox=trio("blis_blackbox"), crossmodel=trio("blis_crossmodel")))
    return out


# ------------------------------------------------------------------ KV blocks

def model_config(folder: str, root: Path | str | None = None, **overrides) -> dict:
    """An HF `config.json` of `trained_physics/model_configs/<folder>/`, with overrides."""
    path = _blis_root(root) / "trained_physics" / "model_configs" / folder / "config.json"
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(overrides)
    return cfg


def _head_dim(cfg: dict) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def model_params(cfg: dict) -> int:
    """Parameters of a dense or MoE decoder from its HF config: embeddings (and an untied LM
    head), per layer q/k/v/o projections (+ q/k/v biases for Qwen2, q/k norms for Qwen3), the
    gated FFN (`3 * hidden * intermediate`, times `num_local_experts` plus a router for MoE)
    and two norms, and the final norm."""
    h, v = int(cfg["hidden_size"]), int(cfg["vocab_size"])
    nh, nkv = int(cfg["num_attention_heads"]), int(cfg.get("num_key_value_heads") or
                                                   cfg["num_attention_heads"])
    hd, ff, layers = _head_dim(cfg), int(cfg["intermediate_size"]), int(cfg["num_hidden_layers"])
    attn = h * nh * hd + 2 * h * nkv * hd + nh * hd * h
    if cfg.get("model_type") == "qwen2":
        attn += nh * hd + 2 * nkv * hd
    if cfg.get("model_type") == "qwen3":
        attn += 2 * hd
    experts = int(cfg.get("num_local_experts") or 0)
    ffn = 3 * h * ff * experts + h * experts if experts else 3 * h * ff
    embed = v * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return embed + layers * (attn + ffn + 2 * h) + h


def derived_kv_blocks(cfg: dict, tp: int, *, gpu_mem_gib: float = H100_GIB,
                      mem_util: float = GPU_MEM_UTIL, activation_gb: float = 2.0,
                      block_size: int = BLOCK) -> int:
    """16-token KV blocks per GPU by vLLM's rule (`core.replica.kv_blocks_for`): 16-bit
    weights and KV split over `tp` GPUs (KV heads divided by `tp`, at least one)."""
    kv_heads = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    kv_hidden = max(kv_heads // tp, 1) * _head_dim(cfg)
    weight_gb = model_params(cfg) * 2 / tp / 1e9
    return kv_blocks_for(int(cfg["num_hidden_layers"]), kv_hidden, gpu_mem_gib * 2 ** 30 / 1e9,
                         weight_gb, mem_util=mem_util, activation_gb=activation_gb,
                         block_size=block_size)


def kv_blocks(exp: BlisExperiment, root: Path | str | None = None) -> tuple[int, str]:
    """`(16-token KV blocks, "public" | "derived")` of a run's replica."""
    if exp.kv_public is not None:
        return exp.kv_public, "public"
    folder, over = MODEL_CONFIGS[exp.model]
    return derived_kv_blocks(model_config(folder, root, **over), exp.tp), "derived"


def kv_check_rows(root: Path | str | None = None) -> list[dict]:
    """The derivation rule against every KV size vLLM reported in the folder: the H30 public
    values and `trainval15/`'s `total_kv_blocks_gpu` (H100; rows of one (model, TP) with
    different `max_num_batched_tokens` kept apart). Rows: model, tp, mbt, measured, derived,
    error_pct."""
    base = _blis_root(root)
    seen, rows = set(), []
    for exp in load_experiments(root):
        folder, over = MODEL_CONFIGS[exp.model]
        key = (folder, exp.tp, 2048)
        if exp.kv_public is not None and key not in seen:
            seen.add(key)
            rows.append((exp.model, exp.tp, 2048, exp.kv_public,
                         derived_kv_blocks(model_config(folder, root, **over), exp.tp)))
    with open(base / "trainval15" / "trainval15_experiments.csv", newline="") as f:
        for r in csv.DictReader(f):
            folder = TRAINVAL_CONFIGS.get(r["model"])
            key = (folder, int(r["tp"]), int(r["max_num_batched_tokens"]))
            if folder is None or r["hardware"] != "H100" or key in seen:
                continue
            seen.add(key)
            rows.append((r["model"], key[1], key[2], int(r["total_kv_blocks_gpu"]),
                         derived_kv_blocks(model_config(folder, root), key[1])))
    return [{"model": m, "tp": tp, "mbt": mbt, "measured": meas, "derived": der,
             "error_pct": 100.0 * (der - meas) / meas} for m, tp, mbt, meas, der in rows]


# ------------------------------------------------------------------ the replica

def blis_replica(coef: BlisCoefficients, kv: int, *, block_size: int = BLOCK,
                 queue_cap: int = 64, name: str = "blis") -> ReplicaProfile:
    """BLIS's step-time model as a `ReplicaProfile` (seconds): `c0 = beta0`, `beta = 0`,
    `alpha = beta1`, `gamma = beta2 - beta1`, `alpha2 = delta = 0` (module docstring), with
    `kv` blocks of `block_size` tokens and vLLM v1's scheduler settings (`SCHED`)."""
    prof = ReplicaProfile(c0=coef.beta0 * US, alpha=coef.beta1 * US, alpha2=0.0, beta=0.0,
                          gamma=(coef.beta2 - coef.beta1) * US, delta=0.0, kv_blocks=int(kv),
                          block_size=int(block_size), queue_cap=int(queue_cap), name=name,
                          **SCHED)
    validate_replica(prof, where=f"blis_replica({name!r})")
    return prof


def engine_block(kv16: int, max_pool_blocks: int) -> int:
    """The smallest `16 * 2^k` tokens with `floor(kv16 * 16 / block) <= max_pool_blocks`."""
    b = BLOCK
    while kv16 * BLOCK // b > max_pool_blocks:
        b *= 2
    return b


def blis_overheads(coef: BlisCoefficients, prompt_tokens, output_tokens) -> tuple:
    """BLIS's per-request overheads (s) added to `(TTFT, E2E)`: `alpha0 + alpha1 L + alpha2`
    and `alpha0 + alpha1 L + (N + 1) alpha2` (module docstring)."""
    L = np.asarray(prompt_tokens, np.float64)
    N = np.asarray(output_tokens, np.float64)
    pre = (coef.alpha0 + coef.alpha1 * L) * US
    return pre + coef.alpha2 * US, pre + (N + 1) * coef.alpha2 * US


# ------------------------------------------------------------------ replays

def _bucket(x: int, lo: int) -> int:
    return max(lo, 1 << max(int(x) - 1, 0).bit_length())


def _pad(pt: PrefixTrace, n: int) -> PrefixTrace:
    """`pt` with requests appended up to `n`: 1 prompt and 1 output token each, no prefix,
    arriving 1e5 s after its last request (after everything drained), so that replays of
    different lengths share one compiled program; their results are dropped."""
    k = n - len(pt)
    if k <= 0:
        return pt
    tr = pt.trace
    last = float(tr.arrival_s[-1])
    trace = Trace(arrival_s=np.concatenate([tr.arrival_s, last + 1e5 + np.arange(k) * 1e-3]),
                  prompt_tokens=np.concatenate([tr.prompt_tokens, np.ones(k, np.int64)]),
                  output_tokens=np.concatenate([tr.output_tokens, np.ones(k, np.int64)]))
    return PrefixTrace(trace=trace, node=np.concatenate([pt.node, np.full(k, -1, np.int64)]),
                       full_blocks=np.concatenate([pt.full_blocks, np.zeros(k, np.int64)]),
                       tree=pt.tree)


def replay_trace(prof: ReplicaProfile, pt: PrefixTrace, coef: BlisCoefficients, *,
                 pad_to: int | None = None, prefix_blocks: int | None = None) -> dict:
    """Replays `pt` on one replica (every action 0) and returns per-request `arrival`,
    `ttft`, `e2e` (s, BLIS's overheads added), `dropped`, plus the replay's `evictions`,
    `preemptions`, `hit_tokens`, `lookup_tokens`. `pad_to` pads the trace (`_pad`) and
    the prefix tree's tables to powers of two so that replays share compiled programs."""
    n = len(pt)
    run = _pad(pt, pad_to) if pad_to else pt
    tree: PrefixTree = pt.tree
    nodes = _bucket(tree.num_nodes, 1024)
    depth = _bucket(int(tree.depth.max()) if tree.num_nodes else 1, TREE_DEPTH)
    prof = prof.replace(queue_cap=len(run))
    out = replay_prefix([prof], run, np.zeros(len(run), np.int64), queue_buffer=len(run),
                        prefix_blocks=prefix_blocks, tree_nodes=nodes, tree_depth=depth)
    arrival = out["arrival"][:n]
    d_ttft, d_e2e = blis_overheads(coef, pt.trace.prompt_tokens, pt.trace.output_tokens)
    return {"arrival": arrival, "ttft": out["first_token"][:n] - arrival + d_ttft,
            "e2e": out["finish"][:n] - arrival + d_e2e, "dropped": out["dropped"][:n],
            "evictions": int(out["evictions"][0]),
            "preemptions": int(out["replica_preemptions"][0]),
            "hit_tokens": int(out["hit_tokens"][0]),
            "lookup_tokens": int(out["lookup_tokens"][0])}


def replay_experiment(exp: BlisExperiment, coef: BlisCoefficients, arrivals: str = "even", *,
                      seed: int = 0, window_requests: int | None = 1024,
                      overload_s: float | None = 600.0, max_pool_blocks: int = 2048,
                      root: Path | str | None = None) -> dict:
    """jaxserve's estimate of one run (module docstring, "What is replayed").

    Args:
      exp, coef: the run and its model's coefficients.
      arrivals: `"even"`, `"poisson"` or `"constant"` (`shared_prefix_trace`), or `"blis"`
        (BLIS's regeneration: Poisson at the mean rate, a fresh question per request).
      seed: seeds stage `k`'s workload with `seed + k`.
      window_requests: requests replayed per stage of a moderate run (None: whole stages).
      overload_s: an overloaded run replays the requests arriving in its first `overload_s`
        seconds, from an empty replica to the drain of all of them (None: the whole run).
      max_pool_blocks: most KV blocks the replay's prefix cache holds (sets `engine_block`).

    Returns:
      dict: `ttft_ms`, `e2e_ms` (means), `rps`, `replayed` (requests replayed), `requests`
      (the run's), `window` (bool: a sample of each stage), `window_requests`,
      `overload_s` (the prefix replayed of an overloaded run, None if whole), `engine_block`,
      `kv_blocks`,
      `kv_source`, `evictions`, `preemptions`, `dropped`, `hit_rate` (cached / prompt tokens
      over admissions), `seconds` (wall time of the replays).
    """
    t_start = time.perf_counter()
    kv16, kv_src = kv_blocks(exp, root)
    b = engine_block(kv16, max_pool_blocks)
    # one name for every run: `name` is static, a new one compiles the replay anew
    prof = blis_replica(coef, kv16 * BLOCK // b, block_size=b)
    spec = exp.spec
    blis_mode = arrivals == "blis"
    stages = ((spec.mean_rate, spec.duration_s),) if blis_mode else spec.stages
    whole = exp.overloaded or window_requests is None
    cut = float(overload_s) if exp.overloaded and overload_s else None
    cycle = spec.num_prompts
    ttft_sum = e2e_sum = 0.0
    total = replayed = evict = preempt = dropped = hits = looked = 0
    wall = 0.0
    for k, (rate, dur) in enumerate(stages):
        full_n = int(rate * dur)
        st = dataclasses.replace(spec, stages=((rate, dur),))
        if cut is not None and k > 0 and sum(d for _, d in stages[:k]) >= cut:
            break
        until = None if cut is None else cut - sum(d for _, d in stages[:k])
        pt = shared_prefix_trace(st, "poisson" if blis_mode else arrivals, seed + k,
                                 blis_workload=blis_mode, block_tokens=b, until_s=until)
        if until is not None:
            dur = min(float(dur), until)
        part = pt if whole or len(pt) <= window_requests else prefix_window(
            pt, 0, int(window_requests))
        pad = -(-len(part) // 1024) * 1024 if whole else _bucket(len(part), 64)
        r = replay_trace(prof, part, coef, pad_to=pad, prefix_blocks=_bucket(prof.kv_blocks, 64))
        ttft, e2e, a = r["ttft"], r["e2e"], r["arrival"]
        ok = ~r["dropped"]
        if part is pt:  # the whole stage: its own mean
            ttft_sum += float(ttft[ok].sum())
            e2e_sum += float(e2e[ok].sum())
            total += int(ok.sum())
        else:
            s_ttft, s_e2e, n_head = _stage_estimate(a, ttft, e2e, cycle, first=k == 0)
            ttft_sum += s_ttft[0] + (full_n - n_head) * s_ttft[1]
            e2e_sum += s_e2e[0] + (full_n - n_head) * s_e2e[1]
            total += full_n
        drain = float(np.nanmax(a + e2e) - a.max())
        wall += float(dur) + drain + (STAGE_RESTART_S if k else 0.0)
        replayed += len(part)
        evict += r["evictions"]
        preempt += r["preemptions"]
        dropped += int(r["dropped"].sum())
        hits += r["hit_tokens"]
        looked += r["lookup_tokens"]
    return {"ttft_ms": 1e3 * ttft_sum / total, "e2e_ms": 1e3 * e2e_sum / total,
            "rps": total / wall, "replayed": replayed, "requests": total,
            "window": not whole, "window_requests": None if whole else int(window_requests),
            "overload_s": cut,
            "engine_block": b, "kv_blocks": kv16, "kv_source": kv_src,
            "evictions": evict, "preemptions": preempt, "dropped": dropped,
            "hit_rate": hits / looked if looked else float("nan"),
            "seconds": time.perf_counter() - t_start}


WARMUP_E2E = 5.0  # the steady sample starts this many longest-E2Es into a window


def _stage_estimate(a, ttft, e2e, cycle: int, first: bool):
    """A stage's totals from a replayed window of its first requests (arrivals `a`).

    With `T` the window's longest E2E, the steady sample is the requests after the first
    `cycle` arriving in `[a[0] + WARMUP_E2E * T, a[-1] - T]`: away from the empty start (the
    batch and, under KV pressure, the pool of cached blocks settle within about 5 E2Es:
    llama-2-7b at 20 req/s, E2E in 5-s bins from an empty replica 3134, 3694, 3812, 3844,
    3853, 3856 ms, then 3857 ms to the stage's end) and from the drain at the window's end;
    chosen by arrival time, not by outcome. Fewer than 64 such requests: the second half of
    the window, less the last `T`, or failing that every request after the first cycle.
    The first stage's head (the requests before the sample starts: the cold-cache cycle and
    the ramp-up, as in the real run) counts as replayed, the rest of the stage at the sample's
    mean; a later stage, whose real start has a warm cache, counts wholly at the sample's
    mean. Returns `((head sum, mean) for TTFT, the same for E2E, head count)`."""
    n = a.shape[0]
    idx = np.arange(n)
    t = float(np.max(e2e))
    after = idx >= min(cycle, n - 1)
    steady = after & (a >= a[0] + WARMUP_E2E * t) & (a <= a[-1] - t)
    if steady.sum() < 64:
        steady = after & (a >= 0.5 * (a[0] + a[-1])) & (a <= a[-1] - t)
    if steady.sum() < 64:
        steady = after
    start = int(np.argmax(steady))
    head = idx < start if first else np.zeros(n, bool)
    return ((float(ttft[head].sum()), float(ttft[steady].mean())),
            (float(e2e[head].sum()), float(e2e[steady].mean())), int(head.sum()))


# ------------------------------------------------------------------ the table

DEFAULT_ARRIVALS = ("even", "poisson")


def _err(x: float, real: float) -> float:
    return 100.0 * (x - real) / real if np.isfinite(x) and np.isfinite(real) and real else \
        float("nan")


def _task(args) -> tuple[str, str, dict]:
    """One `(run, mode)` replay (a process pool's unit of work; module level to pickle)."""
    name, mode, seed, window, overload_s, pool, root = args
    exp = next(e for e in load_experiments(root) if e.name == name)
    return name, mode, replay_experiment(exp, load_coefficients(root)[exp.model], mode,
                                         seed=seed, window_requests=window,
                                         overload_s=overload_s, max_pool_blocks=pool,
                                         root=root)


def _worker_init(cache: str | None) -> None:
    if cache:
        enable_compilation_cache(cache)


def blis_rows(arrivals=DEFAULT_ARRIVALS, *, seed: int = 0, window_requests: int | None = 1024,
              overload_s: float | None = 600.0, max_pool_blocks: int = 2048,
              root: Path | str | None = None,
              only: list[str] | None = None, jobs: int = 1, cache: str | None = None,
              verbose: bool = False) -> list[dict]:
    """One row per run: `split` (train / val / test), `group` ("moderate" or "overloaded"),
    `run`, `model`, `profile`, and for each metric `m` in `ttft_ms`, `e2e_ms`, `rps`:
    `real_m`, `blackbox_m`, `crossmodel_m`, `jaxserve_<mode>_m` per arrival mode, and
    `*_m_err` (signed % against real); per mode `jaxserve_<mode>_info` (the
    `replay_experiment` dict). `only`: run names (`"llama-2-7b general"`) to keep. `jobs > 1`
    spreads the `(run, mode)` replays over that many processes (spawned; `cache`: their XLA
    compilation cache folder); results do not depend on it."""
    exps = [e for e in load_experiments(root) if only is None or e.name in only]
    root_s = None if root is None else str(root)
    # Longest first (the overloaded runs), so that a pool ends together; within each, tasks
    # of different compiled programs (engine blocks) alternate, so that two workers compile
    # different programs first and load each other's from the persistent compilation cache
    # (when it is on) instead of compiling the same one twice.
    by_prog: dict = {}
    for e in exps:
        key = (not e.overloaded, engine_block(kv_blocks(e, root)[0], max_pool_blocks))
        by_prog.setdefault(key, []).extend(
            (e.name, mode, seed, window_requests, overload_s, max_pool_blocks, root_s)
            for mode in arrivals)
    tasks = []
    for moderate in (False, True):
        queues = [v for (m, _), v in sorted(by_prog.items()) if m == moderate]
        while any(queues):
            tasks += [q.pop(0) for q in queues if q]
    results = {}

    def report(name, mode, res):
        results[(name, mode)] = res
        if verbose:
            print(f"  {name:28s} {mode:8s} TTFT {res['ttft_ms']:9.1f} ms  E2E "
                  f"{res['e2e_ms']:9.1f} ms  {res['rps']:6.2f} req/s  "
                  f"({res['replayed']} replayed, {res['seconds']:.1f} s)", flush=True)

    if jobs > 1 and len(tasks) > 1:
        ctx = multiprocessing.get_context("spawn")  # JAX is not fork-safe
        with ProcessPoolExecutor(min(jobs, len(tasks)), mp_context=ctx,
                                 initializer=_worker_init, initargs=(cache,)) as pool:
            for name, mode, res in pool.map(_task, tasks):
                report(name, mode, res)
    else:
        for t in tasks:
            report(*_task(t))
    rows = []
    for exp in exps:
        row = {"split": exp.split, "group": "overloaded" if exp.overloaded else "moderate",
               "run": exp.name, "model": exp.model, "profile": exp.profile}
        for m in ("ttft_ms", "e2e_ms", "rps"):
            row[f"real_{m}"] = exp.real[m]
            for src, vals in (("blackbox", exp.blackbox), ("crossmodel", exp.crossmodel)):
                row[f"{src}_{m}"] = vals[m]
                row[f"{src}_{m}_err"] = _err(vals[m], exp.real[m])
        for mode in arrivals:
            res = results[(exp.name, mode)]
            row[f"jaxserve_{mode}_info"] = res
            for m in ("ttft_ms", "e2e_ms", "rps"):
                row[f"jaxserve_{mode}_{m}"] = res[m]
                row[f"jaxserve_{mode}_{m}_err"] = _err(res[m], exp.real[m])
        rows.append(row)
    return rows


def _fmt(x: float, metric: str = "") -> str:
    if not np.isfinite(x):
        return "—"
    if metric == "rps":
        return f"{x:.2f}"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def _pct(x: float) -> str:
    return "—" if not np.isfinite(x) else f"{x:+.0f}%" if abs(x) >= 100 else f"{x:+.1f}%"


def _modes(rows: list[dict]) -> list[str]:
    return [k[len("jaxserve_"):-len("_info")] for k in rows[0] if k.startswith("jaxserve_")
            and k.endswith("_info")] if rows else []


def blis_markdown(rows: list[dict]) -> str:
    """The rows as markdown: one table per metric (mean TTFT ms, mean E2E ms, completed
    req/s), runs grouped train / val / test with the overloaded runs apart; each cell a value
    and its signed % error against real; then a line on what was replayed and a summary of
    median |error| per group."""
    modes = _modes(rows)
    cols = ["blackbox", "crossmodel"] + [f"jaxserve_{m}" for m in modes]
    heads = ["BLIS blackbox", "BLIS crossmodel"] + [f"jaxserve ({m})" for m in modes]
    groups = [("train", "moderate"), ("val", "moderate"), ("test", "moderate"),
              ("val", "overloaded"), ("test", "overloaded")]
    out = []
    for metric, title in (("ttft_ms", "Mean TTFT (ms)"), ("e2e_ms", "Mean E2E (ms)"),
                          ("rps", "Throughput (completed req/s)")):
        out.append(f"**{title}**, value (signed error against real)\n")
        out.append("| split | run | real | " + " | ".join(heads) + " |")
        out.append("|---|---|---:|" + "---:|" * len(heads))
        for split, group in groups:
            for r in rows:
                if r["split"] != split or r["group"] != group:
                    continue
                label = split + (" (overloaded)" if group == "overloaded" else "")
                cells = [f"{_fmt(r[f'{c}_{metric}'], metric)} ({_pct(r[f'{c}_{metric}_err'])})"
                         for c in cols]
                out.append(f"| {label} | {r['run']} | {_fmt(r[f'real_{metric}'], metric)} | "
                           + " | ".join(cells) + " |")
        out.append("")
    out.append("Median |error| against real (%):\n")
    out.append("| group | metric | " + " | ".join(heads) + " |")
    out.append("|---|---|" + "---:|" * len(heads))
    for gname, pick in (("train + val, moderate", lambda r: r["group"] == "moderate"),
                        ("val (moderate)", lambda r: r["group"] == "moderate"
                         and r["split"] == "val"),
                        ("overloaded", lambda r: r["group"] == "overloaded")):
        sel = [r for r in rows if pick(r)]
        if not sel:
            continue
        for metric in ("ttft_ms", "e2e_ms", "rps"):
            cells = []
            for c in cols:
                e = np.array([abs(r[f"{c}_{metric}_err"]) for r in sel], np.float64)
                e = e[np.isfinite(e)]
                cells.append(f"{np.median(e):.1f}" if e.size else "—")
            out.append(f"| {gname} | {metric} | " + " | ".join(cells) + " |")
    out.append("")
    if modes:
        inf = [r[f"jaxserve_{modes[0]}_info"] for r in rows]
        windows = sorted({i["window_requests"] for i in inf if i["window"]})
        cuts = sorted({i["overload_s"] for i in inf if i["overload_s"] is not None})
        over = [r for r in rows if r["group"] == "overloaded"]
        blocks = sorted({(r["model"], i["engine_block"], i["kv_blocks"], i["kv_source"])
                         for r, i in zip(rows, inf)})
        what = (f"each stage's first {', '.join(map(str, windows))} requests, a sample of "
                f"the stage (its cold start weighted apart)" if windows
                else "whole")
        what_over = (f"the requests of the first {', '.join(f'{c:g}' for c in cuts)} s, "
                     f"drained" if cuts else "whole")
        out.append(
            f"jaxserve replays: moderate runs as {what}; overloaded runs ({len(over)}) as "
            f"{what_over}. Engine block and 16-token KV blocks per model: "
            + "; ".join(f"{m} {b} tokens, {kv} blocks ({src})" for m, b, kv, src in blocks)
            + ". BLIS's alpha overheads added to every request. "
            "Method: `jaxserve.evaluation.fidelity_blis` (module docstring).")
    return "\n".join(out)


def engine_block_check(run: str = "llama-2-7b general", *, requests: int = 256,
                       blocks=(16, 32, 64, 128), stage: int = 0,
                       root: Path | str | None = None) -> list[dict]:
    """What the engine block changes: the first `requests` requests of stage `stage` of `run`
    (even arrivals) replayed with the KV cache's tokens kept and identity at each block size
    in `blocks`. Rows: block, kv_blocks, ttft_ms, e2e_ms (plain means over the requests, BLIS
    overheads added), hit_rate, evictions, seconds."""
    exp = next(e for e in load_experiments(root) if e.name == run)
    coef = load_coefficients(root)[exp.model]
    kv16, _ = kv_blocks(exp, root)
    st = dataclasses.replace(exp.spec, stages=(exp.spec.stages[stage],))
    out = []
    for b in blocks:
        pt = prefix_window(shared_prefix_trace(st, "even", 0, block_tokens=b), 0, requests)
        prof = blis_replica(coef, kv16 * BLOCK // b, block_size=b)
        t = time.perf_counter()
        r = replay_trace(prof, pt, coef)
        out.append({"block": b, "kv_blocks": prof.kv_blocks,
                    "ttft_ms": 1e3 * float(r["ttft"].mean()),
                    "e2e_ms": 1e3 * float(r["e2e"].mean()),
                    "hit_rate": r["hit_tokens"] / max(r["lookup_tokens"], 1),
                    "evictions": r["evictions"], "seconds": time.perf_counter() - t})
    return out


def main(argv=None) -> None:
    """`python -m jaxserve.evaluation.fidelity_blis`: prints the KV check and the table.

    Runtime of the default set (2 arrival modes x 16 runs, 32 replays of 1024-2423 requests
    each in windows and prefixes, `--jobs 2`, an empty XLA cache), measured on the shared
    2-core CPU while other jobs held it at a load average of 2-10: 7 min 29 s wall, 7 min 25 s
    of user CPU (about 4 min on two idle cores, estimated from it); about 4 compiled programs of 40-90 s
    each, per worker, are a good part of it, which a warm XLA cache (a second run) saves.
    `--jobs 1` runs in one process; `--window 0 --overload-s 0` replays every run whole
    (the 1200-s llama-2-7b general run alone: 129 s).
    """
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arrivals", default=",".join(DEFAULT_ARRIVALS),
                    help="comma-separated arrival modes: even, poisson, constant, blis")
    ap.add_argument("--window", type=int, default=1024,
                    help="requests replayed per stage of a moderate run (0: whole stages)")
    ap.add_argument("--overload-s", type=float, default=600.0,
                    help="seconds of an overloaded run replayed (0: the whole run)")
    ap.add_argument("--max-pool-blocks", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                    help="processes replaying runs in parallel (default: 2 or the CPUs)")
    ap.add_argument("--only", default=None, help="comma-separated run names")
    ap.add_argument("--check-blocks", action="store_true",
                    help="also print engine_block_check (16-token blocks: slow)")
    args = ap.parse_args(argv)
    cache = enable_compilation_cache()
    t0 = time.perf_counter()
    print("KV blocks: vLLM's reported values against the derivation rule")
    print("| model | TP | mbt | measured | derived | error |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in kv_check_rows():
        print(f"| {r['model']} | {r['tp']} | {r['mbt']} | {r['measured']} | {r['derived']} | "
              f"{r['error_pct']:+.1f}% |")
    print()
    rows = blis_rows(tuple(a for a in args.arrivals.split(",") if a), seed=args.seed,
                     window_requests=args.window or None, overload_s=args.overload_s or None,
                     max_pool_blocks=args.max_pool_blocks,
                     only=args.only.split(",") if args.only else None, jobs=args.jobs,
                     cache=cache, verbose=True)
    print()
    print(blis_markdown(rows))
    if args.check_blocks:
        print("\nEngine block check (llama-2-7b general, first 256 requests, even arrivals):")
        for r in engine_block_check():
            print(r)
    print(f"\nwhole set: {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
