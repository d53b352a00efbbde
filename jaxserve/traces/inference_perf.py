"""inference-perf's `shared_prefix` data generator with its constant-rate stages, as a workload
(numpy, host side).

What it reproduces (source read: `kubernetes-sigs/inference-perf`; the real H100 runs of the
BLIS set were driven in February 2026, so the version read is
`4ad7d4b74c73ca31a2b5528503d7720f2c0d3fdf` (2026-02-14, the last commit before the first run,
2026-02-17), checked against the snapshot's head `7de5ef2ed6f7934e0ecbc8297e593f79e68430c0`
(2026-08-19)):

* **Prompts** (`inference_perf/datagen/shared_prefix_datagen.py`, `SharedPrefixDataGenerator.
  _generate_prompts`; at the head `datagen/synthetic/shared_prefix_datagen.py`): `G =
  num_unique_system_prompts` groups (`num_groups`), each with one random system prompt of
  `system_prompt_len` tokens, and `U = num_users_per_system_prompt` (`num_prompts_per_group`)
  random questions of `question_len` tokens per group: `G * U` prompts `system_g + question_gu`
  are built once, then put in a random order (`random.shuffle` at 4ad7d4b, unseeded;
  `rng.permutation` seeded at the head).
* **Cycling** (`load_lazy_data`: `i = data.data_index % len(self.prompts)`): the request with
  data index `j` sends prompt `order[j mod G*U]`, so **whole prompts repeat** every `G * U`
  requests, not only system prompts. `data_index` counts from 0 in each stage:
  `LoadGenerator.run_stage` (`inference_perf/loadgen/load_generator.py`) calls
  `self.datagen.get_data()` afresh per stage, so the cycle restarts at every stage.
* **Output**: `max_tokens = output_len` with `ignore_eos`, so every request emits exactly
  `output_len` tokens.
* **Arrivals**: a stage `(rate r, duration d)` sends `n = int(r * d)` requests
  (`run_stage`). The "constant" load type is `ConstantLoadTimer.start_timer`
  (`inference_perf/loadgen/load_timer.py`, unchanged from 2025-11 to the head): `n`
  exponential intervals of mean `1/r` **scaled so that they sum to `d`**, the `k`-th request
  at `t0 + sum of the first k intervals` (the last exactly at `t0 + d`). So the source does
  NOT send evenly spaced requests, although the load type is called "constant"; its arrivals
  are a Poisson process conditioned on `n` arrivals in the stage. Modes here:
  `"constant"` (that timer, seeded), `"even"` (exactly `d / n = 1/r` apart, the idealised
  reading of "constant rate"), `"poisson"` (a Poisson process of rate `r` in each stage, the
  count random; BLIS regenerates its workload this way, see below).
  The next stage starts only after every request of the previous one finished, plus 1 s
  (`run_stage`: `start_time = time.perf_counter() + 1`, then it waits for
  `finished_requests_counter`): a closed-loop gap an open trace cannot know in advance;
  `stage_gap_s` adds a fixed gap (default 0: stages back to back).

BLIS (`inference-sim/inference-sim` @ `b05154c4992db35b5e89d946b26d8d7dc6748b5b`,
`sim/workload/inference_perf.go`, `ExpandInferencePerfSpec`, and `sim/workload/generator.go`,
`GenerateRequests`) regenerates the spec differently: `G * U` clients each with a Poisson
process at `1 / (G U)` of the **time-weighted mean rate over all stages** (stages become
contiguous lifecycle windows, so an `8;20` req/s spec runs at 14 req/s throughout), a shared
prefix per group and a **fresh random question per request** (no whole-prompt repetition).
`blis_workload=True` produces that (arrivals Poisson at the mean rate over the whole
duration, every question unique).

Not reproduced: the tokenizer. inference-perf drew random token ids, decoded them to text and
vLLM re-tokenised the text (plus BOS), so real prompts were a few percent longer than
`system_prompt_len + question_len` (BLIS's H30 FINDINGS: 574 real vs 547 nominal input tokens
for the `general` profile; inference-perf fixed the drift in May 2026, #383 / #491). Prompts
here are exactly `system_prompt_len + question_len` tokens. `enable_multi_turn_chat` (true in
the real specs) is not modelled. At 4ad7d4b it changes the pairing, not the structure: the
questions stay in group order and the `G * U` user sessions (each starting from its group's
system prompt, `LocalUserSession.context`) are shuffled, request `j` pairing session and
question `j mod G*U`, so each system prompt still heads `U` of the `G * U` prompts of a cycle
and whole prompts still repeat every `G * U` requests, as here. Its session code would also
append each response to the session's context (`UserSessionCompletionAPIData`) and serialise
a session's rounds; BLIS's H30 FINDINGS report constant input tokens in the real data, i.e.
no accumulation, and the prompts here do not grow.

Prefix identity (docs/prefix_caching.md, section 1: a chain over full blocks only), at
`block_tokens` (16, vLLM's block size): full block `q` of a prompt (tokens `[16 q, 16 q + 16)`)
lying wholly inside the system prompt has the group's id `("sys", g, q)`; every other full
block (the one straddling the system/question boundary included) has the prompt's id
`("prompt", g, u, q)`; the partial last block has no identity and is not in the list. So two
requests sending the same prompt share all their full blocks, and two users of one group share
exactly the `system_prompt_len // 16` full blocks of the system prompt.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jaxserve.core.types import Trace, validate_trace
from jaxserve.traces.prefix import PrefixTrace, build_prefix_tree

__all__ = ["ARRIVAL_MODES", "SharedPrefixSpec", "stage_arrivals", "prompt_cycle",
           "shared_prefix_trace"]

ARRIVAL_MODES = ("constant", "even", "poisson")


@dataclasses.dataclass(frozen=True)
class SharedPrefixSpec:
    """An inference-perf `shared_prefix` workload with `constant` load stages.

    Attributes:
      num_unique_system_prompts: G, groups (distinct system prompts).
      num_users_per_system_prompt: U, questions (prompts) per group.
      system_prompt_len: tokens of each system prompt.
      question_len: tokens of each question.
      output_len: tokens each request generates (`max_tokens` with `ignore_eos`).
      stages: `((rate req/s, duration s), ...)`, run one after the other.
    """

    num_unique_system_prompts: int
    num_users_per_system_prompt: int
    system_prompt_len: int
    question_len: int
    output_len: int
    stages: tuple[tuple[float, float], ...]

    @property
    def num_prompts(self) -> int:
        """G * U, the distinct prompts the generator pre-builds."""
        return self.num_unique_system_prompts * self.num_users_per_system_prompt

    @property
    def prompt_len(self) -> int:
        """Tokens of every prompt: `system_prompt_len + question_len`."""
        return self.system_prompt_len + self.question_len

    @property
    def duration_s(self) -> float:
        """Seconds of all stages together (without gaps)."""
        return float(sum(d for _, d in self.stages))

    @property
    def mean_rate(self) -> float:
        """Time-weighted mean rate over the stages (req/s), BLIS's aggregate rate."""
        return float(sum(r * d for r, d in self.stages)) / self.duration_s

    def validate(self) -> None:
        """Raises ValueError naming the first invalid field."""
        for f, lo in (("num_unique_system_prompts", 1), ("num_users_per_system_prompt", 1),
                      ("system_prompt_len", 0), ("question_len", 0), ("output_len", 1)):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"SharedPrefixSpec.{f} must be an integer >= {lo}, got {v!r}")
        if self.prompt_len < 1:
            raise ValueError("SharedPrefixSpec: system_prompt_len + question_len must be >= 1")
        if not self.stages:
            raise ValueError("SharedPrefixSpec.stages must hold at least one (rate, duration)")
        for k, st in enumerate(self.stages):
            if len(st) != 2:
                raise ValueError(f"SharedPrefixSpec.stages[{k}] must be (rate, duration), "
                                 f"got {st!r}")
            r, d = float(st[0]), float(st[1])
            if not (np.isfinite(r) and r > 0 and np.isfinite(d) and d > 0):
                raise ValueError(f"SharedPrefixSpec.stages[{k}] needs a finite rate > 0 and "
                                 f"duration > 0, got {st!r}")


