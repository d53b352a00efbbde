"""Why the minimal PPO learns LLMRouting-v0 slowly: the measurements behind docs/continuous.md,
"Why PPO learns it slowly".

    python -m tests.llm_learnability [--steps N] [--seed S] [--set k=v ...] [--no-eval]

Prints, for `jaxserve.make("LLMRouting-v0", **sets)`:

1. The shaped reward split exactly into its parts (16 environments x 256 decisions under a
   random and the `least_marginal` policy): with `L = latency_scale`, `g = shaping_gamma`,
   `B` the shaping backlog (`continuous_load.expected_backlog`, s) before the step, `m_a`
   the routed request's estimated added time-in-system at its replica
   (`continuous_load.marginal_backlog`, s) and `TIS` the time-in-system of the step (s),
   `r = -g m_a / L` (the decision's signal) `+ (1 - g)(B - TIS) / L` (the potential's
   discount leak) `- g e / L` (`e = B' - (B + m_a - TIS)`, the estimates' revision).
2. Per update of `tests/minimal_ppo.py` (PureJaxRL's PPO, CartPole settings): policy entropy
   (nats; uniform over 4 replicas is 1.386), explained variance of the value, raw advantage
   std, the correlation of the step reward and of the GAE advantage with the action's signal
   `-(m_a - mean over replicas of m)` (read back from the observation's
   `log1p(added / time_scale)` feature), the policy's expected regret `E_pi[m_a] - min m`
   against a uniform policy's (s), and how often each replica is the greedy action.
3. Unless `--no-eval`: the greedy PPO policy, JSQ by tokens, round robin and
   `least_marginal` on tests/test_llm_learnable.py's drained streams (16 x 500 requests, key
   12345), with PPO's paired differences.
"""

from __future__ import annotations

import argparse
import ast
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxserve
from jaxserve.core import continuous_load as CL
from jaxserve.policies import generic as G
from jaxserve.policies import llm_routing as P
from tests.minimal_ppo import greedy_policy, make_train

ADDED = 5  # column of `log1p(added / time_scale)` in a replica's observation row


def reward_decomposition(env, params, policy, key, num_envs: int = 16, steps: int = 256):
    """The parts of the shaped reward (module docstring, 1.) under `policy`, as arrays over
    the non-final steps: `{"reward", "signal", "leak", "residual", "spread"}` (reward units;
    `spread` is max - min over replicas of `m / L`). Raises if they do not sum to the reward."""
    lat, g = float(params.latency_scale), env.shaping_gamma
    if g is None:
        raise ValueError("reward_decomposition needs a shaped environment (shaping_gamma set)")

    @jax.jit
    def roll(key):
        obs, st = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(key, num_envs), params)

        def step(c, k):
            obs, st = c
            k_a, k_s = jax.random.split(k)
            a = jax.vmap(lambda kk, o, s: policy(kk, o, s, params))(
                jax.random.split(k_a, num_envs), obs, st)
            m = jax.vmap(lambda s: CL.marginal_backlog(
                s.cluster, params.gpus, s.pending.prompt, jnp.maximum(s.pending.estimate, 1.0)))(st)
            b0 = jax.vmap(lambda s: CL.expected_backlog(s.cluster, params.gpus))(st)
            obs, st2, r, te, tr, info = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
                jax.random.split(k_s, num_envs), st, a, params)
            return (obs, st2), (r, te | tr, m, a, info["in_system_time"], b0, st2.backlog)

        return jax.lax.scan(step, (obs, st), jax.random.split(key, steps))[1]

    r, done, m, a, tis, b0, b1 = (np.asarray(x, np.float64) for x in jax.device_get(roll(key)))
    keep = done == 0  # an auto-reset step's next backlog belongs to the new episode
    m_a = np.take_along_axis(m, a.astype(int)[..., None], -1)[..., 0]
    e = b1 - (b0 + m_a - tis)
    parts = {"reward": r, "signal": -g * m_a / lat, "leak": (1 - g) * (b0 - tis) / lat,
             "residual": -g * e / lat, "spread": (m.max(-1) - m.min(-1)) / lat}
    parts = {k: v[keep] for k, v in parts.items()}
    gap = np.abs(parts["reward"] - parts["signal"] - parts["leak"] - parts["residual"]).max()
    if gap > 1e-5:
        raise AssertionError(f"reward parts do not sum to the reward (max gap {gap:.2e})")
    return parts


