"""What every jaxserve environment shares beyond the gymnax API.

* `policy_kind`: each environment class names the family of registered policies that act in
  it (`"routing"`, `"batching"`, `"autoscaling"`; None for an environment without
  registered heuristics, such as LLMRouting-v0, whose heuristics are plain functions). The
  harness, the CLIs and the policy registry read this attribute instead of switching on
  classes.
* `with_static(env, **changes)`: `env.replace_static(...)` cached, the one place a variant of
  an environment (a replay window, a per-request log) is built, so jit, which keys its cache
  on the static `env`, compiles each variant once.
* Observation clipping: `clip_features` and `feature_box`, one bound (`FEATURE_CLIP`) so that
  every feature is finite and inside the observation space at any load.

The static-configuration mixin (`StaticConfig`: `STATIC_FIELDS`, hashing by value,
`replace_static`, the lean auto-reset `step`) still lives in `envs/common.py`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from gymnax.environments import spaces

POLICY_KINDS = ("routing", "batching", "autoscaling")
FEATURE_CLIP = 1e3  # keeps time features finite and inside the observation space at any load


def policy_kind(env: Any) -> str:
    """The registered-policy family of `env` (its `policy_kind` attribute).

    Raises:
      ValueError: `env` is not a jaxserve environment with registered policies.
    """
    kind = getattr(env, "policy_kind", None)
    if kind not in POLICY_KINDS:
        raise ValueError(f"not a jaxserve Routing, Batching or Autoscaling environment: "
                         f"{type(env).__name__}")
    return kind


@functools.lru_cache(maxsize=64)
def _with_static(env, changes: tuple) -> Any:
    return env.replace_static(**dict(changes))


def with_static(env, **changes) -> Any:
    """`env.replace_static(**changes)`, the same object for equal `(env, changes)`.

    Environments hash by value (static configuration and default params), so equal
    scenarios share one variant and one compilation of every jitted function that takes it
    as a static argument.
    """
    return _with_static(env, tuple(sorted(changes.items())))


def clip_features(feats: jax.Array) -> jax.Array:
    """float32 features with NaN mapped to 0 and everything clipped to `[0, FEATURE_CLIP]`."""
    return jnp.clip(jnp.nan_to_num(feats), 0.0, FEATURE_CLIP).astype(jnp.float32)


def feature_box(shape: tuple[int, ...]) -> spaces.Box:
    """The observation space of features built with `clip_features`."""
    return spaces.Box(0.0, FEATURE_CLIP, shape, jnp.float32)
