"""Is LLMAutoscaling-v0 learnable as registered? The measurement behind docs/continuous.md,
"LLMAutoscaling-v0: learnable as registered?".

    python -m tests.llm_autoscaling_learnability [--steps N] [--seed S] [--eval-envs E]
        [--eval-steps T] [--hpa-grid 0.5,0.7,0.9] [--ppo-set KEY=V ...] [--set k=v ...]
        [--no-eval] [--save FILE]

On `jaxserve.make("LLMAutoscaling-v0")`, unmodified (4 OPT-13B A100-80GB slots, 15 s control
intervals, diurnal Poisson arrivals of mean 6 req/s, 480 intervals per episode), it:

1. Trains `tests/minimal_ppo.py` (PureJaxRL's PPO with CartPole-v1's hyperparameters, flat
   observation through gymnax's `LegacyStepAPIWrapper`, no normalisation) for `--steps`
   environment steps with key `--seed`, compiling it apart (`jit(...).lower().compile()`) so
   the run time per PPO update (16 envs x 128 intervals of rollout, then 4 epochs x 4
   minibatches) is printed without compilation. `--ppo-set` overrides `minimal_ppo.CONFIG`
   entries (smoke runs only; the measurement uses none). `--set` trains on
   `make("LLMAutoscaling-v0", **sets)` instead (e.g. `latency_scale=100000.0`, a reward
   scale); the evaluation always runs the registered scenario.
2. Prints, per update, from the rollout the update trained on: the mean and std of the step
   reward (units of `latency_scale` = 1000 request-seconds), the fraction of steps ending an
   episode, the policy's entropy (nats; uniform over 4 actions is 1.386), the value's
   explained variance, the mean GAE value target and the mean value (reward units), and how
   often each action is the greedy one; and, over the whole
   training, each observation feature's mean, std, min and max (`Autoscaling.FEATURES`), so
   constant or badly scaled features show.
3. Tunes HPA's `target_utilization` over `--hpa-grid` on tuning episodes
   (`core.sources.tuning_key`, disjoint from the evaluation's), then evaluates the greedy PPO
   policy, always-max (`fixed`, 4 replicas), `fixed` 3, the tuned HPA, Knative (concurrency,
   target 0.7 x max_seqs) and Ray Serve (ongoing requests, target max_seqs) on `--eval-envs`
   fresh episodes of `--eval-steps` intervals (`evaluation.scaling.evaluate_autoscalers`:
   common random numbers, every policy sees the same arrivals; each episode starts at a
   random time of day, as the registered `random_phase = 1` does), and prints the env's
   objective (cost = latency + drop + GPU charges, request-seconds per episode) and its parts
   with PPO's paired differences (95% Student-t over episodes).
"""

from __future__ import annotations

import argparse
import ast
import pickle
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxserve
from jaxserve import policies as POL
from jaxserve.core.sources import tuning_key
from jaxserve.evaluation.scaling import evaluate_autoscalers
from jaxserve.evaluation.stats import paired_difference
from tests.minimal_ppo import CONFIG, greedy_policy, make_train

EVAL_KEY = 12345
METRICS = (("cost", "objective: cost (req-s / episode)"),
           ("latency_cost", "  time in system (req-s)"),
           ("gpu_cost", "  GPU charge (req-s)"),
           ("drop_cost", "  drop charge (req-s)"),
           ("mean_replicas", "mean replicas provisioned"),
           ("mean_latency", "mean latency of completions (s)"),
           ("drop_rate", "drop rate"),
           ("slo_violation_rate", "SLO violation rate (E2E > 20 s)"))


def update_diagnostics(num_actions: int):
    """The per-update `diagnostics` hook of `make_train` (module docstring, 2.)."""
    def diag(traj, adv, targets, logits, values):
        pi = jax.nn.softmax(logits)
        obs = traj.obs.reshape(-1, traj.obs.shape[-1])
        return dict(
            reward_mean=traj.reward.mean(), reward_std=traj.reward.std(),
            done=traj.done.mean(),
            entropy=-(pi * jax.nn.log_softmax(logits)).sum(-1).mean(),
            explained_var=1 - jnp.var(targets - values) / (jnp.var(targets) + 1e-12),
            target_mean=targets.mean(), value_mean=values.mean(),
            greedy_freq=jax.nn.one_hot(jnp.argmax(logits, -1), num_actions).mean((0, 1)),
            obs_mean=obs.mean(0), obs_sq=(obs ** 2).mean(0), obs_min=obs.min(0),
            obs_max=obs.max(0))
    return diag


def with_parts(per_env: dict, price: float) -> dict:
    """Adds the objective's parts (request-seconds per episode): the GPU charge
    `price * GPU-seconds` and the drop charge, the rest of `cost` once time in system is
    taken out (SLO and invalid-action penalties are 0 in the registered scenario)."""
    out = dict(per_env)
    out["gpu_cost"] = price * 3600.0 * per_env["gpu_hours"]
    out["drop_cost"] = per_env["cost"] - per_env["latency_cost"] - out["gpu_cost"]
    return out


