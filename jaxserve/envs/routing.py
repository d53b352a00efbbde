"""Routing-v0: route each arriving request to one GPU of a heterogeneous cluster."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from gymnax.environments import environment, spaces

from jaxserve.core import cluster as C
from jaxserve.core import engines
from jaxserve.core.queues import Request
from jaxserve.core.service import single_request_time
from jaxserve.core.static_load import mean_estimate_held
from jaxserve.core import arrivals as A
from jaxserve.core.profiles import get_profile
from jaxserve.core.types import GPUProfile
from jaxserve.envs import common
from jaxserve.envs.base import StaticConfig, check_sizes, clip_features, feature_box
from jaxserve.envs.defaults import (ROUTING_ESTIMATE_MODE, ROUTING_ESTIMATE_NOISE, build_params,
                                    fill_defaults, static_sizes)
from jaxserve.envs.routing_step import route_and_advance

NUM_REQUEST_FEATURES = 3
NUM_GPU_FEATURES = 6
# Short names of the observation's features, in its order (`Routing`, Observation).
REQUEST_FEATURE_NAMES = ("prompt", "estimate", "size_class")
GPU_FEATURE_NAMES = ("waiting", "running", "batch_left", "queued_work", "speed",
                     "mean_estimate")
DEFAULT_SHAPING_GAMMA = 0.99  # PureJaxRL's discount; see `Routing` (Reward)


@struct.dataclass
class RoutingState:
    """State of a Routing-v0 episode; times relative to the pending request's arrival (t = 0).

    Attributes:
      cluster: queues and running batches of every GPU.
      pending: the request awaiting its routing decision.
      phase: arrival-process phase. int32.
      trace_pos: trace row of the pending request. int32.
      time: decisions taken this episode (gymnax's step counter). int32.
      log: per-request schedule of the episode's first `log_capacity` requests (empty unless
        the environment was built with a log, as `replay` and `evaluate` do).
      backlog: `engines.STATIC.backlog(cluster)` (`core.static_load.expected_backlog`, s),
        the shaping potential's input, kept so a step reads the potential before it instead
        of scanning the queues again (0 without shaping). float32.
    """

    cluster: C.Cluster
    pending: Request
    phase: jax.Array
    trace_pos: jax.Array
    time: jax.Array
    log: C.RequestLog
    backlog: jax.Array


@dataclasses.dataclass(frozen=True)
class RoutingStatic:
    """Static configuration of Routing-v0 (`envs.base.StaticConfig`).

    Attributes:
      num_gpus: GPUs in the cluster (the action space's size), >= 1.
      queue_buffer: queue slots per GPU (>= every `params.gpus.queue_cap`), >= 1.
      max_batch: running-batch slots per GPU (>= every `params.gpus.max_batch`), >= 1.
      trace_len: rows of a replayed trace (0: synthetic arrivals).
      log_capacity: requests kept in the per-request log (0: no log).
      shaping_gamma: discount of the potential-based reward shaping, in [0, 1], or None (no
        shaping). A Python number because it selects the reward's form.
    """

    num_gpus: int
    queue_buffer: int = 64
    max_batch: int = 16
    trace_len: int = 0
    log_capacity: int = 0
    shaping_gamma: float | None = DEFAULT_SHAPING_GAMMA

    def __post_init__(self):
        check_sizes(self, positive=("num_gpus",), nonnegative=("trace_len", "log_capacity"),
                    slots=("queue_buffer", "max_batch"))
        object.__setattr__(self, "shaping_gamma", common.check_shaping_gamma(self.shaping_gamma))


class Routing(StaticConfig, environment.Environment[RoutingState, common.ServingParams]):
    """Route every arriving request to a GPU; each GPU runs the static batcher.

    Decision epochs: each request arrival (one decision per request). Between arrivals the
    cluster evolves exactly (event-driven) under the static batcher of each GPU. A step is
    the routing skeleton LLMRouting-v0 shares (`envs.routing_step.route_and_advance`): the
    pending request joins the chosen GPU's queue (or is dropped), the next request is drawn,
    the cluster runs to its arrival and the clock origin moves there.

    Observation: float32 `(3 + num_gpus * 6,)`, every feature O(1) (in [0, 1], or a
      `log1p` of a time in units of `time_scale`, ~2.4 for 10x `time_scale`), and built only
      from what a scheduler knows (prompts, output *estimates*, counts, `Servers.est_end`),
      never the true output lengths or the true end of a running batch (`free_at`):
      - `[0:3]` the arriving request: `log1p(prompt)/log1p(max_prompt)`,
        `log1p(estimate)/log1p(max_output)`, size class / (classes - 1). The estimate is the true
        output length, a noisy one or the class's representative, per `estimate_mode`.
      - `[3:]` one row of 6 per GPU (row-major `(num_gpus, 6)`): waiting / queue_cap,
        running / max_batch, `log1p(expected time until the running batch ends / time_scale)`
        (from `est_end`; 0 once the batch has outlived its estimate),
        `log1p(queued work / time_scale)` (`cluster.queued_work`, from estimates), relative
        speed (fastest GPU's time for a reference request / this GPU's, in (0, 1]), and the
        mean output estimate of the GPU's requests (waiting + running),
        `log1p(mean)/log1p(max_output)`: where long requests sit, i.e. where a short one would
        be blocked behind them.
      `obs_layout` gives `(3, num_gpus, 6)` for networks that reshape it.
    Action: `Discrete(num_gpus)`, the GPU index. An action that is not an integer in
      `[0, num_gpus)` (out of range, non-integral or non-finite) is counted in
      `info["invalid_actions"]` and mapped deterministically (`common.discrete_action`:
      clipped into range, a float floored, NaN to 0).
    Reward: the cost `-(time-in-system during the step + drop_penalty_s * drops) /
      latency_scale` (`common.reward_from`) plus, when `shaping_gamma` is not None (the
      default, 0.99), the potential-based shaping term `shaping_gamma * phi(s') - phi(s)`
      (Ng, Harada and Russell, 1999) with `phi = -expected_backlog / latency_scale`
      (`core.static_load.expected_backlog`: the expected remaining time-in-system of the
      requests present, from output estimates). The shaped step reward is about minus the latency the routed
      request will see plus the delay it adds to those queued with it, paid at the decision
      instead of over the following minute, so a standard PPO can assign credit. Shaping
      leaves the optimal policy of the `shaping_gamma`-discounted objective unchanged (so
      train with that discount, PureJaxRL's 0.99 by default); summed over an episode with
      `shaping_gamma = 1` it adds only `phi(last) - phi(first)`. Evaluation never reads the
      reward: latencies come from the request log.
    Termination: only with a replayed trace, after its last request (the step then drains the
      cluster, so the return counts every request's whole latency). Truncation after
      `max_steps_in_episode` decisions.
    State: `RoutingState`.
    Randomness: a step draws the next request (tokens, estimate, Poisson gap) from one PRNG
      call on its key (`common.request_uniforms`), and `step` takes the auto-reset's first
      request from the same uniforms: with synthetic arrivals the new episode's first request
      is the one the terminal state shows as pending (never served); with a trace its tokens
      are row 0's. So `step(key, ...)` equals `step_env(key, ...)` when the episode goes on,
      and `reset_env(key, ...)` after a reset. A multi-phase MMPP also draws the gap and the
      reset phase from `fold_in(key, 1)` and `fold_in(key, 2)`.

    Static configuration: `RoutingStatic` (`env.static`; its fields read as attributes):
    `num_gpus`, `queue_buffer`, `max_batch`, `trace_len`, `log_capacity` (shapes), and
    `shaping_gamma` (set with `jaxserve.make(..., shaping_gamma=...)`).
    """

    policy_kind = "routing"  # registered policies that act here (envs.base)
    Static = RoutingStatic
    ENGINE = engines.STATIC  # the serving engine the shared routing step drives

    @property
    def name(self) -> str:
        return "Routing-v0"

    @property
    def num_actions(self) -> int:
        return self.num_gpus

    @property
    def obs_layout(self) -> tuple[int, int, int]:
        """(request features, GPUs, features per GPU) of the flat observation."""
        return NUM_REQUEST_FEATURES, self.num_gpus, NUM_GPU_FEATURES

    @property
    def feature_names(self) -> tuple[str, ...]:
        """A short name per flat observation feature: the request's, then `gpu{g}.<name>`."""
        return REQUEST_FEATURE_NAMES + tuple(f"gpu{g}.{n}" for g in range(self.num_gpus)
                                             for n in GPU_FEATURE_NAMES)

    def reset_env(self, key, params):
        return self._reset(key, common.request_uniforms(key), params)

    def step_env(self, key, state, action, params):
        return self._step(key, common.request_uniforms(key), state, action, params)

    def step_and_reset(self, key, state, action, params):
        """One PRNG call per step: the step's next request and the auto-reset's first request
        come from the same uniforms (see `Routing`, Randomness)."""
        u = common.request_uniforms(key)
        return self._step(key, u, state, action, params), self._reset(key, u, params)

    def _reset(self, key, u, params):
        # A multi-phase MMPP draws its phase from its own key; Poisson draws nothing.
        phase = common.first_phase(key, params, salt=2)
        _, req, phase, _ = common.next_arrival(key, params, phase, jnp.int32(0), jnp.int32(0),
                                               u=u)
        state = RoutingState(cluster=self.ENGINE.empty(
                                 self.num_gpus, self.queue_buffer, self.max_batch,
                                 with_ids=self.log_capacity > 0),
                             pending=req, phase=phase, trace_pos=jnp.int32(0),
                             time=jnp.int32(0), log=self.ENGINE.empty_log(self.log_capacity),
                             backlog=jnp.float32(0.0))
        return self.get_obs(state, params), state

    def _step(self, key, u, state, action, params):
        gpu, invalid = common.discrete_action(action, self.num_gpus)
        st = route_and_advance(self.ENGINE, key, params, state.cluster, state.pending, gpu,
                               invalid, state.phase, state.trace_pos, state.log, u=u)
        reward = common.reward_from(st.metrics, params)
        backlog = jnp.float32(0.0)
        if self.shaping_gamma is not None:
            backlog = self.ENGINE.backlog(st.cluster, params.gpus)
        reward = common.shaped_reward(reward, state.backlog, backlog, self.shaping_gamma, params)
        state = RoutingState(cluster=st.cluster, pending=st.pending, phase=st.phase,
                             trace_pos=st.trace_pos, time=state.time + 1, log=st.log,
                             backlog=backlog)
        return (self.get_obs(state, params), state, reward, st.exhausted,
                {**st.metrics.as_dict(), **st.extras})

    def get_obs(self, state, params=None, key=None):
        return routing_observation(state.cluster, state.pending, params)

    def is_terminated(self, state, params):
        tr = params.trace
        return jnp.bool_(tr.gap.shape[0] > 0) & (state.trace_pos >= tr.length)

    def action_space(self, params=None):
        return spaces.Discrete(self.num_gpus)

    def observation_space(self, params=None):
        n = NUM_REQUEST_FEATURES + self.num_gpus * NUM_GPU_FEATURES
        return feature_box((n,))

    def state_space(self, params=None) -> Any:
        raise NotImplementedError("Routing-v0 exposes its state as the RoutingState pytree")


def gpu_features(cluster: C.Cluster, params: common.ServingParams) -> jax.Array:
    """The per-GPU observation rows, `(num_gpus, 6)`; see `Routing`'s docstring."""
    gpus, q, s = params.gpus, cluster.queues, cluster.servers
    ts = params.time_scale
    ref = single_request_time(gpus, 512.0, 128.0)
    waiting = q.count.astype(jnp.float32)
    running = s.run_count.astype(jnp.float32)
    mean_estimate = mean_estimate_held(cluster)
    rows = jnp.stack([
        waiting / jnp.maximum(gpus.queue_cap, 1),
        running / jnp.maximum(gpus.max_batch, 1),
        jnp.log1p(jnp.where(s.run_count > 0, jnp.maximum(s.est_end, 0.0), 0.0) / ts),
        jnp.log1p(engines.STATIC.work(cluster, gpus) / ts),
        ref.min() / ref,
        jnp.log1p(mean_estimate) / jnp.log1p(params.tokens.max_output),
    ], axis=-1)
    return clip_features(rows)


def routing_observation(cluster: C.Cluster, pending: Request, params) -> jax.Array:
    """Flat Routing-v0 observation: request features then GPU rows."""
    return jnp.concatenate([common.request_features(pending, params),
                            gpu_features(cluster, params).ravel()])


# ---- Routing-v0's scenarios and builder (registered in `envs.registry`)

def routing_gpus() -> list[GPUProfile]:
    """Default Routing-v0 cluster: two fast and two slow replicas of Llama-2-70B.

    Fast: H100 x4 (tensor parallel); slow: A100 x2. Coefficients are fits to Splitwise's
    measured profiles (`core/profiles.py`, docs/profiles.md).
    """
    return [get_profile("fast")] * 2 + [get_profile("slow")] * 2


def routing_tokens() -> A.TokenDist:
    """Default Routing-v0 workload: 80% short (256 -> 32 tokens), 20% long (1024 -> 512).

    A batch runs until its longest output is done, so a short request batched with a long one
    waits ~15x longer than alone: head-of-line blocking is what a router must avoid.
    """
    return A.bimodal_tokens(long_frac=0.2, short=(256, 32), long=(1024, 512), sigma=0.3,
                            max_prompt=8192, max_output=2048)



def _bursty_arrivals(mean_rate: float, ratio: float = 5.0, high_frac: float = 0.15,
                     mean_high_s: float = 60.0) -> A.ArrivalProcess:
    """Two-phase MMPP of mean `mean_rate` (req/s): a fraction `high_frac` of the time at
    `ratio` times the low phase's rate, high phases lasting `mean_high_s` on average."""
    low = mean_rate / (1.0 - high_frac + high_frac * ratio)
    leave_high = 1.0 / mean_high_s
    return A.mmpp([low, low * ratio], (leave_high * high_frac / (1.0 - high_frac), leave_high))


def short_bursts_tokens() -> A.TokenDist:
    """The `short_bursts` scenario's request mix: Routing-v0's two classes (32 and 512 output
    tokens, sigma 0.3), one prompt law for both (median 512 tokens, sigma 0.5), and a class
    mix per arrival phase: 40% long in the quiet phase, none in bursts.

    The prompt says nothing of the output length, as in real LLM traces: on Azure's 2023 LLM
    inference traces (../shared/traces/azure_llm_2023) the correlation of log prompt and
    log output is -0.005 (code, 8819 requests) and 0.087 (conversation, 19366; Pearson over
    every row, `np.corrcoef(np.log(ContextTokens), np.log(GeneratedTokens))`), while in the
    default mix (256- vs 1024-token prompts) the prompt gives the class away; so the noisy
    estimate is the router's only size signal here.
    """
    base = A.class_mixture([0.8, 0.2], [512, 512], [0.5, 0.5], [32, 512], [0.3, 0.3],
                           max_prompt=8192, max_output=2048)
    return A.with_phase_weights(base, [[0.6, 0.4], [1.0, 0.0]])


# Routing-v0's defaults over `ServingParams`' shared field defaults (`envs.common`): under
# a scenario's overrides and the caller's keywords. A callable is called per build. The
# reward scales (drop_penalty_s 600, latency_scale 1000) are the shared ones.
ROUTING_DEFAULTS = dict(
    gpus=routing_gpus,
    arrival_rate=2.0,  # req/s, when neither arrivals= nor arrival_rate= is given
    tokens=routing_tokens,
    # A long request alone takes ~15 s on a fast replica and ~29 s on a slow one.
    slo_s=40.0,
    # Routers see a noisy output-length prediction (`envs.defaults.ROUTING_ESTIMATE_NOISE`).
    estimate_mode=ROUTING_ESTIMATE_MODE,
    estimate_noise=ROUTING_ESTIMATE_NOISE,
)

# Registered Routing-v0 scenarios, `make("Routing-v0", scenario=name)` (explicit overrides
# still win). Rates are fractions (`load`) of the cluster's full-batch capacity for the
# scenario's mix (`capacity`, req/s: `evaluation.capacity.service_capacity`; envs cannot
# import evaluation, so it is a number). All keep queue_buffer 64, so the scenarios whose
# parameters have equal shapes train in one program (docs/results.md (w)).
ROUTING_CAPACITY_DEFAULT = 2.163
ROUTING_CAPACITY_SHORT_BURSTS = 2.199
ROUTING_SCENARIOS = {
    "bursty": dict(
        load=0.6, capacity=ROUTING_CAPACITY_DEFAULT,
        reason="Bursty load: the default cluster and mix at mean load 0.6, 15% of the time "
               "in bursts at 5x the quiet rate (quiet phase load 0.38, bursts 1.9: overload), "
               "bursts lasting 60 s on average. SITA's partition is fitted for the mean rate; "
               "a router that reads the queues can shed a burst across groups.",
        overrides=lambda: dict(arrivals=_bursty_arrivals(0.6 * ROUTING_CAPACITY_DEFAULT))),
    "bursty_short_queues": dict(
        load=0.6, capacity=ROUTING_CAPACITY_DEFAULT,
        reason="As `bursty`, with 16 queue slots per GPU (a latency-oriented admission "
               "limit) instead of 64: bursts overflow queues, so where a router puts a "
               "request decides whether it is dropped.",
        overrides=lambda: dict(arrivals=_bursty_arrivals(0.6 * ROUTING_CAPACITY_DEFAULT),
                               gpus=[get_profile(t, queue_cap=16)
                                     for t in ("fast", "fast", "slow", "slow")],
                               queue_buffer=64)),
    "short_bursts": dict(
        load=0.6, capacity=ROUTING_CAPACITY_SHORT_BURSTS,
        reason="Non-stationary mix with realistic information: in the quiet phase 40% of "
               "requests are long; bursts (30% of the time, 3x the quiet rate, lasting 120 s "
               "on average) bring short requests only. Mean load 0.6 of capacity. Prompts "
               "say nothing of output length (as in Azure's LLM traces), so routers size "
               "requests by the noisy estimate alone. SITA is fitted to the average mix (17.5% "
               "long), which is wrong in both phases; a router that reads the queues can see "
               "when the fast GPUs hold no long requests and send short ones there.",
        overrides=lambda: dict(
            arrivals=_bursty_arrivals(0.6 * ROUTING_CAPACITY_SHORT_BURSTS, ratio=3.0,
                                      high_frac=0.3, mean_high_s=120.0),
            tokens=short_bursts_tokens())),
}


def make_routing(gpus=None, queue_buffer=None, arrival_rate=None, arrivals=None,
                 shaping_gamma=DEFAULT_SHAPING_GAMMA, scenario=None, **kw):
    """Routing-v0: heterogeneous GPUs, bimodal short/long requests (head-of-line blocking).

    Defaults chosen so that a standard PPO (PureJaxRL's CartPole settings, MLP on the flat
    observation, no reward normalisation) learns on them (tests/test_learnable.py,
    docs/training.md): reward shaped with `shaping_gamma=0.99` (potential-based, see
    `Routing`; None turns it off), a drop costs `drop_penalty_s=600` s (15x the SLO, more
    than any latency the default load produces, so shedding is never cheaper than serving),
    rewards in units of `latency_scale=1000` s. With the shaping a step's reward is about
    minus the routed request's latency (plus the delay it adds to others) over 1000 s, so the
    discounted return over ~100 steps is O(1): PureJaxRL clips the gradient norm of actor and
    critic together, and value targets of hundreds (latency_scale 10 or 100) starve the actor.
    Routers (learned and heuristic alike) see a noisy output-length prediction
    (`estimate_mode=1`, `estimate_noise=1.0`: see `ROUTING_ESTIMATE_NOISE`), not the true
    size class; pass `estimate_mode=2` for that oracle. `scenario` names an entry of
    `ROUTING_SCENARIOS` (its overrides under the explicit ones, over `ROUTING_DEFAULTS`).
    """
    if scenario is not None:
        if scenario not in ROUTING_SCENARIOS:
            raise ValueError(f"unknown Routing-v0 scenario {scenario!r}; registered: "
                             f"{sorted(ROUTING_SCENARIOS)}")
        given = dict(gpus=gpus, queue_buffer=queue_buffer, arrival_rate=arrival_rate,
                     arrivals=arrivals)
        for k, v in ROUTING_SCENARIOS[scenario]["overrides"]().items():
            if k in given:
                if given[k] is None and not (k == "arrivals" and arrival_rate is not None):
                    given[k] = v
            else:
                kw.setdefault(k, v)
        gpus, queue_buffer = given["gpus"], given["queue_buffer"]
        arrival_rate, arrivals = given["arrival_rate"], given["arrivals"]
    gpus = ROUTING_DEFAULTS["gpus"]() if gpus is None else list(gpus)
    if arrivals is None and arrival_rate is None:
        arrival_rate = ROUTING_DEFAULTS["arrival_rate"]
    fill_defaults(kw, ROUTING_DEFAULTS, exclude=("gpus", "arrival_rate"))
    params = build_params(gpus, arrivals=arrivals, arrival_rate=arrival_rate, **kw)
    qb, mb = static_sizes(queue_buffer, params)
    env = Routing(num_gpus=len(gpus), queue_buffer=qb, max_batch=mb,
                  trace_len=params.trace.gap.shape[0], default=params,
                  shaping_gamma=shaping_gamma)
    return env, params
