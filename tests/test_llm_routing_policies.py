"""LLMRouting-v0 heuristics: jit/vmap-safe, valid actions, and JSQ beats random under load."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxserve
from jaxserve import policies
from jaxserve.core import arrivals as A

REPLICAS = [jaxserve.replica_profile("opt13b-a100-80g", max_seqs=8, queue_cap=8),
            jaxserve.replica_profile("opt13b-a100-40g", max_seqs=8, queue_cap=8)]
NAMES = list(policies.names("llm_routing"))  # every registered LLMRouting-v0 router
FNS = {n: policies.get(n, kind="llm_routing").fn for n in NAMES}
ROOT = Path(__file__).resolve().parents[1]
STEPS = 400


def episode_costs(rate, key):
    """Every policy on the same arrivals (one program: `lax.switch` vmapped over policies)."""
    env, params = jaxserve.make("LLMRouting-v0", replicas=REPLICAS,
                                max_steps_in_episode=100_000)
    params = params.replace(arrivals=A.poisson(rate))
    fns = [FNS[n] for n in NAMES]

    def episode(i):
        obs, state = env.reset(key, params)

        def step(carry, k):
            obs, state = carry
            k_pol, k_env = jax.random.split(k)
            a = jax.lax.switch(i, fns, k_pol, obs, state, params)
            ok = (a.dtype == jnp.int32) & (a >= 0) & (a < env.num_replicas)
            obs, state, r, _, _, info = env.step(k_env, state, a, params)
            return (obs, state), (r, info["dropped"], ok)

        _, (r, d, ok) = jax.lax.scan(step, (obs, state), jax.random.split(key, STEPS))
        return -r.sum(), d.sum(), ok.all()

    return jax.jit(jax.vmap(episode))(jnp.arange(len(fns)))


def check_policies_valid_and_jsq_beats_random_at_high_load():
    """The check itself; `test_...` below runs it in a fresh process."""
    # 4.5 req/s is above these two small replicas' capacity (drops under every policy).
    cost, drops, ok = episode_costs(4.5, jax.random.PRNGKey(0))
    assert bool(ok.all())
    cost = dict(zip(NAMES, np.asarray(cost)))
    drops = dict(zip(NAMES, np.asarray(drops)))
    assert np.all(np.isfinite(list(cost.values())))
    assert cost["jsq_requests"] < 0.85 * cost["random"], cost
    assert drops["jsq_requests"] < drops["random"], drops
    assert cost["vllm_dp"] < cost["random"], cost


def test_policies_valid_and_jsq_beats_random_at_high_load():
    # Run in a fresh Python process. Inside a pytest-xdist worker that has run the rest of
    # the suite, XLA:CPU aborted the process (SIGABRT in backend_compile) while compiling
    # this program, in two CI runs out of two at commit 3aad147; the same test passes alone
    # (-n 0, ~30 s). The cause is not diagnosed yet (see the session note); a fresh process
    # keeps the check and keeps one crash from taking the worker down.
    code = ("import tests.test_llm_routing_policies as t; "
            "t.check_policies_valid_and_jsq_beats_random_at_high_load()")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_policy_reads_estimates_not_true_lengths():
    """Changing the pending request's true output length alone does not change any choice."""
    env, params = jaxserve.make("LLMRouting-v0", replicas=REPLICAS)
    obs, state = env.reset(jax.random.PRNGKey(0), params)
    for i in range(6):
        obs, state, *_ = env.step(jax.random.PRNGKey(i), state, jnp.int32(i % 2), params)
    other = state.replace(pending=state.pending.replace(output=state.pending.output + 4000.0))
    for name, fn in FNS.items():
        a = jax.jit(fn)(jax.random.PRNGKey(9), obs, state, params)
        b = jax.jit(fn)(jax.random.PRNGKey(9), obs, other, params)
        assert int(a) == int(b), name
