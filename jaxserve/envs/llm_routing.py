"""LLMRouting-v0: route each arriving request to one continuous-batching LLM replica."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from gymnax.environments import environment, spaces

from jaxserve.core import continuous as CB
from jaxserve.core import engines, rng
from jaxserve.core.queues import Request
from jaxserve.core.replica import ReplicaProfile, replica_profile, stack_replicas
from jaxserve.envs import common
from jaxserve.envs.base import StaticConfig, check_sizes, clip_features, feature_box
from jaxserve.envs.defaults import build_params, fill_defaults, refuse_gpus, replica_sizes
from jaxserve.envs.routing import routing_tokens
from jaxserve.envs.routing_step import route_and_advance

NUM_REQUEST_FEATURES = 3
NUM_REPLICA_FEATURES = 7
NUM_PREFIX_FEATURES = 2  # added per replica with prefix caching (LLMPrefixRouting-v0)
DEFAULT_SHAPING_GAMMA = 0.99  # PureJaxRL's discount, as Routing-v0
REWARDS = ("time_in_system", "slo")  # see `LLMRouting`, Reward


@struct.dataclass
class LLMRoutingState:
    """State of an LLMRouting-v0 episode; times relative to the pending request's arrival.

    Attributes:
      cluster: waiting queues, running sets and iteration clocks of every replica
        (`continuous.Replicas`).
      pending: the request awaiting its routing decision.
      phase: arrival-process phase. int32.
      trace_pos: trace row of the pending request. int32.
      time: decisions taken this episode (gymnax's step counter). int32.
      log: per-request outcome of the episode's first `log_capacity` requests
        (`continuous.TokenLog`; empty unless built with a log, as `replay` does).
      backlog: `continuous_load.expected_backlog(cluster)` (s), the shaping potential's input,
        kept so a step reads the potential before it without recomputing it (0 without
        shaping). float32.
      horizon: decisions after which this episode is truncated, drawn at reset (see
        `LLMRouting`, Truncation). int32.
      slo_busy, slo_output: with `reward="slo"`, which token-log slots hold a request still
        in the system, and that request's true output tokens (to compute its TPOT when it
        finishes); `(0,)` otherwise.
    """

    cluster: CB.Replicas
    pending: Request
    phase: jax.Array
    trace_pos: jax.Array
    time: jax.Array
    log: CB.TokenLog
    backlog: jax.Array
    horizon: jax.Array
    slo_busy: jax.Array
    slo_output: jax.Array


@struct.dataclass
class PrefixRoutingParams(common.ServingParams):
    """`ServingParams` of LLMPrefixRouting-v0: a replayed trace with prefix identity.

    Attributes (beyond `ServingParams`'s):
      node: `(L,)` deepest prefix-tree node of each trace row (`traces.prefix.PrefixTrace.
        node`; -1: no shared block, and every padding row). int32.
      tables: the trace's prefix tree (`continuous.PrefixTables`; its `block_tokens` and
        `max_depth` are static, so vmapped params share one tree shape).
    """

    node: jax.Array
    tables: CB.PrefixTables


@dataclasses.dataclass(frozen=True)
class LLMRoutingStatic:
    """Static configuration of LLMRouting-v0 (`envs.base.StaticConfig`).

    Attributes:
      num_replicas: replicas (the action space's size), >= 1.
      queue_buffer: waiting-queue slots per replica (>= every `queue_cap`), >= 1.
      max_seqs: running-sequence slots per replica (>= every profile's `max_seqs`), >= 1.
      trace_len: rows of a replayed trace (0: synthetic arrivals).
      log_capacity: requests kept in the per-request token log (0: no log).
      shaping_gamma: discount of the potential-based reward shaping, in [0, 1], or None (no
        shaping); as Routing-v0's. A Python number because it selects the reward's form.
      reward: "time_in_system" (the default) or "slo" (see `LLMRouting`, Reward). Static
        because the SLO reward keeps a per-request token log.
      prefix_blocks: 0 (no prefix caching: LLMRouting-v0), or the engine's block-table width
        `M` (>= every replica's `kv_blocks`): automatic prefix caching on
        (LLMPrefixRouting-v0; `continuous.empty_replicas(prefix_blocks=M)`), params are
        `PrefixRoutingParams` and each replica's observation row gains
        `NUM_PREFIX_FEATURES` features.
      ranked: actions and observation rows in rank order (see `LLMRouting`, Ranked
        replicas) instead of replica index order.
    """

    num_replicas: int
    queue_buffer: int = 64
    max_seqs: int = 64
    trace_len: int = 0
    log_capacity: int = 0
    shaping_gamma: float | None = DEFAULT_SHAPING_GAMMA
    reward: str = "time_in_system"
    prefix_blocks: int = 0
    ranked: bool = False

    def __post_init__(self):
        check_sizes(self, positive=("num_replicas",),
                    nonnegative=("trace_len", "log_capacity", "prefix_blocks"),
                    slots=("queue_buffer", "max_seqs"))
        object.__setattr__(self, "shaping_gamma", common.check_shaping_gamma(self.shaping_gamma))
        if self.reward not in REWARDS:
            raise ValueError(f"reward must be one of {REWARDS}, got {self.reward!r}")
        if self.prefix_blocks > 0 and self.reward == "slo" and self.log_capacity == 0:
            # The SLO reward renames requests by reusable log slots, and a private block's
            # identity is keyed by request id: a later request in the same slot would hit
            # its predecessor's private blocks.
            raise ValueError("reward='slo' with prefix_blocks > 0 needs log_capacity > 0 "
                             "(request ids must stay unique)")

    @property
    def slo_slots(self) -> int:
        """Token-log slots the SLO reward tracks requests in (0 for the time-in-system reward):
        the log's own `log_capacity` when there is one (a replay: slot = request id), else one
        more than the requests the replicas can hold (`num_replicas * (queue_buffer +
        max_seqs)`), reused as requests leave."""
        if self.reward != "slo":
            return 0
        if self.log_capacity > 0:
            return self.log_capacity
        return self.num_replicas * (self.queue_buffer + self.max_seqs) + 1


class LLMRouting(StaticConfig, environment.Environment[LLMRoutingState, common.ServingParams]):
    """Route every arriving request to a replica; each replica batches continuously (vLLM v1).

    `params.gpus` holds the stacked `ReplicaProfile` of the replicas (`stack_replicas`).

    Decision epochs: each request arrival. Between arrivals the replicas evolve exactly
    (event-driven, `core.continuous`). A step is Routing-v0's routing skeleton
    (`envs.routing_step.route_and_advance`: route the pending request, draw the next, advance
    the replicas to its arrival, move the clock origin there) on the continuous engine;
    the SLO reward's log slots, the prefix identity and the observation are this class's.

    Observation: float32 `(3 + num_replicas * 7,)`, every feature O(1) (fractions in [0, 1],
      or `log1p` of a ratio, which grows only logarithmically with overload), built only from
      what a router knows (prompts, output *estimates*, counts, KV blocks in use), never the
      true output lengths:
      - `[0:3]` the arriving request, as in Routing-v0 (`common.request_features`).
      - one row of 7 per replica (row-major `(num_replicas, 7)`): waiting / queue_cap (the
        waiting count includes preempted requests), running / max_seqs, KV blocks held /
        kv_blocks, `log1p(estimated tokens in flight / (kv_blocks * block_size))`
        (`continuous.tokens_in_flight`: prompt + output estimate of every request, less
        tokens generated), `log1p(queued work / time_scale)` (`continuous_load.queued_work`,
        estimated seconds of replica time held), `log1p(estimated seconds of time-in-system the
        arriving request would add there / time_scale)` (its own latency plus the delay it
        causes the others, `continuous_load.marginal_backlog`), and
        the same relative to the smallest over replicas, `log(added / min added)` (0 at the
        replica where the request adds least).
      All features are clipped to `[0, FEATURE_CLIP]` (`clip_features`); at 10x the registered
      load they stay below 10 (tests/test_llm_routing_env.py).
    Action: `Discrete(num_replicas)`. An action that is not an integer in `[0, num_replicas)`
      (out of range, non-integral or non-finite) is counted in `info["invalid_actions"]` and
      mapped deterministically (`common.discrete_action`: clipped into range, a float
      floored, NaN to 0).
    Reward (`reward`, a static choice):
      - `"time_in_system"` (the default): `-(time-in-system during the step (s) +
        drop_penalty_s * drops) / latency_scale` (`common.reward_from`), as Routing-v0.
      - `"slo"`: `-(slo_miss_s * SLO misses + drop_penalty_s * drops) / latency_scale`, an SLO
        miss being a request finishing in the step with time to first token > `slo_ttft_s`
        (s) or time per output token after the first > `slo_tpot_s` (s/token) (DistServe's
        per-request SLO; `slo_attained`); `info` adds `slo_attained` and `slo_missed`.
      Either is shaped, when `shaping_gamma` is not None (the default 0.99), with Routing-v0's
      potential-based term `shaping_gamma * phi(s') - phi(s)` (`common.shaped_reward`),
      `phi = -(estimated future cost of the requests present) / latency_scale`: their
      expected remaining time-in-system (`continuous_load.expected_backlog`, s), or
      `slo_miss_s` times the number expected to miss their SLO
      (`continuous_load.expected_slo_misses`). With it a step's reward is about minus the
      routed request's estimated latency over `latency_scale`, paid at the decision. Shaping
      leaves the optimal policy of the `shaping_gamma`-discounted objective unchanged.
      Registered defaults (`jaxserve.make`), as the other environments: `latency_scale =
      1000` s, `drop_penalty_s = 600` s, `slo_miss_s = 60` s, `slo_ttft_s = 2` s,
      `slo_tpot_s = 0.1` s/token, `time_scale = 10` s.
    Termination: only with a replayed trace, after its last request (that step drains the
      replicas). Truncation: with synthetic arrivals after `state.horizon` decisions, drawn
      at each reset uniformly from `[ceil(L / 2), L]` (`L = max_steps_in_episode`, 512 by
      default; `episode_horizon`), so vmapped environments do not reset in lockstep and a
      rollout batch covers every stretch of an episode; with a trace after `L`.
    Info: `StepMetrics` fields (`slo_met` counts completions with end-to-end latency <= slo_s)
      plus `first_tokens`, `ttft_sum` (s), `preemptions` and `never_fit` drops of the step,
      and `boundaries` (the engine's iteration-boundary passes in the step, a cost counter).
    Static configuration: `LLMRoutingStatic` (`num_replicas`, `queue_buffer`, `max_seqs`,
      `trace_len`, `log_capacity`, `shaping_gamma`, `reward`, `prefix_blocks`); set
      `shaping_gamma` and `reward` with `jaxserve.make("LLMRouting-v0", shaping_gamma=...,
      reward=...)`.

    Prefix caching (LLMPrefixRouting-v0, `prefix_blocks > 0`; docs/prefix_caching.md): the
      replicas run vLLM v1's automatic prefix caching; params are `PrefixRoutingParams`, and
      the request of trace row `i` carries its prefix-tree node `params.node[i]` (without a
      trace, -1: nothing shared). Each replica's row gains two features (so it has 9):
      `[7]` the pending request's prompt tokens cached there now, as a fraction of its prompt
      (`cached_prefix_blocks * block_size / prompt`, in [0, 1]), and `[8]` cached-unreferenced
      blocks / kv_blocks (cached blocks no running request holds: free, but evicting them
      loses their prefix); `[2]` is then the distinct blocks running requests hold
      / kv_blocks (shared blocks once). `info` adds the window's prefix counters
      (`continuous.PREFIX_EXTRAS`): `prefix_hit_tokens` (cached tokens at admissions = prefill
      tokens saved), `prefix_lookup_tokens` (tokens of the admitted requests; the token hit
      rate of any window is the ratio of the two sums), `prefix_hit_blocks`,
      `prefix_lookup_blocks`, `prefix_evictions` and `prefix_shared_preemptions`. Replay
      fixed decisions with `evaluation.replay.replay_prefix` (`jaxserve.replay` takes a
      plain `Trace`, which has no prefix nodes, and refuses this environment).

    Ranked replicas (`ranked=True`): action `k` routes to the replica ranked `k`, and the
      observation's replica rows come in that order: most of the pending request's prompt
      blocks cached there first (`pending_cached_blocks`; 0 everywhere without prefix
      caching), then fewest estimated tokens in flight (`continuous.tokens_in_flight`), then
      the lower index (`replica_order`). The replicas are interchangeable to a router up to
      what their rows show, and in index order an MLP must learn "go where the prompt is
      cached" once per replica column; ranked, "go to rank 0 unless its load says
      otherwise" is one rule. A router that names replicas (every registered one) acts
      through `replica_policy` (or `action_for_replica`). The dynamics are those of the
      index-ordered environment. LLMPrefixRouting-v0 is registered ranked.
    """

    Static = LLMRoutingStatic  # static configuration (`env.static`; fields read as attributes)
    ENGINE = engines.CONTINUOUS  # the serving engine the shared routing step drives

    @property
    def num_gpus(self) -> int:
        """Alias of `num_replicas` (what routing helpers and `replay` read)."""
        return self.num_replicas

    @property
    def name(self) -> str:
        return "LLMPrefixRouting-v0" if self.prefix else "LLMRouting-v0"

    @property
    def prefix(self) -> bool:
        """Whether the replicas cache prefixes (`prefix_blocks > 0`)."""
        return self.prefix_blocks > 0

    @property
    def policy_kind(self) -> str:
        """The registry kind of the routers that act here: "prefix_routing" with prefix
        caching (`policies.prefix_routing`), "llm_routing" without (`policies.llm_routing`).
        Neither is in `envs.base.EVALUATED_KINDS`: the evaluation CLIs
        (`envs.base.policy_kind`) refuse both LLM routing environments."""
        return "prefix_routing" if self.prefix else "llm_routing"

    @property
    def num_replica_features(self) -> int:
        """Observation features per replica: 7, or 9 with prefix caching."""
        return NUM_REPLICA_FEATURES + (NUM_PREFIX_FEATURES if self.prefix else 0)

    @property
    def num_actions(self) -> int:
        return self.num_replicas

    @property
    def obs_layout(self) -> tuple[int, int, int]:
        return NUM_REQUEST_FEATURES, self.num_replicas, self.num_replica_features

    def check_params(self, params: common.ServingParams) -> None:
        """Raises ValueError (naming the field) if `params` do not fit this environment."""
        check_llm_params(params, self.num_replicas, self.queue_buffer, self.max_seqs)
        if self.prefix:
            check_prefix_params(params, self.prefix_blocks)

    def reset_env(self, key, params):
        k_phase, k_req = rng.split(key)
        phase = common.first_phase(k_phase, params)
        _, req, phase, _ = common.next_arrival(k_req, params, phase, jnp.int32(0), jnp.int32(0))
        slots = self.static.slo_slots
        state = LLMRoutingState(
            cluster=self.ENGINE.empty(
                self.num_replicas, self.queue_buffer, self.max_seqs,
                with_ids=self.log_capacity > 0 or slots > 0 or self.prefix,
                prefix_blocks=self.prefix_blocks if self.prefix else None),
            pending=req, phase=phase, trace_pos=jnp.int32(0), time=jnp.int32(0),
            log=self.ENGINE.empty_log(max(self.log_capacity, slots), prefix=self.prefix),
            backlog=jnp.float32(0.0),
            horizon=episode_horizon(jax.random.fold_in(key, 3), params),
            slo_busy=jnp.zeros((slots,), jnp.bool_), slo_output=jnp.zeros((slots,), jnp.float32))
        return self.get_obs(state, params), state

    def replica_order(self, state, params, hit=None) -> jax.Array:
        """`(R,)` int32: the replica at each rank (see `LLMRouting`, Ranked replicas):
        cached prefix blocks of the pending request descending (`hit`, when the caller has
        `pending_cached_blocks` already), then tokens in flight ascending, then index.
        Index order when not `ranked`."""
        r = jnp.arange(self.num_replicas, dtype=jnp.int32)
        if not self.ranked:
            return r
        if not self.prefix:
            hit = jnp.zeros((self.num_replicas,), jnp.int32)
        elif hit is None:
            hit = pending_cached_blocks(state, params)
        load = self.ENGINE.tokens_in_flight(state.cluster)
        # better[i, j]: replica j ranks before replica i; a replica's rank counts them.
        h_i, h_j, l_i, l_j = hit[:, None], hit[None, :], load[:, None], load[None, :]
        better = (h_j > h_i) | ((h_j == h_i) & ((l_j < l_i) | ((l_j == l_i)
                                                               & (r[None, :] < r[:, None]))))
        rank = better.sum(1).astype(jnp.int32)
        return jnp.zeros_like(r).at[rank].set(r)

    def action_for_replica(self, state, params, replica) -> jax.Array:
        """The action that routes the pending request to `replica` (its rank when
        `ranked`, else `replica` itself). int32."""
        replica = jnp.asarray(replica, jnp.int32)
        if not self.ranked:
            return replica
        return jnp.argmax(self.replica_order(state, params) == replica).astype(jnp.int32)

    def replica_policy(self, policy):
        """`policy(key, obs, state, params) -> replica` (every registered router names a
        replica) as a policy of this environment's actions: on a ranked environment the
        replica's rank (`action_for_replica`), otherwise `policy` itself. The routers read
        the state, not the observation's rows, so ranking changes nothing else for them."""
        if not self.ranked:
            return policy

        def ranked_policy(key, obs, state, params):
            return self.action_for_replica(state, params, policy(key, obs, state, params))
        return ranked_policy

    def step_env(self, key, state, action, params):
        replica, invalid = common.discrete_action(action, self.num_replicas)
        if self.ranked:
            replica = self.replica_order(state, params)[replica]
        slo = self.reward == "slo"
        routed, log0 = state.pending, state.log
        if slo:
            # The request takes a free log slot (its id in a replay), cleared of the last
            # occupant's times, so its TTFT and finish can be read when it finishes.
            slot = (jnp.argmin(state.slo_busy).astype(jnp.int32) if self.log_capacity == 0
                    else state.pending.req_id)
            nan = jnp.float32(jnp.nan)
            log0 = log0.replace(ttft=log0.ttft.at[slot].set(nan, mode="drop"),
                                e2e=log0.e2e.at[slot].set(nan, mode="drop"))
            routed = routed.replace(req_id=slot)
        tables = params.tables if self.prefix else None
        node = pending_node(state, params) if self.prefix else None
        st = route_and_advance(self.ENGINE, key, params, state.cluster, state.pending, replica,
                               invalid, state.phase, state.trace_pos, log0, routed=routed,
                               route_kw=dict(node=node, tables=tables),
                               advance_kw=dict(tables=tables))
        cluster, req, metrics, extra, log = st.cluster, st.pending, st.metrics, st.extras, st.log
        busy, out = state.slo_busy, state.slo_output
        if slo:
            out = out.at[slot].set(state.pending.output, mode="drop")
            done = jnp.isfinite(log.e2e) & ~jnp.isfinite(log0.e2e)
            met = done & slo_attained(log.ttft, log.e2e, out, params)
            busy = busy.at[slot].set(~st.dropped, mode="drop") & ~done
            missed = (done.sum() - met.sum()).astype(jnp.int32)
            extra = {**extra, "slo_attained": met.sum().astype(jnp.int32),
                     "slo_missed": missed}
            cost = params.slo_miss_s * missed + params.drop_penalty_s * metrics.dropped
            reward = (-cost / params.latency_scale).astype(jnp.float32)
        else:
            reward = common.reward_from(metrics, params)
        backlog, added = jnp.float32(0.0), None
        if self.shaping_gamma is not None and slo:
            backlog = params.slo_miss_s * self.ENGINE.expected_slo_misses(
                cluster, params.gpus, params.slo_ttft_s, params.slo_tpot_s)
        elif self.shaping_gamma is not None:
            # The potential and the next observation's marginal-backlog feature read the same
            # cluster: one pass of their shared pairwise term.
            with jax.named_scope("estimates"):
                backlog, added = self.ENGINE.backlog_and_marginal(cluster, params.gpus, req.prompt,
                                                         jnp.maximum(req.estimate, 1.0))
        reward = common.shaped_reward(reward, state.backlog, backlog, self.shaping_gamma, params)
        state = LLMRoutingState(cluster=cluster, pending=req, phase=st.phase,
                                trace_pos=st.trace_pos, time=state.time + 1, log=log,
                                backlog=backlog, horizon=state.horizon, slo_busy=busy,
                                slo_output=out)
        return (self._observe(state, params, added), state, reward, st.exhausted,
                {**metrics.as_dict(), **extra})

    def get_obs(self, state, params=None, key=None):
        return self._observe(state, params)

    def _observe(self, state, params, added=None):
        """`get_obs`, with the marginal-backlog feature's input `added` when the step has it."""
        rows = replica_features(state.cluster, state.pending, params, added)
        # The pending prompt's cached blocks feed both the prefix features and the ranking:
        # one lookup (a walk of the prefix tree per replica).
        hit = pending_cached_blocks(state, params) if self.prefix else None
        if self.prefix:
            rows = jnp.concatenate([rows, prefix_features(state, params, hit)], axis=-1)
        if self.ranked:
            rows = rows[self.replica_order(state, params, hit)]
        return jnp.concatenate([common.request_features(state.pending, params), rows.ravel()])

    def is_terminated(self, state, params):
        tr = params.trace
        return jnp.bool_(tr.gap.shape[0] > 0) & (state.trace_pos >= tr.length)

    def is_truncated(self, state, params):
        """After `state.horizon` decisions (see `LLMRouting`, Truncation)."""
        return state.time >= state.horizon

    def action_space(self, params=None):
        return spaces.Discrete(self.num_replicas)

    def observation_space(self, params=None):
        n = NUM_REQUEST_FEATURES + self.num_replicas * self.num_replica_features
        return feature_box((n,))

    def state_space(self, params=None) -> Any:
        raise NotImplementedError(f"{self.name} exposes its state as the LLMRoutingState pytree")


def pending_node(state: LLMRoutingState, params: PrefixRoutingParams) -> jax.Array:
    """The pending request's deepest prefix-tree node: `params.node` at its trace row, -1
    without a trace (synthetic arrivals share nothing). int32."""
    rows = params.node.shape[0]
    if rows == 0:
        return jnp.int32(-1)
    return params.node[jnp.minimum(state.trace_pos, rows - 1)].astype(jnp.int32)


def pending_cached_blocks(state: LLMRoutingState, params: PrefixRoutingParams) -> jax.Array:
    """Per replica, the pending request's leading prompt blocks cached there now
    (`continuous.cached_prefix_blocks`): what a cache-aware router learns from the replicas'
    KV events. `(R,)` int32 blocks of each replica's `block_size`."""
    return engines.CONTINUOUS.cached_prefix_blocks(state.cluster, params.gpus, params.tables,
                                                   pending_node(state, params),
                                                   state.pending.prompt)


def prefix_features(state: LLMRoutingState, params: PrefixRoutingParams,
                    hit: jax.Array | None = None) -> jax.Array:
    """The per-replica prefix features, `(num_replicas, 2)`: cached fraction of the pending
    request's prompt, and cached-unreferenced blocks / kv_blocks (see `LLMRouting`). `hit`:
    `pending_cached_blocks(state, params)` when the caller has it."""
    prof = params.gpus
    if hit is None:
        hit = pending_cached_blocks(state, params)
    hit = hit * prof.block_size
    unref = engines.CONTINUOUS.block_accounting(state.cluster, prof)["cached_unreferenced"]
    rows = jnp.stack([hit / jnp.maximum(state.pending.prompt, 1.0),
                      unref / prof.kv_blocks.astype(jnp.float32)], axis=-1)
    return clip_features(jnp.minimum(rows, 1.0))


def slo_attained(ttft, e2e, output, params: common.ServingParams) -> jax.Array:
    """Whether finished requests met both SLO targets: TTFT <= `slo_ttft_s` and, with more
    than one output token, TPOT `(e2e - ttft) / (output - 1)` <= `slo_tpot_s` (the definition
    of `evaluation.llm_metrics.slo_attainment`). Times in s, `output` in tokens."""
    tpot = (e2e - ttft) / jnp.maximum(output - 1.0, 1.0)
    return (ttft <= params.slo_ttft_s) & ((output <= 1.0) | (tpot <= params.slo_tpot_s))


def episode_horizon(key: jax.Array, params: common.ServingParams) -> jax.Array:
    """Decisions before truncation, uniform on `[ceil(L / 2), L]` (`L = max_steps_in_episode`)
    with synthetic arrivals, so vmapped episodes drift out of lockstep; `L` with a trace (its
    episodes end with the trace). int32."""
    top = jnp.asarray(params.max_steps_in_episode, jnp.int32)
    low = (top + 1) // 2
    drawn = jax.random.randint(key, (), low, top + 1, dtype=jnp.int32)
    return jnp.where(params.trace.gap.shape[0] > 0, top, drawn)


def replica_features(rep: CB.Replicas, pending: Request, params: common.ServingParams,
                     added: jax.Array | None = None) -> jax.Array:
    """The per-replica observation rows, `(num_replicas, 7)`; see `LLMRouting`'s docstring.
    `added`: `continuous_load.marginal_backlog` of the pending request, if already computed."""
    eng, prof = engines.CONTINUOUS, params.gpus
    kv = prof.kv_blocks.astype(jnp.float32)
    if added is None:
        added = eng.marginal_backlog(rep, prof, pending.prompt,
                                     jnp.maximum(pending.estimate, 1.0))
    added = jnp.maximum(added, 1e-6)
    ts = params.time_scale
    rows = jnp.stack([
        rep.queues.count / jnp.maximum(prof.queue_cap, 1),
        rep.run.count / jnp.maximum(prof.max_seqs, 1),
        eng.kv_used(rep, prof) / kv,
        jnp.log1p(eng.tokens_in_flight(rep) / (kv * prof.block_size)),
        jnp.log1p(eng.work(rep, prof) / ts),
        jnp.log1p(added / ts),
        jnp.log(added / added.min()),
    ], axis=-1)
    return clip_features(rows)


def check_llm_params(params: common.ServingParams, num_replicas: int, queue_buffer: int,
                     max_seqs: int) -> None:
    """Host-side checks of LLMRouting-v0 params against the environment's static sizes:
    `params.gpus` must be a stacked `ReplicaProfile` of `num_replicas` replicas whose
    `max_seqs` fit the static running slots (`common.validate_params` checks the profile as
    the type it is, and the rest of `ServingParams`), and the engine's int32 token sums must
    not overflow (`common.check_token_headroom`)."""
    if not isinstance(params.gpus, ReplicaProfile):
        raise ValueError(f"params.gpus must be a stacked ReplicaProfile (core.replica."
                         f"stack_replicas), got {type(params.gpus).__name__}")
    common.validate_params(params, queue_buffer, max_seqs, num_replicas)
    common.check_token_headroom(params, params.gpus.block_size, max_seqs)


def check_prefix_params(params, prefix_blocks: int) -> None:
    """Host-side checks of LLMPrefixRouting-v0 params (ValueError naming the field)."""
    if not isinstance(params, PrefixRoutingParams):
        raise ValueError(f"params must be PrefixRoutingParams with prefix caching, got "
                         f"{type(params).__name__}")
    kv = np.asarray(params.gpus.kv_blocks)
    if np.any(kv > prefix_blocks):
        raise ValueError(f"params.gpus.kv_blocks {kv} exceeds the static prefix_blocks "
                         f"({prefix_blocks}); rebuild the environment with a larger one")
    tab = params.tables
    if not isinstance(tab, CB.PrefixTables):
        raise ValueError("params.tables must be continuous.PrefixTables")
    bs = np.asarray(params.gpus.block_size)
    if np.any(tab.block_tokens % bs):
        raise ValueError(f"params.tables.block_tokens ({tab.block_tokens}) must be a multiple "
                         f"of every replica's block_size, got {bs.tolist()}")
    node = np.asarray(params.node)
    rows = np.shape(params.trace.gap)[-1]
    if node.shape[-1:] != (rows,) or not np.issubdtype(node.dtype, np.integer):
        raise ValueError(f"params.node must be ({rows},) integers (one per trace row), got "
                         f"{node.shape} {node.dtype}")
    nodes = np.shape(tab.parent)[-1]
    if np.any((node < -1) | (node >= nodes)):
        raise ValueError(f"params.node must hold tree nodes in [-1, {nodes})")


# ---- LLMRouting-v0's scenario and builder (registered in `envs.registry`)

def llm_routing_replicas():
    """Default LLMRouting-v0 cluster: two OPT-13B replicas on A100-80GB, two on A100-40GB.

    Same DistServe iteration-time fit; the 40 GB cards hold a fifth of the KV cache
    (`core/replica.py`, docs/continuous.md), so memory, not speed, separates them.
    """

    return [replica_profile("opt13b-a100-80g")] * 2 + [replica_profile("opt13b-a100-40g")] * 2


# LLMRouting-v0's defaults over `ServingParams`' shared field defaults (`envs.common`: the
# shared reward scales, size-class estimates, 512 decisions), under the caller's keywords.
# A callable is called per build.
LLM_ROUTING_DEFAULTS = dict(
    replicas=llm_routing_replicas,
    arrival_rate=16.0,  # req/s, when neither arrivals= nor arrival_rate= is given
    tokens=routing_tokens,
    slo_s=20.0,
)


def make_llm_routing(replicas=None, queue_buffer=None, max_seqs=None, arrival_rate=None,
                     arrivals=None, shaping_gamma=DEFAULT_SHAPING_GAMMA,
                     reward="time_in_system", **kw):
    """LLMRouting-v0: heterogeneous continuous-batching replicas (KV cache, preemption).

    `replicas`: list of `ReplicaProfile`; `max_seqs` (static running slots) defaults to the
    largest `max_seqs` of the replicas, `queue_buffer` to the largest `queue_cap`.
    Reward defaults as Routing-v0's, for the same reason (a standard PPO learns on them,
    tests/test_llm_learnable.py): shaped with `shaping_gamma=0.99` (None turns it off), a
    drop costs `drop_penalty_s=600` s, rewards in units of `latency_scale=1000` s.
    `reward="slo"` charges TTFT/TPOT SLO misses instead of time-in-system (`LLMRouting`).
    Other defaults: `LLM_ROUTING_DEFAULTS`.
    """

    refuse_gpus("LLMRouting-v0", kw)
    d = LLM_ROUTING_DEFAULTS
    replicas = d["replicas"]() if replicas is None else list(replicas)
    prof = stack_replicas(replicas)
    if arrivals is None and arrival_rate is None:
        arrival_rate = d["arrival_rate"]
    fill_defaults(kw, d, exclude=("replicas", "arrival_rate"))
    params = build_params(prof, arrivals=arrivals, arrival_rate=arrival_rate, **kw)
    qb, ms = replica_sizes(prof, queue_buffer, max_seqs)
    env = LLMRouting(num_replicas=len(replicas), queue_buffer=qb, max_seqs=ms,
                     trace_len=params.trace.gap.shape[0], default=params,
                     shaping_gamma=shaping_gamma, reward=reward)
    env.check_params(params)
    return env, params