def update_diagnostics(num_replicas: int):
    """The per-update `diagnostics` hook of `make_train` (module docstring, 2.)."""
    def corr(x, y):
        x, y = x.ravel(), y.ravel()
        return ((x - x.mean()) * (y - y.mean())).mean() / (x.std() * y.std() + 1e-12)

    def diag(traj, adv, targets, logits, values):
        rows = traj.obs[..., 3:].reshape(traj.obs.shape[:-1] + (num_replicas, -1))
        added = jnp.expm1(rows[..., ADDED])  # estimated added time-in-system / time_scale
        m_a = jnp.take_along_axis(added, traj.action[..., None], -1)[..., 0]
        signal = -(m_a - added.mean(-1))
        pi = jax.nn.softmax(logits)
        return dict(
            entropy=-(pi * jax.nn.log_softmax(logits)).sum(-1).mean(),
            explained_var=1 - jnp.var(targets - values) / (jnp.var(targets) + 1e-12),
            adv_std=adv.std(), corr_reward=corr(traj.reward, signal), corr_adv=corr(adv, signal),
            regret=((pi * added).sum(-1) - added.min(-1)).mean(),
            regret_uniform=(added.mean(-1) - added.min(-1)).mean(),
            greedy_freq=jax.nn.one_hot(jnp.argmax(logits, -1), num_replicas).mean((0, 1)))

    return diag


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=131_072)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", nargs="*", default=[], help="LLMRouting-v0 overrides k=v")
    ap.add_argument("--no-eval", action="store_true")
    a = ap.parse_args(argv)
    overrides = {k: ast.literal_eval(v) for k, v in (s.split("=", 1) for s in a.set)}
    env, params = jaxserve.make("LLMRouting-v0", **overrides)
    np.set_printoptions(precision=2, suppress=True)

    print("1. shaped reward parts (reward units), std over steps; action spread = mean of "
          "max - min over replicas of m / L")
    for name in ("random", "least_marginal"):
        pol = G.random_policy if name == "random" else G.least_marginal
        p = reward_decomposition(env, params, pol, jax.random.PRNGKey(0))
        print(f"  {name:15s} reward std {p['reward'].std():.2e} | signal std "
              f"{p['signal'].std():.2e} | leak mean {p['leak'].mean():.2e} std "
              f"{p['leak'].std():.2e} | residual std {p['residual'].std():.2e} | action "
              f"spread {p['spread'].mean():.2e}")

    ts = float(params.time_scale)
    train, network = make_train({"TOTAL_TIMESTEPS": a.steps}, env, params,
                                diagnostics=update_diagnostics(env.num_replicas))
    t0 = time.perf_counter()
    net_params, (_, _, d) = jax.block_until_ready(jax.jit(train)(jax.random.PRNGKey(a.seed)))
    d = jax.device_get(d)
    n = len(d["entropy"])
    print(f"2. training, {a.steps} steps ({n} updates) in {time.perf_counter() - t0:.0f} s "
          f"(regrets in s)")
    for i in sorted(set(range(0, n, max(1, n // 16))) | {n - 1}):
        print(f"  update {i:3d} entropy {d['entropy'][i]:.3f} EV {d['explained_var'][i]:+.2f} "
              f"adv std {d['adv_std'][i]:.1e} corr(r, signal) {d['corr_reward'][i]:+.2f} "
              f"corr(adv, signal) {d['corr_adv'][i]:+.2f} regret {ts * d['regret'][i]:.2f} "
              f"(uniform {ts * d['regret_uniform'][i]:.2f}) greedy {d['greedy_freq'][i]}")
    if a.no_eval:
        return
    from jaxserve.evaluation.stats import paired_difference
    from tests.test_llm_learnable import EVAL_KEY, EVAL_REQUESTS, EVAL_STREAMS, drained_latency

    res = drained_latency(env, params, {"ppo": greedy_policy(network, net_params),
                                        "jsq_tokens": P.jsq_tokens,
                                        "round_robin": G.round_robin,
                                        "least_marginal": G.least_marginal},
                          jax.random.PRNGKey(EVAL_KEY), EVAL_STREAMS, EVAL_REQUESTS)
    print("3. drop-inclusive mean E2E (s), PPO minus each (paired 95% t-interval)")
    for name, v in res.items():
        dd = paired_difference(res["ppo"], v)
        print(f"  {name:15s} {v.mean():6.2f}   {dd['mean']:+.2f} [{dd['low']:+.2f}, "
              f"{dd['high']:+.2f}]")


if __name__ == "__main__":
    main()
