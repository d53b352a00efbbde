"""Actor-critic networks (Flax linen) and a registry to build them from a config.

Every network maps a batch of flat observations `(..., obs_dim)` to
`(logits (..., num_actions), value (...))`.

* `MLPActorCritic`: separate tanh/relu MLP towers for actor and critic (PureJaxRL style).
* `SetActorCritic`: permutation-equivariant network for routing observations
  `concat(request_features (R,), gpu_features (N * G,) row-major)`. One logit per GPU, so
  the action is a GPU index; its parameters do not depend on N, so one set of parameters
  serves clusters of any size.
"""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.agents.config import TrainConfig

ACTIVATION_FNS: dict[str, Callable[[jax.Array], jax.Array]] = {"tanh": nn.tanh, "relu": nn.relu}


def _householder_q(a: jax.Array) -> jax.Array:
    """The `Q` of `a = Q R` (`a` is `(m, n)`, `m >= n`; `Q` is `(m, n)`), with `R`'s diagonal
    made non-negative: the same matrix `jnp.linalg.qr` plus a sign fix gives, up to rounding.

    Householder reflections in plain array operations (a `fori_loop` over the `n` columns).
    Not `jnp.linalg.qr`: when network initialisation is `vmap`ped over seeds on CPU, that
    lowers to jaxlib's batched LAPACK kernel, which in jaxlib 0.10 fans the batch out on XLA's
    intra-op thread pool and blocks a pool thread until it is done; with as many QRs running at
    once as the pool has threads (two layers' on a 2-core machine), every thread waits for work
    queued behind it and the training program never finishes (`docs/troubleshooting.md`).
    """
    m, n = a.shape
    rows = jnp.arange(m)

    def reflect(j, carry):
        r, q = carry
        x = jnp.where(rows >= j, r[:, j], 0.0)
        norm = jnp.sqrt(jnp.sum(x * x))
        alpha = -jnp.where(x[j] < 0, -1.0, 1.0) * norm  # R[j, j], sign chosen for stability
        v = x.at[j].add(-alpha)
        vv = jnp.sum(v * v)
        beta = jnp.where(vv > 0, 2.0 / jnp.where(vv > 0, vv, 1.0), 0.0)
        r = r - beta * jnp.outer(v, v @ r)
        q = q - beta * jnp.outer(q @ v, v)
        return r, q

    r, q = jax.lax.fori_loop(0, n, reflect, (a, jnp.eye(m, dtype=a.dtype)))
    sign = jnp.where(jnp.diagonal(r) < 0, -1.0, 1.0).astype(a.dtype)
    return q[:, :n] * sign[None, :]


def orthogonal(scale: float = 1.0) -> Callable:
    """A Flax kernel initialiser: `scale` times a uniformly random (Haar) orthogonal matrix.

    The same law (and, for the same key, the same values up to float32 rounding) as
    `flax.linen.initializers.orthogonal(scale)` for 2-D kernels, without LAPACK (see
    `_householder_q`), so it is safe to `vmap` on any CPU.
    """

    def init(key: jax.Array, shape, dtype=jnp.float32) -> jax.Array:
        if len(shape) != 2:
            raise ValueError(f"orthogonal initialisation needs a 2-D kernel, got shape {shape}")
        rows, cols = shape
        tall = (rows, cols) if rows >= cols else (cols, rows)
        q = _householder_q(jax.random.normal(key, tall, jnp.float32))
        q = q if rows >= cols else q.T
        return (scale * q).astype(dtype)

    return init


def _dense(features: int, scale: float = np.sqrt(2.0)) -> nn.Dense:
    return nn.Dense(features, kernel_init=orthogonal(scale),
                    bias_init=nn.initializers.constant(0.0))


class MLP(nn.Module):
    """Hidden layers only: `(..., D) -> (..., hidden_sizes[-1])`."""

    hidden_sizes: tuple[int, ...]
    activation: str = "tanh"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        act = ACTIVATION_FNS[self.activation]
        for h in self.hidden_sizes:
            x = act(_dense(h)(x))
        return x


