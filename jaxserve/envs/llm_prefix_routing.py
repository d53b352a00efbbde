"""LLMPrefixRouting-v0: LLMRouting-v0 with automatic prefix caching, driven by a trace with
prefix identity; its default cluster, workloads and builder (`jaxserve.make` builds it)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxserve.core import arrivals as A
from jaxserve.core import continuous as CB
from jaxserve.core.replica import _OPT13B_WEIGHTS_GB, kv_blocks_for, replica_profile, stack_replicas
from jaxserve.envs.defaults import (ROUTING_ESTIMATE_MODE, ROUTING_ESTIMATE_NOISE, build_params,
                                    fill_defaults, refuse_gpus, replica_sizes)
from jaxserve.envs.llm_routing import LLMRouting, PrefixRoutingParams
from jaxserve.traces.mooncake import load_mooncake
from jaxserve.traces.prefix import PrefixTrace, validate_prefix_trace
from jaxserve.traces.prefix_synthetic import SharedPrefixConfig, generate_shared_prefix


def prefix_replicas():
    """Default LLMPrefixRouting-v0 cluster: four OPT-13B replicas on A100-40GB (DistServe's
    iteration-time fit, `core/replica.py`), KV memory counted in 128-token blocks: the
    40 GB card's 10,112 tokens (`kv_blocks_for(..., block_size=128)` = 79 blocks), so a
    long-context prompt (median ~5k tokens here) takes half a replica's cache and memory
    binds. 128-token blocks (vLLM uses 16) keep the prefix engine's `O(M^2)` lookup cheap;
    the cost is rounding up to 127 tokens per request where vLLM wastes at most 15. 16
    running and 16 waiting slots (scheduler settings, not measurements)."""

    kv = kv_blocks_for(40, 5120, 40.0, _OPT13B_WEIGHTS_GB, block_size=PREFIX_BLOCK_SIZE)
    return [replica_profile("opt13b-a100-40g", block_size=PREFIX_BLOCK_SIZE, kv_blocks=kv,
                            max_seqs=16, queue_cap=16)] * 4


PREFIX_BLOCK_SIZE = 128
PREFIX_REQUESTS = 512  # requests of the default synthetic trace (one episode)
PREFIX_SEED = 0
PREFIX_SCENARIO = "system_prompts"  # the registered workload: where affinity pays


def prefix_workload(n_requests: int = PREFIX_REQUESTS, seed: int = PREFIX_SEED,
                    scenario: str = PREFIX_SCENARIO):
    """An LLMPrefixRouting-v0 workload: `traces.prefix_synthetic.generate_shared_prefix`
    (host numpy) with the `SharedPrefixConfig` of `PREFIX_SCENARIOS[scenario]`.

    "system_prompts" (the default, `PREFIX_SCENARIO`): eight long shared system prompts,
    short user inputs (`PREFIX_SCENARIOS` gives the reasons). "sessions": Mooncake-like
    sessions (the generator's defaults: one 512-token system prompt, multi-turn
    conversations, first-turn user input median 5,500 tokens) except `max_prompt = 8192`
    (a session ends when its conversation outgrows a replica's cache) and `session_rate =
    PREFIX_SESSION_RATE` sessions/s, at which four default replicas' KV caches are mostly
    full. Raises ValueError for an unknown scenario."""

    if scenario not in PREFIX_SCENARIOS:
        raise ValueError(f"unknown LLMPrefixRouting-v0 scenario {scenario!r}; known: "
                         f"{sorted(PREFIX_SCENARIOS)}")
    cfg = SharedPrefixConfig(**PREFIX_SCENARIOS[scenario]["config"])
    return generate_shared_prefix(int(n_requests), cfg, seed=int(seed))


PREFIX_SESSION_RATE = 0.5
# Workloads of LLMPrefixRouting-v0 by name: `SharedPrefixConfig` fields and why each exists.
PREFIX_SCENARIOS = {
    "sessions": dict(
        config=dict(session_rate=PREFIX_SESSION_RATE, max_prompt=8192),
        reason="Mooncake-like multi-turn sessions behind one short system prompt: reuse is "
               "mostly a session's own history, and load balance matters about as much as "
               "affinity (round robin within 9% of the best router, docs/prefix_caching.md)."),
    "system_prompts": dict(
        config=dict(session_rate=1.5, num_system=8, system_tokens=4096, system_zipf=1.0,
                    first_user_median=300.0, first_user_sigma=1.0, turns_mean=1.0,
                    output_median=200.0, max_prompt=8192),
        reason="Eight long shared system prompts (4,096 tokens each, Zipf-1 popularity: the "
               "first takes 37% of requests), short single-turn user inputs (median 300 "
               "tokens), 1.5 req/s over four replicas whose KV cache (79 blocks of 128 "
               "tokens) holds about two prompts each. Load balancing puts every prompt on "
               "every replica and evicts constantly; routing on the cached prefix keeps each "
               "prompt warm where it is, at the price of loading the popular prompts' "
               "replicas: the trade-off the production routers set by hand."),
}


# LLMPrefixRouting-v0's defaults over `ServingParams`' shared field defaults (`envs.common`:
# the shared reward scales), under the caller's keywords; a callable is called per build.
# What depends on the trace is set by the builder: `max_steps_in_episode` (the trace's
# length: an episode replays it all) and `tokens` (a law whose maxima cover the trace's,
# used only to scale the request features).
PREFIX_DEFAULTS = dict(
    replicas=prefix_replicas,
    slo_s=20.0,
    # A router sees a prediction of the output length, never the truth (as Routing-v0).
    estimate_mode=ROUTING_ESTIMATE_MODE,
    estimate_noise=ROUTING_ESTIMATE_NOISE,
)


def make_llm_prefix_routing(replicas=None, trace=None, queue_buffer=None, max_seqs=None,
                            shaping_gamma=None, reward="time_in_system",
                            caching=True, tree_nodes=None, tree_depth=None,
                            scenario=None, ranked=True, **kw):
    """LLMPrefixRouting-v0 (`jaxserve.make("LLMPrefixRouting-v0", **kw)`): LLMRouting-v0's
    class with automatic prefix caching on (`LLMRoutingStatic.prefix_blocks` = the largest
    `kv_blocks`), driven by a trace with prefix identity.

    Registered defaults, each chosen so that a standard PPO (PureJaxRL's MLP on the flat
    observation, no reward normalisation) learns the environment as it is
    (`tests/test_prefix_learnable.py`; docs/prefix_caching.md, "Registered defaults"):
      * `scenario="system_prompts"` (`PREFIX_SCENARIO`): the workload that poses the
        affinity-versus-load trade-off (on "sessions" round robin is within 9% of the best
        router, so there is little to learn);
      * `ranked=True`: action `k` routes to the replica ranked `k` and the observation's
        rows come in that order (`LLMRouting`, Ranked replicas: most cached blocks of the
        pending prompt, then fewest tokens in flight, then index). Registered routers name
        replicas, not ranks: act with `env.replica_policy(router)` here, or build the env
        with `ranked=False`;
      * `shaping_gamma=None`: no potential shaping. LLMRouting-v0's potential is load-only
        (the greedy policy of `least_marginal`) and pulls a policy off the cache: measured
        14.64 s mean time in system shaped against 11.26 s unshaped at 262,144 steps.

    `trace`: a `traces.prefix.PrefixTrace`, or a path to a Mooncake JSONL(.gz) file
    (`traces.mooncake.load_mooncake`); default `prefix_workload(scenario=scenario)` (512
    synthetic shared-prefix requests of the named `PREFIX_SCENARIOS` workload, generator
    seed 0, built on the host here; give `scenario` only when `trace` is None). An episode
    replays the whole trace (`max_steps_in_episode` = its length unless given). `replicas`
    default `prefix_replicas()` (`PREFIX_DEFAULTS`, with the other defaults); `caching=False` builds the same scenario without a prefix
    cache (LLMRouting-v0's engine; params still `PrefixRoutingParams`). `tree_nodes` and
    `tree_depth` pad the prefix tables (`continuous.prefix_tables`) so that traces of
    different trees share one program. Other keywords as LLMRouting-v0 (reward scalars).
    """

    refuse_gpus("LLMPrefixRouting-v0", kw)
    for bad in ("arrivals", "arrival_rate", "tokens"):
        if bad in kw:
            raise ValueError(f"LLMPrefixRouting-v0 replays a trace; {bad}= does not apply")
    if trace is None:
        trace = prefix_workload(scenario=PREFIX_SCENARIO if scenario is None else scenario)
    elif scenario is not None:
        raise ValueError("give either trace= or scenario=, not both")
    elif isinstance(trace, (str, bytes)) or hasattr(trace, "__fspath__"):
        trace = load_mooncake(trace)
    if not isinstance(trace, PrefixTrace):
        raise ValueError(f"trace must be a PrefixTrace or a Mooncake file path, got "
                         f"{type(trace).__name__}")
    trace = validate_prefix_trace(trace)
    replicas = PREFIX_DEFAULTS["replicas"]() if replicas is None else list(replicas)
    prof = stack_replicas(replicas)
    n = len(trace.trace.arrival_s)
    kw.setdefault("max_steps_in_episode", n)
    fill_defaults(kw, PREFIX_DEFAULTS, exclude=("replicas",))
    # The token distribution is unused with a trace but for the request features' scales
    # (log prompt / log max_prompt): its maxima cover the trace's.
    tr = trace.trace
    kw.setdefault("tokens", A.bimodal_tokens(
        long_frac=0.2, short=(256, 32), long=(1024, 512), sigma=0.3,
        max_prompt=max(8192, int(np.max(tr.prompt_tokens))),
        max_output=max(2048, int(np.max(tr.output_tokens)))))
    base = build_params(prof, arrival_rate=1.0, trace=trace.trace, **kw)
    tree = trace.tree
    node = trace.node
    tables = CB.prefix_tables(tree.parent, tree.depth, tree.block_tokens, tree_nodes,
                              tree_depth)
    params = PrefixRoutingParams(
        **{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
        node=jnp.asarray(node, jnp.int32), tables=tables)
    qb, ms = replica_sizes(prof, queue_buffer, max_seqs)
    blocks = int(np.max(np.asarray(prof.kv_blocks))) if caching else 0
    env = LLMRouting(num_replicas=len(replicas), queue_buffer=qb, max_seqs=ms,
                     trace_len=params.trace.gap.shape[0], default=params,
                     shaping_gamma=shaping_gamma, reward=reward, prefix_blocks=blocks,
                     ranked=bool(ranked))
    env.check_params(params)
    return env, params

