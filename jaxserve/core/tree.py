"""Pytree helpers shared by the engine, the environments and the episode drivers."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def select(flag, new, old):
    """`new` where `flag` else `old`, leaf by leaf (an exact `jnp.where`).

    Args:
      flag: bool, a scalar or `(E,)` for leaves with a leading batch axis `E`; it is
        broadcast over each leaf's trailing axes.
      new, old: pytrees of the same structure and leaf shapes.
    """
    flag = jnp.asarray(flag)

    def one(n, o):
        return jnp.where(flag.reshape(flag.shape + (1,) * (jnp.ndim(n) - flag.ndim)), n, o)

    return jax.tree.map(one, new, old)
