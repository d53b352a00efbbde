"""Evaluation fingerprints of the registered environments: a fixed-key rollout of each
registered env (and each registered Routing-v0 scenario) with actions sampled from its action
space, its rewards, observation sums and info totals stored in `tests/data/fingerprints.json`.

A refactor of how environments are built (where defaults live, which module builds what) must
leave these unchanged. The comparison has a tolerance (relative 1e-5) rather than bit
equality because XLA may compile float arithmetic differently on another CPU; the refactors
themselves were checked bit-for-bit on one machine (`python -m tests.test_fingerprint
--write PATH` at each commit, then compare the files).

Regenerate (only when an env's semantics change on purpose, and say so in the commit):
    python -m tests.test_fingerprint --write tests/data/fingerprints.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxserve

DATA = Path(__file__).parent / "data" / "fingerprints.json"
STEPS = 16
# (label, env name, make keywords): every registered env at its defaults, every registered
# Routing-v0 scenario.
CASES = (("Routing-v0", "Routing-v0", {}),
         ("Routing-v0/bursty", "Routing-v0", {"scenario": "bursty"}),
         ("Routing-v0/bursty_short_queues", "Routing-v0", {"scenario": "bursty_short_queues"}),
         ("Routing-v0/short_bursts", "Routing-v0", {"scenario": "short_bursts"}),
         ("Batching-v0", "Batching-v0", {}),
         ("Autoscaling-v0", "Autoscaling-v0", {}),
         ("LLMRouting-v0", "LLMRouting-v0", {}),
         ("LLMAutoscaling-v0", "LLMAutoscaling-v0", {}),
         ("LLMPrefixRouting-v0", "LLMPrefixRouting-v0", {}))


def fingerprint(name: str, kw: dict, steps: int = STEPS) -> dict:
    """Rewards, per-step observation sums and info totals of a `steps`-step rollout from
    `PRNGKey(0)` with actions sampled from the action space (float64 lists)."""
    env, params = jaxserve.make(name, **kw)
    space = env.action_space(params)

    @jax.jit
    def run(key):
        obs, state = env.reset(key, params)

        def body(carry, k):
            obs, state = carry
            ka, ks = jax.random.split(k)
            a = space.sample(ka)
            obs2, state2, r, term, trunc, info = env.step(ks, state, a, params)
            nums = {k_: jnp.sum(jnp.asarray(v, jnp.float32)) for k_, v in info.items()
                    if jnp.issubdtype(jnp.asarray(v).dtype, jnp.number)}
            return (obs2, state2), (jnp.sum(obs2), r, term, trunc, nums)
        return obs, jax.lax.scan(body, (obs, state), jax.random.split(key, steps))[1]

    obs0, (obs_sum, rew, term, trunc, info) = run(jax.random.PRNGKey(0))
    return {"obs0": float(np.sum(np.asarray(obs0, np.float64))),
            "obs_sum": np.asarray(obs_sum, np.float64).tolist(),
            "reward": np.asarray(rew, np.float64).tolist(),
            "terminated": np.asarray(term, np.float64).tolist(),
            "truncated": np.asarray(trunc, np.float64).tolist(),
            "info": {k: float(np.sum(np.asarray(v, np.float64))) for k, v in
                     sorted(info.items())}}


def all_fingerprints() -> dict:
    return {label: fingerprint(name, kw) for label, name, kw in CASES}


@pytest.fixture(scope="module")
def stored():
    return json.loads(DATA.read_text())


@pytest.mark.parametrize("label,name,kw", CASES, ids=[c[0] for c in CASES])
def test_rollout_matches_the_stored_fingerprint(stored, label, name, kw):
    assert label in stored, f"no stored fingerprint for {label}: regenerate (module docstring)"
    got, want = fingerprint(name, kw), stored[label]
    assert set(got["info"]) == set(want["info"])
    for field in ("obs0", "obs_sum", "reward", "terminated", "truncated"):
        np.testing.assert_allclose(got[field], want[field], rtol=1e-5, atol=1e-6,
                                   err_msg=f"{label}: {field}")
    for k in want["info"]:
        np.testing.assert_allclose(got["info"][k], want["info"][k], rtol=1e-5, atol=1e-6,
                                   err_msg=f"{label}: info[{k!r}]")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--write":
        raise SystemExit("usage: python -m tests.test_fingerprint --write PATH")
    Path(sys.argv[2]).write_text(json.dumps(all_fingerprints(), indent=1, sort_keys=True) + "\n")