class MLPActorCritic(nn.Module):
    """Separate actor and critic MLPs on a flat observation.

    Attributes:
      num_actions: number of discrete actions A.
      hidden_sizes: hidden widths of each tower.
      activation: "tanh" or "relu".
    """

    num_actions: int
    hidden_sizes: tuple[int, ...] = (64, 64)
    activation: str = "tanh"

    @nn.compact
    def __call__(self, obs: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Args: obs `(..., obs_dim)`. Returns: logits `(..., A)`, value `(...)`."""
        obs = obs.astype(jnp.float32)
        actor = MLP(self.hidden_sizes, self.activation)(obs)
        logits = _dense(self.num_actions, 0.01)(actor)
        critic = MLP(self.hidden_sizes, self.activation)(obs)
        value = _dense(1, 1.0)(critic)[..., 0]
        return logits, value


class SetActorCritic(nn.Module):
    """Permutation-equivariant actor-critic over GPU rows.

    The observation `(..., R + N * G)` is split into request features `(..., R)` and GPU rows
    `(..., N, G)`. Each row, concatenated with the request features, goes through a shared
    encoder MLP; rows are then mixed across GPUs by one residual self-attention layer
    (`mixer="attention"`) or by concatenating the mean over GPUs (`mixer="mean"`); a shared
    head gives one logit per GPU. The value reads the mean over GPUs. Permuting GPU rows
    permutes the logits and leaves the value unchanged.

    Attributes:
      num_request_features: R.
      num_gpus: N; a static check of the observation size only, parameters do not depend on it.
      gpu_features: G.
      hidden_sizes: widths of the shared encoder; the last one is the embedding width H.
      mixer: "attention" or "mean".
      num_heads: attention heads (must divide H).
      activation: "tanh" or "relu".
    """

    num_request_features: int
    num_gpus: int
    gpu_features: int
    hidden_sizes: tuple[int, ...] = (64, 64)
    mixer: str = "attention"
    num_heads: int = 4
    activation: str = "tanh"

    @nn.compact
    def __call__(self, obs: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Args: obs `(..., R + N * G)`. Returns: logits `(..., N)`, value `(...)`."""
        r, n, g = self.num_request_features, self.num_gpus, self.gpu_features
        if obs.shape[-1] != r + n * g:
            raise ValueError(
                f"SetActorCritic expects obs_dim R + N*G = {r} + {n}*{g} = {r + n * g}, "
                f"got {obs.shape[-1]}"
            )
        act = ACTIVATION_FNS[self.activation]
        obs = obs.astype(jnp.float32)
        request = obs[..., :r]  # (..., R)
        gpus = obs[..., r:].reshape(obs.shape[:-1] + (n, g))  # (..., N, G)
        request_b = jnp.broadcast_to(request[..., None, :], gpus.shape[:-1] + (r,))
        h = MLP(self.hidden_sizes, self.activation)(jnp.concatenate([gpus, request_b], -1))
        width = self.hidden_sizes[-1]  # h: (..., N, H)
        if self.mixer == "attention":
            mixed = nn.MultiHeadDotProductAttention(
                num_heads=self.num_heads, qkv_features=width, out_features=width
            )(h, h)
            h = nn.LayerNorm()(h + mixed)
        else:
            pooled = jnp.broadcast_to(h.mean(axis=-2, keepdims=True), h.shape)
            h = act(_dense(width)(jnp.concatenate([h, pooled], -1)))
        logits = _dense(1, 0.01)(act(_dense(width)(h)))[..., 0]  # (..., N)
        pooled = jnp.concatenate([h.mean(axis=-2), request], -1)  # (..., H + R)
        value = _dense(1, 1.0)(act(_dense(width)(pooled)))[..., 0]
        return logits, value


def _build_mlp(config: TrainConfig, num_actions: int) -> nn.Module:
    return MLPActorCritic(num_actions, config.hidden_sizes, config.activation)


def _build_set(config: TrainConfig, num_actions: int) -> nn.Module:
    r, n, g = config.set_dims
    if num_actions != n:
        raise ValueError(f"network='set' gives one action per GPU (N={n}), env has {num_actions}")
    return SetActorCritic(r, n, g, config.hidden_sizes, config.set_mixer, config.num_heads,
                          config.activation)


NETWORKS: dict[str, Callable[[TrainConfig, int], nn.Module]] = {
    "mlp": _build_mlp,
    "set": _build_set,
}


def make_network(config: TrainConfig, num_actions: int) -> nn.Module:
    """Builds the actor-critic named by `config.network`.

    Args:
      config: a training config (uses network, hidden_sizes, activation, set_* fields).
      num_actions: size of the env's discrete action space.

    Returns:
      An `nn.Module` mapping `(..., obs_dim)` to `(logits (..., num_actions), value (...))`.
    """
    return NETWORKS[config.network](config, num_actions)