def stage_arrivals(rate: float, duration: float, mode: str,
                   rng: np.random.Generator) -> np.ndarray:
    """Arrival offsets (s from the stage's start, sorted, float64) of one stage.

    `"constant"`: inference-perf's `ConstantLoadTimer`: `n = int(rate * duration)` exponential
    intervals of mean `1/rate`, scaled to sum to `duration`; arrival `k` (1-based) at the sum
    of the first `k` (the last at `duration`). `"even"`: `n` arrivals `duration / n` apart, the
    first at `duration / n`, the last at `duration` (`1/rate` apart when `rate * duration` is
    an integer). `"poisson"`: a Poisson process of rate `rate` on `[0, duration)` (the count is
    Poisson(`rate * duration`)).
    """
    if mode == "poisson":
        n = int(rng.poisson(rate * duration))
        return np.sort(rng.uniform(0.0, duration, n))
    n = int(rate * duration)
    if n == 0:
        return np.zeros(0, np.float64)
    if mode == "even":
        return np.arange(1, n + 1, dtype=np.float64) * (duration / n)
    if mode == "constant":
        gaps = rng.exponential(1.0 / rate, n)
        return np.cumsum(gaps * (duration / gaps.sum()))
    raise ValueError(f"arrivals must be one of {ARRIVAL_MODES}, got {mode!r}")


