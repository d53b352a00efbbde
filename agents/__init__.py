"""JAX RL agents (PPO, REINFORCE) for gymnax-API environments, PureJaxRL style but typed.

Modules: `config` (frozen configs), `networks` (MLP and permutation-equivariant set
actor-critics), `rollout` (vmapped rollouts, episode stats), `returns` (truncation-aware GAE),
`trainer` (shared chunked training loop), `ppo`, `reinforce`, `checkpoint` (orbax save and
restore), `sharding` (data-parallel runs over `jax.devices()`).
"""

from jaxserve.agents import ppo, reinforce
from jaxserve.agents.checkpoint import Checkpoint, restore_checkpoint, save_checkpoint
from jaxserve.agents.config import PPOConfig, REINFORCEConfig, TrainConfig, config_from_dict
from jaxserve.agents.networks import MLPActorCritic, SetActorCritic, make_network
from jaxserve.agents.returns import gae, standardize
from jaxserve.agents.rollout import EpisodeStats, RunnerState, Transition, collect_rollout
from jaxserve.agents.sharding import make_mesh, shard_runner_state, shard_trainer
from jaxserve.agents.trainer import Trainer, TrainOutput

__all__ = [
    "Checkpoint",
    "EpisodeStats",
    "MLPActorCritic",
    "PPOConfig",
    "REINFORCEConfig",
    "RunnerState",
    "SetActorCritic",
    "TrainConfig",
    "TrainOutput",
    "Trainer",
    "Transition",
    "collect_rollout",
    "config_from_dict",
    "gae",
    "make_mesh",
    "make_network",
    "ppo",
    "reinforce",
    "restore_checkpoint",
    "save_checkpoint",
    "shard_runner_state",
    "shard_trainer",
    "standardize",
]

from jaxserve.agents.train import LearnedPolicy, TrainResult, make_env, train  # noqa: E402

__all__ += ["LearnedPolicy", "TrainResult", "make_env", "train"]
