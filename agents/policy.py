"""A trained actor as a jaxserve policy (the shared `policy(key, obs, state, params)` form)."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True, eq=False)
class LearnedPolicy:
    """A trained actor as a jaxserve policy: `policy(key, obs, state, params) -> int32 action`.

    Greedy (argmax of the logits) by default, else sampled. Reads only `obs`; works on one
    observation or a batch. Hashes by identity, so it can be a static argument of `jax.jit`
    (as `jaxserve.evaluate_many` uses policies).

    Attributes:
      network: the actor-critic module; params: its parameters; greedy: argmax vs sample;
      name: a label for tables.
    """

    network: nn.Module
    params: Any
    greedy: bool = True
    name: str = "learned"

    def __call__(self, key, obs, state=None, params=None):
        logits, _ = self.network.apply(self.params, obs)
        if self.greedy:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return jax.random.categorical(key, logits).astype(jnp.int32)
