"""LLMDisaggRouting-v0: route each arriving request in a prefill/decode-disaggregated cluster.

One decision per arriving request, on the disaggregation engine (`core.disaggregation`,
docs/disaggregation.md): which D (decode) replica, and whether to prefill it remotely on a P
(prefill) replica and which one, as one flattened two-level action (docs/disaggregation.md
section 4: D first, then the decider, then P). Everything a user may sweep is a leaf of
`DisaggRoutingParams` (the stacked P-then-D profile, the link, the workload, the reward
scales); the pool sizes and the engine's buffers are static (`LLMDisaggRoutingStatic`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from gymnax.environments import environment, spaces

from jaxserve.core import arrivals as A
from jaxserve.core import disaggregation as PD
from jaxserve.core import rng
from jaxserve.core.queues import Request
from jaxserve.core.replica import ReplicaProfile, replica_profile
from jaxserve.envs import common
from jaxserve.envs.base import StaticConfig, as_size, clip_features, feature_box
from jaxserve.envs.defaults import build_params, fill_defaults
from jaxserve.envs.llm_routing import REWARDS, episode_horizon, slo_attained

NUM_REQUEST_FEATURES = 2
NUM_REPLICA_FEATURES = 4
# OPT-13B in fp16 at TP 1: 2 (K and V) * 40 layers * 5120 hidden * 2 bytes (docs/disaggregation.md
# section 7, BLIS `KVBytesPerToken`), the model of the default `opt13b-a100-80g` replicas.
OPT13B_KV_BYTES_PER_TOKEN = 2 * 40 * 5120 * 2
# Pending D requests a D replica's waiting buffer holds beyond its queue cap (no cap bounds
# them: docs/disaggregation.md section 5); what does not fit is counted in `info["overflow"]`.
DEFAULT_PENDING_BUFFER = 64
DEFAULT_NUM_REQUESTS = 512  # per-request tables: the registered `max_steps_in_episode`


@struct.dataclass
class DisaggRoutingParams(common.ServingParams):
    """`ServingParams` of LLMDisaggRouting-v0. `gpus` is the stacked profile of the P replicas
    then the D replicas (`disaggregation.pool_profile`).

    Attributes (beyond `ServingParams`'s):
      link: the KV-transfer link (`disaggregation.Link`: bytes/s, s, bytes/token, shared).
    """

    link: PD.Link


@struct.dataclass
class DisaggRoutingState:
    """State of an LLMDisaggRouting-v0 episode; times relative to the pending request's
    arrival (s).

    Attributes:
      cluster: both pools, the link's transfers and the per-request tables (`PDCluster`).
      log: per-request outcome of this episode's requests (`PDLog`, request id = decision
        index).
      arrival: `(N,)` arrival of each request id (relative s; 0 for ids not yet arrived).
        float32.
      in_system: requests routed and not yet finished (nor dropped). int32.
      pending: the request awaiting its routing decision (`req_id` = `time`).
      phase: arrival-process phase. int32.
      time: decisions taken this episode. int32.
      horizon: decisions after which the episode is truncated (`llm_routing.episode_horizon`).
        int32.
    """

    cluster: PD.PDCluster
    log: PD.PDLog
    arrival: jax.Array
    in_system: jax.Array
    pending: Request
    phase: jax.Array
    time: jax.Array
    horizon: jax.Array


@dataclasses.dataclass(frozen=True)
class LLMDisaggRoutingStatic:
    """Static configuration of LLMDisaggRouting-v0 (`envs.base.StaticConfig`).

    Attributes:
      num_prefill: P replicas, >= 0 (0: every action is "not disaggregated").
      num_decode: D replicas, >= 1.
      queue_buffer: waiting slots per replica (`disaggregation.empty_pd`): the largest
        `queue_cap` plus room for pending D requests.
      max_seqs: running slots per replica (>= every `max_seqs`).
      remote_slots: remote-list entries per D replica (requests holding reserved blocks).
      transfer_slots: transfers in flight on the link.
      num_requests: length of the per-request tables and log (request id = decision index),
        >= the params' `max_steps_in_episode`.
      width: D's admission window over its waiting queue (`disaggregation.advance`).
      reward: "time_in_system" or "slo" (see `LLMDisaggRouting`, Reward).
    """

    num_prefill: int
    num_decode: int
    queue_buffer: int = 64 + DEFAULT_PENDING_BUFFER
    max_seqs: int = 64
    remote_slots: int = 64
    transfer_slots: int = 64
    num_requests: int = DEFAULT_NUM_REQUESTS
    width: int = 64 + DEFAULT_PENDING_BUFFER + 64
    reward: str = "time_in_system"

    def __post_init__(self):
        for name, low in (("num_prefill", 0), ("num_decode", 1), ("queue_buffer", 1),
                          ("max_seqs", 1), ("remote_slots", 1), ("transfer_slots", 1),
                          ("num_requests", 1), ("width", 1)):
            object.__setattr__(self, name, as_size(name, getattr(self, name), low))
        if self.reward not in REWARDS:
            raise ValueError(f"reward must be one of {REWARDS}, got {self.reward!r}")


def decode_action(action, num_prefill: int, num_decode: int):
    """The flattened action `a in [0, D (P + 1))` as `(d, p, invalid)`: D replica
    `d = a // (P + 1)`, P replica `p = a % (P + 1) - 1` (-1: not disaggregated, the whole
    request on `d`). An invalid action (not an integer in range) is mapped deterministically
    by `common.discrete_action` (clipped, a float floored, NaN to 0) and flagged."""
    a, invalid = common.discrete_action(action, num_decode * (num_prefill + 1))
    return a // (num_prefill + 1), a % (num_prefill + 1) - 1, invalid


def encode_action(d, p, num_prefill: int) -> jax.Array:
    """The action routing to D replica `d` and P replica `p` (-1: not disaggregated). int32."""
    return (jnp.asarray(d, jnp.int32) * (num_prefill + 1) + jnp.asarray(p, jnp.int32)
            + 1).astype(jnp.int32)


class LLMDisaggRouting(StaticConfig, environment.Environment[DisaggRoutingState,
                                                             DisaggRoutingParams]):
    """Route every arriving request in a P/D-disaggregated cluster (docs/disaggregation.md).

    Decision epochs: each request arrival. Between arrivals the engine runs exactly and
    event-driven (`disaggregation.advance`: P and D iterations, the P -> D handover, KV
    transfers on the shared link, D's allocation before the transfer).

    Action: `Discrete(D * (P + 1))`, a flattened two-level choice made in the contract's
      order (section 4): D replica `d = a // (P + 1)`, then `p = a % (P + 1) - 1`: -1 runs
      the request entirely on `d` (not disaggregated, a colocated request there), `p >= 0`
      prefills it on P replica `p` and decodes it on `d` (`encode_action`, `decode_action`).
      An action that is not an integer in range is counted in `info["invalid_actions"]` and
      mapped deterministically (`common.discrete_action`).
    Observation: float32 `(2 + (P + D) * 4,)`, each feature clipped to `[0, FEATURE_CLIP]`
      (`clip_features`) and O(1) at any load; only what section 4 lets a router see:
      - `[0:2]` the arriving request's prompt, `log1p(p) / log1p(max_prompt)` and
        `p / max_prompt` (tokens over tokens; never its output length);
      - one row of 4 per replica, P replicas first (row-major `(P + D, 4)`), from
        `disaggregation.replica_views`: running / max_seqs, waiting / queue_cap (waiting
        includes pending D requests and the remote list, so it may exceed 1 on D replicas,
        by at most `queue_buffer / queue_cap`), KV blocks in use / kv_blocks (with blocks
        held for sends and reserved for receives), and 1 on P rows, 0 on D rows.
    Reward (`reward`, static; as LLMRouting-v0's, unshaped):
      - `"time_in_system"` (default): `-(time-in-system during the step (s) + drop_penalty_s *
        drops) / latency_scale` (`common.reward_from`); a request is in the system from its
        arrival to D's last token, wherever it is (P, the link, D).
      - `"slo"`: `-(slo_miss_s * SLO misses + drop_penalty_s * drops) / latency_scale`, a miss
        being a request finishing in the step with TTFT (to D's first token, section 11) >
        `slo_ttft_s` or TPOT after it > `slo_tpot_s` (`llm_routing.slo_attained`).
      No potential-based shaping (LLMRouting-v0's potential is the colocated engine's
      estimate; none is written for this engine).
    Termination: never (synthetic arrivals only; a replayed trace is refused). Truncation:
      after `state.horizon` decisions, drawn at reset in `[ceil(L / 2), L]`
      (`llm_routing.episode_horizon`, `L = max_steps_in_episode <= num_requests`).
    Info: `StepMetrics` fields (`completed`, `latency_sum` (s), `slo_met` count requests
      finishing on D, end to end; `busy_time` sums both pools), `slo_attained`,
      `slo_missed` (TTFT/TPOT targets, either reward), `first_tokens` (D's first samples),
      `disaggregated` (the routed request went to a P replica), `transfers_started`,
      `transfers_ended`, `never_fit` (drops because the request can never fit), `overflow`
      (static-size overflows of the engine in the step; 0 in a valid run).
    """

    Static = LLMDisaggRoutingStatic
    reset_fills_queues = True  # the cluster is a PDCluster: plain select on auto-reset

    @property
    def name(self) -> str:
        return "LLMDisaggRouting-v0"

    @property
    def policy_kind(self) -> str:
        """The registry kind of its heuristics (`policies.disagg_routing`)."""
        return "disagg_routing"

    @property
    def num_replicas(self) -> int:
        return self.num_prefill + self.num_decode

    @property
    def num_actions(self) -> int:
        return self.num_decode * (self.num_prefill + 1)

    @property
    def obs_layout(self) -> tuple[int, int, int]:
        return NUM_REQUEST_FEATURES, self.num_replicas, NUM_REPLICA_FEATURES

    def check_params(self, params: DisaggRoutingParams) -> None:
        """Raises ValueError (naming the field) if `params` do not fit this environment."""
        if not isinstance(params, DisaggRoutingParams):
            raise ValueError(f"params must be DisaggRoutingParams, got {type(params).__name__}")
        if not isinstance(params.gpus, ReplicaProfile):
            raise ValueError("params.gpus must be a stacked ReplicaProfile "
                             "(disaggregation.pool_profile)")
        if int(np.asarray(params.trace.length)) > 0 or np.shape(params.trace.gap)[-1] > 0:
            raise ValueError("LLMDisaggRouting-v0 takes synthetic arrivals only (no trace)")
        common.validate_params(params, self.queue_buffer, self.max_seqs, self.num_replicas)
        common.check_token_headroom(params, params.gpus.block_size, self.max_seqs)
        steps = np.asarray(params.max_steps_in_episode)
        if np.any(steps > self.num_requests):
            raise ValueError(f"params.max_steps_in_episode {steps} exceeds the static "
                             f"num_requests ({self.num_requests}), the per-request tables")
        lk = params.link
        if not isinstance(lk, PD.Link):
            raise ValueError("params.link must be a disaggregation.Link (make_link)")
        for f in ("bandwidth", "base_latency", "kv_bytes_per_token"):
            v = np.asarray(getattr(lk, f), np.float64)
            if not np.all(np.isfinite(v)) or np.any(v < 0) or (f == "bandwidth"
                                                              and np.any(v <= 0)):
                raise ValueError(f"params.link.{f} must be finite and >= 0 (bandwidth > 0), "
                                 f"got {v}")

    def reset_env(self, key, params):
        k_phase, k_req = rng.split(key)
        phase = common.first_phase(k_phase, params)
        _, req, phase, _ = common.next_arrival(k_req, params, phase, jnp.int32(0), jnp.int32(0))
        n = self.num_requests
        cluster = PD.empty_pd(self.num_prefill, self.num_decode, queue_buffer=self.queue_buffer,
                              max_seqs=self.max_seqs, remote_slots=self.remote_slots,
                              transfer_slots=self.transfer_slots, num_requests=n)
        state = DisaggRoutingState(
            cluster=cluster, log=PD.empty_pd_log(n), arrival=jnp.zeros((n,), jnp.float32),
            in_system=jnp.int32(0), pending=req, phase=phase, time=jnp.int32(0),
            horizon=episode_horizon(jax.random.fold_in(key, 3), params))
        return self.get_obs(state, params), state

    def step_env(self, key, state, action, params):
        d, p, invalid = decode_action(action, self.num_prefill, self.num_decode)
        n = self.num_requests
        rid = jnp.minimum(state.time, n - 1)  # `check_params`: time < max_steps <= n
        req = state.pending.replace(arrival=jnp.float32(0.0), req_id=rid)
        prof, st0, log0 = params.gpus, state.cluster, state.log
        st, dropped, never = PD.route(st0, prof, req, p, d)
        gap, nxt, phase, _ = common.next_arrival(key, params, state.phase, jnp.int32(0),
                                                 rid + 1)
        st, log, m = PD.advance(st, prof, params.link, gap, log0, self.width)
        # D's finishes in the window [0, gap] (P's `(p, 1)` requests are logged at N + id
        # and are not completions of the client's request).
        arrival = state.arrival.at[rid].set(0.0)  # the routed request arrives now
        e2e0, e2e = log0.requests.e2e[:n], log.requests.e2e[:n]
        done = jnp.isfinite(e2e) & ~jnp.isfinite(e2e0)
        t_fin = jnp.where(done, arrival + e2e, 0.0)
        in_sys = state.in_system + (~dropped).astype(jnp.int32) - done.sum().astype(jnp.int32)
        ttft = log.requests.ttft[:n]
        output = st.tables.output.astype(jnp.float32)
        met = done & slo_attained(ttft, e2e, output, params)
        lat = jnp.where(done, e2e, 0.0)
        metrics = m.replace(
            arrived=jnp.int32(1), dropped=dropped.astype(jnp.int32),
            completed=done.sum().astype(jnp.int32), latency_sum=lat.sum(),
            slo_met=(done & (e2e <= params.slo_s)).sum().astype(jnp.int32),
            in_system_time=t_fin.sum() + in_sys.astype(jnp.float32) * gap,
            elapsed=gap, invalid_actions=invalid.astype(jnp.int32))
        missed = (done.sum() - met.sum()).astype(jnp.int32)
        first = (jnp.isfinite(ttft) & ~jnp.isfinite(log0.requests.ttft[:n])).sum()
        started = (jnp.isfinite(log.transfer_start) & ~jnp.isfinite(log0.transfer_start)).sum()
        ended = (jnp.isfinite(log.transfer_end) & ~jnp.isfinite(log0.transfer_end)).sum()
        info = {**metrics.as_dict(), "slo_attained": met.sum().astype(jnp.int32),
                "slo_missed": missed, "first_tokens": first.astype(jnp.int32),
                "disaggregated": ((p >= 0) & ~dropped).astype(jnp.int32),
                "transfers_started": started.astype(jnp.int32),
                "transfers_ended": ended.astype(jnp.int32),
                "never_fit": never.astype(jnp.int32),
                "overflow": (st.overflow - st0.overflow).astype(jnp.int32)}
        if self.reward == "slo":
            cost = params.slo_miss_s * missed + params.drop_penalty_s * metrics.dropped
            reward = (-cost / params.latency_scale).astype(jnp.float32)
        else:
            reward = common.reward_from(metrics, params)
        # Rebase to the next arrival; arrivals of this episode's requests move with the clock.
        st = PD.rebase(st, gap)
        state = DisaggRoutingState(
            cluster=st, log=log, arrival=arrival - gap,
            in_system=in_sys, pending=nxt, phase=phase, time=state.time + 1,
            horizon=state.horizon)
        return self.get_obs(state, params), state, reward, jnp.bool_(False), info

    def get_obs(self, state, params=None, key=None):
        params = self.default_params if params is None else params
        v = PD.replica_views(state.cluster, params.gpus)
        prof = params.gpus
        rows = jnp.stack([v["running"] / jnp.maximum(prof.max_seqs, 1),
                          v["waiting"] / jnp.maximum(prof.queue_cap, 1),
                          v["kv_usage"], v["is_prefill"].astype(jnp.float32)], axis=-1)
        p = state.pending.prompt
        top = jnp.maximum(params.tokens.max_prompt, 1.0)
        req = jnp.stack([jnp.log1p(p) / jnp.log1p(top), p / top])
        return clip_features(jnp.concatenate([req, rows.ravel()]))

    def is_truncated(self, state, params):
        return state.time >= state.horizon

    def action_space(self, params=None):
        return spaces.Discrete(self.num_actions)

    def observation_space(self, params=None):
        return feature_box((NUM_REQUEST_FEATURES + self.num_replicas * NUM_REPLICA_FEATURES,))

    def state_space(self, params=None) -> Any:
        raise NotImplementedError(f"{self.name} exposes its state as the DisaggRoutingState "
                                  f"pytree")


def drain(env: LLMDisaggRouting, state: DisaggRoutingState, params: DisaggRoutingParams
          ) -> PD.PDLog:
    """The episode's log after running the cluster to empty with no further arrival (the
    pending request is not routed): every routed, undropped request finishes (unless a
    replica stalls for good). Spans from each request's arrival (s)."""
    _, log, _ = PD.advance(state.cluster, params.gpus, params.link, jnp.float32(jnp.inf),
                           state.log, env.width)
    return log


# ---- LLMDisaggRouting-v0's scenario and builder

def disagg_routing_tokens() -> A.TokenDist:
    """Default workload: long-context requests (half with ~4096-token prompts, half with
    ~512), each ~128 output tokens, lognormal spread 0.3 (`bimodal_tokens`); prompts capped
    at 8192 tokens, outputs at 1024. The short half is where prefilling locally on D (no
    transfer, no P queue) can pay; the long half is where KV size and transfer time do."""
    return A.bimodal_tokens(long_frac=0.5, short=(512, 128), long=(4096, 128), sigma=0.3,
                            max_prompt=8192, max_output=1024)


def disagg_routing_replicas() -> tuple[list, list]:
    """Default pools: 2 P and 2 D replicas of `opt13b-a100-80g` (OPT-13B on A100-80GB,
    DistServe's fits, 3379 KV blocks of 16 tokens: about 13 requests of 4096 tokens each)."""
    r = replica_profile("opt13b-a100-80g")
    return [r, r], [r, r]


# LLMDisaggRouting-v0's own defaults (the shared ones, reward scales included, are
# `ServingParams`' field defaults), applied by `defaults.fill_defaults` as every builder does.
DEFAULTS = dict(
    arrival_rate=5.0,  # req/s; set from the measured capacity (docs/envs/llm_disagg_routing.md)
    link=dict(bandwidth=PD.LINK_DEFAULTS["bandwidth"],
              base_latency=PD.LINK_DEFAULTS["base_latency"],
              kv_bytes_per_token=float(OPT13B_KV_BYTES_PER_TOKEN), shared=True),
    tokens=disagg_routing_tokens,
    slo_s=20.0, max_steps_in_episode=DEFAULT_NUM_REQUESTS,
)


def make_llm_disagg_routing(prefill=None, decode=None, link=None, arrival_rate=None,
                            arrivals=None, reward="time_in_system", num_requests=None,
                            pending_buffer=DEFAULT_PENDING_BUFFER, remote_slots=None,
                            transfer_slots=None, **kw):
    """LLMDisaggRouting-v0 with its default scenario (`DEFAULTS`, `disagg_routing_replicas`,
    `disagg_routing_tokens`) and overrides.

    Args:
      prefill, decode: lists of `ReplicaProfile` (the P pool may be empty; both pools share
        `moe_tokens`).
      link: dict of `make_link`'s keywords (bandwidth bytes/s, base_latency s,
        kv_bytes_per_token bytes/token, shared bool); missing keys take `DEFAULTS["link"]`.
      arrival_rate (req/s) or arrivals (an `ArrivalProcess`); reward "time_in_system" or
        "slo"; num_requests: static per-request table length (default: max_steps_in_episode);
        pending_buffer, remote_slots, transfer_slots: static engine sizes (see
        `LLMDisaggRoutingStatic`); any scalar field of `ServingParams` (reward scales as
        every environment: `drop_penalty_s = 600` s, `latency_scale = 1000` s).

    Raises:
      ValueError: an invalid configuration (naming the field).
    """
    if "gpus" in kw or "replicas" in kw:
        raise ValueError("LLMDisaggRouting-v0 takes prefill= and decode= (lists of "
                         "ReplicaProfile), not gpus= or replicas=")
    if "trace" in kw:
        raise ValueError("LLMDisaggRouting-v0 takes synthetic arrivals only (no trace)")
    dp, dd = disagg_routing_replicas()
    prefill = dp if prefill is None else list(prefill)
    decode = dd if decode is None else list(decode)
    if not decode:
        raise ValueError("decode must name at least one ReplicaProfile")
    for name, pool in (("prefill", prefill), ("decode", decode)):
        for k, r in enumerate(pool):
            if not isinstance(r, ReplicaProfile):
                raise ValueError(f"{name}[{k}] must be a ReplicaProfile, got {type(r).__name__}")
    lk = dict(DEFAULTS["link"])
    unknown = set(link or {}) - set(lk)
    if unknown:
        raise ValueError(f"unknown link keys {sorted(unknown)}; known: {sorted(lk)}")
    lk.update(link or {})
    if arrivals is None and arrival_rate is None:
        arrival_rate = DEFAULTS["arrival_rate"]
    fill_defaults(kw, DEFAULTS, exclude=("arrival_rate", "link"))
    prof = PD.pool_profile(prefill, decode)
    base = build_params(prof, arrivals=arrivals, arrival_rate=arrival_rate, **kw)
    params = DisaggRoutingParams(**{f.name: getattr(base, f.name)
                                    for f in dataclasses.fields(base)},
                                 link=PD.make_link(**lk))
    caps = max(int(r.queue_cap) for r in prefill + decode)
    seqs = max(int(r.max_seqs) for r in prefill + decode)
    pend = as_size("pending_buffer", pending_buffer, 0)
    n = (int(np.max(np.asarray(params.max_steps_in_episode))) if num_requests is None
         else as_size("num_requests", num_requests))
    qb = caps + pend
    env = LLMDisaggRouting(
        num_prefill=len(prefill), num_decode=len(decode), queue_buffer=qb, max_seqs=seqs,
        remote_slots=seqs if remote_slots is None else remote_slots,
        transfer_slots=seqs if transfer_slots is None else transfer_slots,
        num_requests=n, width=qb + seqs, reward=reward, default=params)
    env.check_params(params)
    return env, params
