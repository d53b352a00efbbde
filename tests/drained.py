"""Drained-episode latency of several policies on common request streams (the learnability
tests' evaluation; not a test)."""

import jax
import jax.numpy as jnp


def drained_latencies(env, policies: dict, lane_params, keys, num_steps: int):
    """Drop-inclusive mean end-to-end latency (s) of every policy on every lane.

    Each lane is one episode of `num_steps` routing decisions from `env.reset_env(key, p)`
    with the lane's params `p` (a trace mode env whose last decision drains the replicas, so
    every request's whole latency counts); every policy routes each lane with the same
    environment keys, one compiled program selecting the policy by `lax.switch`. Not jitted:
    callers jit it.

    Args:
      policies: `{name: policy(key, obs, state, params) -> action}` acting on `env`.
      lane_params: `env`'s params with a leading lane axis on every leaf.
      keys: `(lanes,)` PRNG keys, one per lane.
    Returns:
      `(len(policies), lanes)` float32: (summed latency + drop_penalty_s * drops) /
      `num_steps`.
    """
    fns = tuple(policies.values())

    def episode(i, p, k):
        obs, state = env.reset_env(k, p)

        def step(carry, k):
            obs, state = carry
            k_a, k_s = jax.random.split(k)
            a = jax.lax.switch(i, fns, k_a, obs, state, p)
            obs, state, _, _, info = env.step_env(k_s, state, a, p)
            return (obs, state), (info["latency_sum"], info["dropped"])

        _, (lat, drop) = jax.lax.scan(step, (obs, state), jax.random.split(k, num_steps))
        return (lat.sum() + p.drop_penalty_s * drop.sum()) / num_steps

    return jax.vmap(lambda i: jax.vmap(lambda p, k: episode(i, p, k))(lane_params, keys))(
        jnp.arange(len(fns)))
