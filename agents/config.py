"""Frozen training configurations for PPO and REINFORCE.

Every field is static: it fixes array shapes, loop lengths or the compiled program, so a
change means a recompile. Validation runs in `__post_init__` on the host and raises
`ValueError` naming the offending field. Configurations round-trip through JSON with
`to_dict` / `config_from_dict` (used by `agents.checkpoint`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

NETWORK_KINDS = ("mlp", "set")
SET_MIXERS = ("attention", "mean")
ACTIVATIONS = ("tanh", "relu")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Fields shared by every agent.

    Attributes:
      num_envs: environments stepped in parallel (vmapped; the axis sharded across devices).
      num_steps: rollout length per environment per update.
      total_timesteps: environment steps over the whole run; the number of updates is
        `total_timesteps // (num_envs * num_steps)`.
      lr: Adam learning rate.
      anneal_lr: anneal the learning rate linearly to 0 over all gradient steps.
      gamma: discount factor, applied once per step, or once per `discount_time_s` seconds of
        simulated time when that is set.
      discount_time_s: for semi-Markov environments whose steps last different amounts of
        simulated time (Batching-v0: a wait lasts one arrival gap, a dispatch until the GPU
        frees): discount each step by `gamma ** (info["elapsed"] / discount_time_s)`, so the
        horizon is a span of time rather than a number of decisions. `None` discounts per
        step. The env must report `info["elapsed"]` (seconds).
      ent_coef: weight of the entropy bonus.
      vf_coef: weight of the value loss.
      max_grad_norm: global-norm gradient clipping threshold.
      normalize_advantages: standardise advantages (per minibatch for PPO, per batch for
        REINFORCE).
      network: "mlp" (`MLPActorCritic`) or "set" (`SetActorCritic`, needs `set_dims`).
      hidden_sizes: widths of the hidden layers (MLP towers / set encoder).
      activation: "tanh" or "relu".
      set_dims: `(R, N, G)` = request features, GPUs, features per GPU, for `network="set"`.
      set_mixer: "attention" or "mean", how the set network mixes across GPUs.
      num_heads: attention heads of the set network (must divide `hidden_sizes[-1]`).
      seed: default seed for scripts (`jax.random.key(seed)`); `train(key)` takes its key.
    """

    num_envs: int = 4
    num_steps: int = 128
    total_timesteps: int = 500_000
    lr: float = 2.5e-4
    anneal_lr: bool = True
    gamma: float = 0.99
    discount_time_s: float | None = None
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    normalize_advantages: bool = True
    network: str = "mlp"
    hidden_sizes: tuple[int, ...] = (64, 64)
    activation: str = "tanh"
    set_dims: tuple[int, int, int] | None = None
    set_mixer: str = "attention"
    num_heads: int = 4
    seed: int = 0

    # Loss coefficients that are runtime arrays (`AgentState.hparams`), so sweeps can vmap
    # over them; `lr` is always traced too (see `agents.trainer`).
    traced_loss_hparams: ClassVar[tuple[str, ...]] = ("ent_coef",)

    def __post_init__(self) -> None:
        # JSON gives lists back: normalise to tuples so configs stay hashable.
        object.__setattr__(self, "hidden_sizes", tuple(int(h) for h in self.hidden_sizes))
        if self.set_dims is not None:
            object.__setattr__(self, "set_dims", tuple(int(d) for d in self.set_dims))
        self._validate()

    def _validate(self) -> None:
        for name in ("num_envs", "num_steps", "total_timesteps", "num_heads"):
            _positive_int(self, name)
        _in_range(self, "lr", 0.0, None, low_open=True)
        _in_range(self, "gamma", 0.0, 1.0)
        if self.discount_time_s is not None:
            _in_range(self, "discount_time_s", 0.0, None, low_open=True)
        for name in ("ent_coef", "vf_coef"):
            _in_range(self, name, 0.0, None)
        _in_range(self, "max_grad_norm", 0.0, None, low_open=True)
        _one_of(self, "network", NETWORK_KINDS)
        _one_of(self, "activation", ACTIVATIONS)
        _one_of(self, "set_mixer", SET_MIXERS)
        if len(self.hidden_sizes) == 0 or any(h < 1 for h in self.hidden_sizes):
            raise ValueError(
                f"hidden_sizes must be non-empty positive ints, got {self.hidden_sizes}"
            )
        if self.network == "set":
            if self.set_dims is None or len(self.set_dims) != 3 or min(self.set_dims) < 1:
                raise ValueError(
                    f"network='set' needs set_dims=(R, N, G) of positive ints, got {self.set_dims}"
                )
            if self.set_mixer == "attention" and self.hidden_sizes[-1] % self.num_heads:
                raise ValueError(
                    f"num_heads={self.num_heads} must divide "
                    f"hidden_sizes[-1]={self.hidden_sizes[-1]}"
                )
        if self.total_timesteps < self.batch_size:
            raise ValueError(
                f"total_timesteps={self.total_timesteps} is less than one update's "
                f"num_envs * num_steps = {self.batch_size}"
            )

    @property
    def batch_size(self) -> int:
        """Transitions per update: `num_envs * num_steps`."""
        return self.num_envs * self.num_steps

    @property
    def num_updates(self) -> int:
        """Updates in a full run: `total_timesteps // batch_size`."""
        return self.total_timesteps // self.batch_size

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: `{"type": class name, **fields}`."""
        return {"type": type(self).__name__, **dataclasses.asdict(self)}


@dataclasses.dataclass(frozen=True)
class PPOConfig(TrainConfig):
    """PPO (clipped surrogate, GAE, minibatch epochs). Defaults follow PureJaxRL's CartPole.

    Attributes (besides `TrainConfig`'s):
      gae_lambda: GAE lambda.
      clip_eps: PPO ratio clip; also clips the value update when `clip_value` is True.
      clip_value: use the clipped value loss of PPO2 / PureJaxRL.
      update_epochs: passes over each rollout.
      num_minibatches: minibatches per epoch; must divide `num_envs * num_steps`.
    """

    gae_lambda: float = 0.95
    clip_eps: float = 0.2
    clip_value: bool = True
    update_epochs: int = 4
    num_minibatches: int = 4

    traced_loss_hparams: ClassVar[tuple[str, ...]] = ("ent_coef", "clip_eps")

    def _validate(self) -> None:
        super()._validate()
        _positive_int(self, "update_epochs")
        _positive_int(self, "num_minibatches")
        _in_range(self, "gae_lambda", 0.0, 1.0)
        _in_range(self, "clip_eps", 0.0, None, low_open=True)
        if self.batch_size % self.num_minibatches:
            raise ValueError(
                f"num_envs * num_steps = {self.batch_size} must be divisible by "
                f"num_minibatches={self.num_minibatches}"
            )

    @property
    def minibatch_size(self) -> int:
        """Transitions per minibatch."""
        return self.batch_size // self.num_minibatches

    @property
    def grad_steps_per_update(self) -> int:
        """Optimizer steps per update: `update_epochs * num_minibatches`."""
        return self.update_epochs * self.num_minibatches


@dataclasses.dataclass(frozen=True)
class REINFORCEConfig(TrainConfig):
    """REINFORCE with a learned value baseline: one full-batch gradient step per rollout.

    Returns are Monte Carlo over the rollout, bootstrapped with the critic at the rollout end
    and at truncations (equivalently GAE with lambda = 1).
    """

    lr: float = 1e-3
    grad_steps_per_update: ClassVar[int] = 1


CONFIG_TYPES: dict[str, type[TrainConfig]] = {
    "PPOConfig": PPOConfig,
    "REINFORCEConfig": REINFORCEConfig,
}


def config_from_dict(d: dict[str, Any]) -> TrainConfig:
    """Rebuilds a config from `TrainConfig.to_dict` output.

    Raises:
      ValueError: unknown `type`, or unknown/invalid fields.
    """
    d = dict(d)
    name = d.pop("type", None)
    if name not in CONFIG_TYPES:
        raise ValueError(f"unknown config type {name!r}; expected one of {sorted(CONFIG_TYPES)}")
    cls = CONFIG_TYPES[name]
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"unknown {name} fields: {unknown}")
    return cls(**d)


def _positive_int(cfg: TrainConfig, name: str) -> None:
    v = getattr(cfg, name)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")


def _in_range(
    cfg: TrainConfig, name: str, low: float, high: float | None, low_open: bool = False
) -> None:
    v = getattr(cfg, name)
    bad = v <= low if low_open else v < low
    if high is not None:
        bad = bad or v > high
    if bad:
        bound = f"{'(' if low_open else '['}{low}, {high if high is not None else 'inf'}]"
        raise ValueError(f"{name} must be in {bound}, got {v!r}")


def _one_of(cfg: TrainConfig, name: str, options: tuple[str, ...]) -> None:
    v = getattr(cfg, name)
    if v not in options:
        raise ValueError(f"{name} must be one of {options}, got {v!r}")
