"""LLMAutoscaling-v0: Autoscaling-v0's step over continuous-batching replicas.

GPU-seconds exact on a hand-computed case (dyadic iteration times), and
`evaluate_autoscalers` on it (exact latencies, requests in flight). The gymnax contract is
tests/test_env_contract.py (parametrised over every registered id, this one included), whose
vmap check runs LLMAutoscaling-v0 with a lane of another GPU price and warm-up
(`VARIED`) and compares every lane with its own run.
"""

import jax
import jax.numpy as jnp
import numpy as np

import jaxserve
from jaxserve.core.replica import ReplicaProfile

# c0 + alpha * tokens: a prefill of 8 tokens takes 0.625 s, a one-sequence decode 0.515625 s.
PROF = ReplicaProfile(c0=0.5, alpha=2.0 ** -6, kv_blocks=1000, block_size=4, max_seqs=2,
                      max_tokens=64, watermark=0.0, queue_cap=8, name="dyadic")
OUT = 16
FINISH = 0.625 + (OUT - 1) * 0.515625  # 8.359375 s


def make_case():
    trace = jaxserve.Trace(arrival_s=np.array([0.0, 0.0]), prompt_tokens=np.array([8, 8]),
                           output_tokens=np.array([OUT, OUT]))
    return jaxserve.make("LLMAutoscaling-v0", replicas=[PROF] * 3, trace=trace,
                         control_interval_s=4.0, warmup_s=8.0, initial_replicas=2,
                         estimate_mode=0)


def test_gpu_seconds_exact_with_drain_warmup_and_release():
    env, params = make_case()
    assert env.name == "LLMAutoscaling-v0"
    obs, state = env.reset(jax.random.PRNGKey(0), params)
    step = jax.jit(env.step_env)
    # Action a asks for a + 1 active replicas.
    # [0, 4) keep 2: the two requests (both at t = 0) go to replicas 0 and 1 (least work,
    #   ties to the lowest index): 2 x 4 GPU-seconds.
    # [4, 8) scale to 1: replica 0 drains (equal work, lowest index) but runs its request
    #   until 8.359375: still 2 x 4.
    # [8, 12) keep 1: replica 0 is released at its last completion: 4 + 0.359375.
    # [12, 16) scale to 2: replica 0 is off now, so it is provisioned again (warm-up 8 s) and
    #   costs from the decision: 2 x 4.
    # [16, 20) scale to 3: 3 x 4.
    out = []
    for a in (1, 0, 0, 1, 2):
        obs, state, r, term, info = step(jax.random.PRNGKey(0), state, jnp.int32(a), params)
        out.append((float(info["gpu_seconds"]), int(info["provisioned"]),
                    int(info["completed"]), int(info["serving"])))
    assert out[0] == (8.0, 2, 0, 2)
    assert out[1] == (8.0, 2, 0, 1)
    assert out[2] == (4.0 + (FINISH - 8.0), 1, 2, 1)
    assert out[3] == (8.0, 2, 0, 1)  # the re-provisioned replica warms up until 20
    assert out[4] == (12.0, 3, 0, 2)  # replica 0 serves from 20, the interval's end


def test_evaluate_autoscalers_counts_requests_in_flight():
    """`evaluation.scaling.evaluate_autoscalers` runs on continuous replicas and counts the
    requests still held at the end (it read the static engine's fields before)."""
    from jaxserve import policies
    from jaxserve.evaluation.scaling import evaluate_autoscalers

    env, params = make_case()
    pols = {"one": policies.get("fixed", env=env, replicas=1),
            "three": policies.get("fixed", env=env, replicas=3)}
    key = jax.random.PRNGKey(0)
    # Both requests arrive at 0. Three replicas: one each, both finish at FINISH. One
    # replica: they share its iterations (prefill 0.5 + 16 / 64 s, then 15 decodes of
    # 0.5 + 2 / 64 s) and finish at 8.71875 s. Held after three 1 s intervals, done after
    # three 4 s intervals. The interval is a traced parameter and the number of intervals
    # is the same, so both runs are one compiled program.
    early = evaluate_autoscalers(env, params.replace(control_interval_s=jnp.float32(1.0)),
                                 pols, key, num_envs=1, num_steps=3)
    late = evaluate_autoscalers(env, params, pols, key, num_envs=1, num_steps=3)
    for name in pols:
        assert early[name]["in_flight"] == 2.0
        assert late[name]["in_flight"] == 0.0
        assert late[name]["drop_rate"] == 0.0
    assert late["three"]["mean_latency"] == FINISH
    assert late["one"]["mean_latency"] == 0.75 + 15 * 0.53125
