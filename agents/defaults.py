"""Tuned training defaults per environment and algorithm, and the config they make.

`ENV_DEFAULTS[env][algo]` holds hyperparameters (a "total_steps" entry is the default
budget), applied under the caller's values; an optional `ENV_DEFAULTS[env]["env_overrides"]`
holds environment overrides used for training (docs/training.md records how each was
chosen).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jaxserve.agents import ppo, reinforce
from jaxserve.agents.config import PPOConfig, REINFORCEConfig, TrainConfig
from jaxserve.agents.trainer import Trainer
from jaxserve.envs.autoscaling import AUTOSCALING_TRAINING

ALGOS: dict[str, tuple[type[TrainConfig], Callable[..., Trainer]]] = {
    "ppo": (PPOConfig, ppo.make_train),
    "reinforce": (REINFORCEConfig, reinforce.make_train),
}

# Tuned training defaults per environment, applied under the caller's values: per algorithm,
# hyperparameters (a "total_steps" entry is the default budget). Routing-v0 and Batching-v0
# train on the registered environment defaults (reward scale and shaping are the
# environment's, chosen so that a standard PPO learns: docs/training.md); only
# Autoscaling-v0 still has "env_overrides" (see there).
ENV_DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    "Routing-v0": {
        "ppo": dict(total_steps=500_000, num_envs=32, num_steps=32, lr=1e-3,
                    num_minibatches=4, update_epochs=8, gamma=0.99, gae_lambda=0.95,
                    ent_coef=0.01, hidden_sizes=(32, 32), set_mixer="mean"),
        "reinforce": dict(total_steps=1_000_000, num_envs=32, num_steps=16, lr=3e-3,
                          gamma=0.99, ent_coef=0.01, hidden_sizes=(32, 32), set_mixer="mean"),
    },
    # LLMRouting-v0: Routing-v0's PPO settings (small mean-pooled set network), 16 envs as a
    # step costs more; the Azure-trace study ran with these (docs/continuous.md, "PPO against
    # the heuristics on the Azure conversation trace").
    "LLMRouting-v0": {
        "ppo": dict(total_steps=100_000, num_envs=16, num_steps=64, lr=1e-3,
                    num_minibatches=4, update_epochs=8, gamma=0.99, gae_lambda=0.95,
                    ent_coef=0.01, hidden_sizes=(32, 32), set_mixer="mean"),
    },
    # LLMPrefixRouting-v0 (registered with ranked replicas): PureJaxRL's CartPole-v1 PPO, MLP
    # on the flat observation, 16 envs. On the ranked environment this MLP reached 9.22 s
    # mean time in system at 1M steps (3 seeds x 3 traces) where the attention set network on
    # index-ordered replicas reached 10.41 s and llm-d's scorers 10.24 s
    # (docs/prefix_caching.md, "Ranked replicas"); experiment (p) trains with these.
    "LLMPrefixRouting-v0": {
        "ppo": dict(total_steps=1_048_576, num_envs=16, num_steps=128, lr=2.5e-4,
                    anneal_lr=True, num_minibatches=4, update_epochs=4, gamma=0.99,
                    gae_lambda=0.95, ent_coef=0.01, network="mlp", hidden_sizes=(64, 64),
                    activation="tanh"),
        # The same MLP with Routing-v0's REINFORCE rollout shape (one gradient step per
        # 16 x 32 steps): untuned here, the second learner of the prefix study.
        "reinforce": dict(total_steps=1_048_576, num_envs=16, num_steps=32, lr=1e-3,
                          gamma=0.99, ent_coef=0.01, network="mlp", hidden_sizes=(64, 64),
                          activation="tanh"),
    },
    # Batching-v0 is semi-Markov (a wait lasts one arrival gap, a dispatch until the GPU frees):
    # discount by simulated time, not per decision, or "always wait" looks cheap
    # (docs/training.md, "Batching-v0"). Its registered latency_scale (1000) keeps rewards O(1).
    # gamma 0.99 per 1 s (a ~100 s horizon, a few batch times): at 5 s per 0.99 (~500 s) the
    # critic must learn values of (cost rate x 500 s) before a dispatch from a full queue (a
    # long step costing every waiting request's time) beats waiting (one arrival gap; the
    # drops it causes come later); at load 0.95, 49k steps, every PPO and REINFORCE seed
    # collapsed to always-wait (623 s vs greedy's 76 s). At 1 s both learn greedy at loads
    # 0.3-0.95 (docs/results.md (b)).
    "Batching-v0": {
        "ppo": dict(num_envs=32, num_steps=32, update_epochs=8, discount_time_s=1.0),
        "reinforce": dict(num_envs=32, num_steps=16, lr=3e-3, discount_time_s=1.0),
    },
    # Autoscaling-v0 trains on its module's training scenario (`envs.autoscaling.
    # AUTOSCALING_TRAINING`: 120 s decisions, step actions, random starts, a told price;
    # the reasons are there), with gamma 0.9 (a 20-minute horizon at 120 s steps). With
    # these, 92,160 decisions: all 3 seeds scale up from under-provisioned starts and are
    # cheaper than HPA, Knative and Ray Serve at a lower p99 on the diurnal scenario; 2 of 3
    # lie below the fixed-count frontier (docs/scaling.md).
    "Autoscaling-v0": {
        "env_overrides": AUTOSCALING_TRAINING,
        "ppo": dict(total_steps=92_160, num_envs=32, num_steps=16, lr=3e-4, update_epochs=4,
                    gamma=0.9, ent_coef=0.02),
        "reinforce": dict(total_steps=400_000, num_envs=32, num_steps=32, lr=1e-3),
    },
}

# Arguments of `train` that are not config hyperparameters.
_EXPLICIT = ("total_timesteps", "num_envs", "seed")


def make_config(
    algo: str, env_name: str, env: Any, total_steps: int | None, seed: int,
    num_envs: int | None = None, **hparams: Any,
) -> TrainConfig:
    """The training config: config defaults < `ENV_DEFAULTS[env_name][algo]` < `hparams`.

    Environments with an `obs_layout` attribute (Routing-v0, the LLM routing envs) default to
    `network="set"` with `set_dims=env.obs_layout` unless their defaults name the MLP
    (LLMPrefixRouting-v0's); the others to the MLP.

    Raises:
      ValueError: unknown algorithm or hyperparameter, or an invalid value (naming the field).
    """
    if algo not in ALGOS:
        raise ValueError(f"unknown algorithm {algo!r}; expected one of {sorted(ALGOS)}")
    cls = ALGOS[algo][0]
    explicit = sorted(set(hparams) & set(_EXPLICIT))
    if explicit:
        raise ValueError(f"pass {explicit} as train()'s own arguments (total_steps, num_envs, "
                         f"seed), not as hyperparameters")
    known = {f.name for f in dataclasses.fields(cls)} - set(_EXPLICIT)
    unknown = sorted(set(hparams) - known)
    if unknown:
        raise ValueError(f"unknown {algo} hyperparameter(s) {unknown}; known: {sorted(known)}")
    fields = dict(ENV_DEFAULTS.get(env_name, {}).get(algo, {}))
    default_steps = fields.pop("total_steps", cls.total_timesteps)
    network = hparams.get("network", fields.get("network", "set"))
    if hasattr(env, "obs_layout") and network == "set":
        fields.setdefault("network", "set")
        fields["set_dims"] = tuple(env.obs_layout)
    fields.update(hparams)
    if num_envs is not None:
        fields["num_envs"] = num_envs
    total = default_steps if total_steps is None else total_steps
    return cls(total_timesteps=int(total), seed=int(seed), **fields)