def baselines(env, params, hpa_target: float) -> dict:
    """The registered autoscalers compared against (module docstring, 3.)."""
    b = int(np.max(np.asarray(params.serving.gpus.max_seqs)))
    get = lambda name, **kw: POL.get(name, env=env, params=params, **kw)  # noqa: E731
    return {"always_max": get("fixed"), "fixed_3": get("fixed", replicas=3),
            f"hpa_{hpa_target:g}": get("hpa", target_utilization=hpa_target),
            "knative": get("knative", target_concurrency=0.7 * b),
            "ray_serve": get("ray_serve", target_ongoing_requests=float(b))}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10_240)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-envs", type=int, default=8)
    ap.add_argument("--eval-steps", type=int, default=120)
    ap.add_argument("--tune-envs", type=int, default=4)
    ap.add_argument("--hpa-grid", default="0.5,0.7,0.9")
    ap.add_argument("--ppo-set", nargs="*", default=[], help="minimal_ppo CONFIG overrides")
    ap.add_argument("--no-eval", action="store_true", help="stop after 2. (no evaluation)")
    ap.add_argument("--save", default=None, help="pickle the trained network params here")
    ap.add_argument("--set", nargs="*", default=[],
                    help="LLMAutoscaling-v0 overrides k=v for training only (the evaluation "
                         "reports cost in request-seconds, which no reward scale changes)")
    a = ap.parse_args(argv)
    ppo_cfg = {k: ast.literal_eval(v) for k, v in (s.split("=", 1) for s in a.ppo_set)}
    env, params = jaxserve.make("LLMAutoscaling-v0")
    env_overrides = {k: ast.literal_eval(v) for k, v in (s.split("=", 1) for s in a.set)}
    train_env, train_params = jaxserve.make("LLMAutoscaling-v0", **env_overrides)
    price = float(params.gpu_price)
    np.set_printoptions(precision=3, suppress=True)
    cfg = dict(CONFIG, **ppo_cfg, TOTAL_TIMESTEPS=a.steps)
    per_update = cfg["NUM_ENVS"] * cfg["NUM_STEPS"]
    n_up = a.steps // per_update

    train, network = make_train(cfg, train_env, train_params, diagnostics=update_diagnostics(
        env.num_actions))
    key = jax.random.PRNGKey(a.seed)
    t0 = time.perf_counter()
    compiled = jax.jit(train).lower(key).compile()
    t_compile = time.perf_counter() - t0
    t0 = time.perf_counter()
    net_params, (rewards, dones, d) = jax.block_until_ready(compiled(key))
    t_run = time.perf_counter() - t0
    d = jax.device_get(d)
    print(f"1. trained {n_up * per_update} env steps ({n_up} updates of {cfg['NUM_ENVS']} envs "
          f"x {cfg['NUM_STEPS']} intervals) in {t_run:.0f} s after {t_compile:.0f} s compile: "
          f"{t_run / max(n_up, 1):.0f} s per update, {n_up * per_update / t_run:.1f} env "
          f"steps/s")
    if a.save:
        with open(a.save, "wb") as f:
            pickle.dump(jax.device_get(net_params), f)
    print("2. per update (rollout it trained on): step reward mean/std (units of "
          "latency_scale req-s, 1000 registered), done fraction, entropy (uniform 1.386), "
          "explained variance, value target / value means, greedy action freq")
    for i in range(n_up):
        print(f"  update {i:3d} reward {d['reward_mean'][i]:+.4f} / {d['reward_std'][i]:.4f} "
              f"done {d['done'][i]:.4f} entropy {d['entropy'][i]:.4f} EV "
              f"{d['explained_var'][i]:+.2f} value target/value mean {d['target_mean'][i]:+.3g} "
              f"/ {d['value_mean'][i]:+.3g} greedy {d['greedy_freq'][i]}")
    mean = d["obs_mean"].mean(0)
    std = np.sqrt(np.maximum(d["obs_sq"].mean(0) - mean ** 2, 0.0))
    print("  observation features over all training rollouts: mean / std / min / max")
    for j, name in enumerate(env.FEATURES):
        print(f"    {j:2d} {name:24s} {mean[j]:9.4f} {std[j]:9.4f} {d['obs_min'][:, j].min():9.4f}"
              f" {d['obs_max'][:, j].max():9.4f}")

    if a.no_eval:
        return
    grid = [float(x) for x in a.hpa_grid.split(",")]
    t0 = time.perf_counter()
    tune = evaluate_autoscalers(env, params, {f"{g:g}": POL.get(
        "hpa", env=env, params=params, target_utilization=g) for g in grid},
        tuning_key(jax.random.PRNGKey(EVAL_KEY)), num_envs=a.tune_envs, num_steps=a.eval_steps)
    best = min(grid, key=lambda g: tune[f"{g:g}"]["cost"])
    print(f"3. HPA target_utilization tuned on {a.tune_envs} tuning episodes of {a.eval_steps} "
          f"intervals ({time.perf_counter() - t0:.0f} s): cost "
          + ", ".join(f"{g:g}: {tune[f'{g:g}']['cost']:.0f}" for g in grid) + f"; chose {best:g}")

    pols = {"ppo_greedy": greedy_policy(network, net_params), **baselines(env, params, best)}
    t0 = time.perf_counter()
    _, per = evaluate_autoscalers(env, params, pols, jax.random.PRNGKey(EVAL_KEY),
                                  num_envs=a.eval_envs, num_steps=a.eval_steps, episodes=True)
    per = {n: with_parts(v, price) for n, v in per.items()}
    print(f"   evaluation: {a.eval_envs} episodes x {a.eval_steps} intervals, key {EVAL_KEY} "
          f"({time.perf_counter() - t0:.0f} s). Per-episode means; PPO minus each, paired 95% "
          f"t-interval")
    for m, label in METRICS:
        print(f"  {label}")
        for name, v in per.items():
            dd = paired_difference(per["ppo_greedy"][m], v[m])
            tail = "" if name == "ppo_greedy" else (f"  PPO - it {dd['mean']:+10.4g} "
                                                    f"[{dd['low']:+.4g}, {dd['high']:+.4g}]")
            print(f"    {name:14s} {np.nanmean(v[m]):10.4g}{tail}")


if __name__ == "__main__":
    main()