def prompt_cycle(counts: Sequence[int], num_prompts: int, order: np.ndarray | None = None,
                 restart_per_stage: bool = True) -> np.ndarray:
    """Prompt index of each request: request `j` of a stage (counting from 0 in each stage when
    `restart_per_stage`, else across stages) sends `order[j mod num_prompts]` (`order` default
    `arange`). `(sum(counts),)` int64."""
    order = np.arange(num_prompts) if order is None else np.asarray(order, np.int64)
    if restart_per_stage:
        j = np.concatenate([np.arange(c, dtype=np.int64) for c in counts] or
                           [np.zeros(0, np.int64)])
    else:
        j = np.arange(int(np.sum(counts)), dtype=np.int64)
    return order[j % num_prompts]


def shared_prefix_trace(spec: SharedPrefixSpec, arrivals: str = "constant", seed: int = 0, *,
                        shuffle: bool = True, restart_per_stage: bool = True,
                        stage_gap_s: float = 0.0, blis_workload: bool = False,
                        until_s: float | None = None, block_tokens: int = 16) -> PrefixTrace:
    """The requests of `spec` as a `PrefixTrace` (arrivals in s from the first stage's start,
    not rebased; prompt and output tokens; prefix identity over `block_tokens`-token full
    blocks, see the module docstring).

    Args:
      spec: the workload.
      arrivals: `"constant"` (inference-perf's timer), `"even"` or `"poisson"`
        (`stage_arrivals`).
      seed: seeds the arrivals and the prompt order (numpy `default_rng(seed)`).
      shuffle: put the `G * U` prompts in a seeded random order before cycling (as the source
        does); False cycles them in group-major order `(g, u) -> g * U + u`.
      restart_per_stage: restart the cycle at every stage (as the source does).
      stage_gap_s: seconds between the end of one stage and the start of the next.
      blis_workload: BLIS's regeneration instead: one Poisson stage at `spec.mean_rate` over
        `spec.duration_s` (overrides `arrivals` and the stages) and a unique question per
        request (only the system prompt's blocks are shared).
      until_s: keep only the requests arriving before this time (a prefix of the run).
      block_tokens: tokens per identity block (vLLM's `block_size`).

    Returns:
      `PrefixTrace` with `full_blocks = prompt // block_tokens` and every request's deepest
      node at its last full block (-1 for a prompt shorter than one block).

    Raises:
      ValueError: invalid spec (naming the field), mode, gap, cut or block size.
    """
    spec.validate()
    if arrivals not in ARRIVAL_MODES:
        raise ValueError(f"arrivals must be one of {ARRIVAL_MODES}, got {arrivals!r}")
    if not np.isfinite(stage_gap_s) or stage_gap_s < 0:
        raise ValueError(f"stage_gap_s must be finite and >= 0, got {stage_gap_s}")
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, (int, np.integer)) \
            or block_tokens < 1:
        raise ValueError(f"block_tokens must be an integer >= 1, got {block_tokens!r}")
    rng = np.random.default_rng(seed)
    P = spec.num_prompts
    order = rng.permutation(P) if shuffle else np.arange(P)
    if blis_workload:
        stages, mode = ((spec.mean_rate, spec.duration_s),), "poisson"
    else:
        stages, mode = spec.stages, arrivals
    times, counts, t0 = [], [], 0.0
    for r, d in stages:
        a = stage_arrivals(float(r), float(d), mode, rng)
        times.append(t0 + a)
        counts.append(len(a))
        t0 += float(d) + float(stage_gap_s)
    arrival = np.concatenate(times)
    if arrival.size == 0:
        raise ValueError("the spec produced no requests")
    prompt_idx = prompt_cycle(counts, P, order, restart_per_stage)
    if until_s is not None:
        keep = arrival < float(until_s)
        if not keep.any():
            raise ValueError(f"until_s={until_s} keeps no request")
        arrival, prompt_idx = arrival[keep], prompt_idx[keep]
    n = arrival.size
    U, T = spec.num_users_per_system_prompt, int(block_tokens)
    sys_full = spec.system_prompt_len // T
    full = spec.prompt_len // T
    lists = []
    for i in range(n):
        g, u = divmod(int(prompt_idx[i]), U)
        # BLIS's regeneration: the question (and so every non-system block) is the request's
        own = ("req", i) if blis_workload else ("prompt", g, u)
        lists.append([("sys", g, q) if q < sys_full else own + (q,) for q in range(full)])
    intern: dict = {}
    tree, node = build_prefix_tree(
        [[intern.setdefault(h, len(intern)) for h in ids] for ids in lists], T)
    prompt = np.full(n, spec.prompt_len, np.int64)
    trace = validate_trace(Trace(arrival_s=arrival.astype(np.float64), prompt_tokens=prompt,
                                 output_tokens=np.full(n, spec.output_len, np.int64)))
    return PrefixTrace(trace=trace, node=node, full_blocks=prompt // T, tree=tree)
