"""Building the environment a training run uses: jaxserve ids and gymnax ids alike."""

from __future__ import annotations

import dataclasses
from typing import Any

import gymnax

import jaxserve


def make_env(env_name: str, overrides: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """Builds a jaxserve or gymnax environment with parameter overrides.

    Args:
      env_name: a jaxserve id (`jaxserve.registered_envs()`) or a gymnax id
        (`gymnax.registered_envs`).
      overrides: jaxserve: keyword overrides of `jaxserve.make`; gymnax: fields of the env's
        `EnvParams` to replace.

    Returns:
      `(env, env_params)`.

    Raises:
      ValueError: unknown environment or override, or a non-discrete action space.
    """


    overrides = dict(overrides or {})
    if env_name in jaxserve.registered_envs():
        env, params = jaxserve.make(env_name, **overrides)
    elif env_name in gymnax.registered_envs:
        env, params = gymnax.make(env_name)
        fields = {f.name for f in dataclasses.fields(params)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(f"unknown {env_name} parameter(s) {unknown}; known: {sorted(fields)}")
        params = params.replace(**overrides)
    else:
        raise ValueError(f"unknown environment {env_name!r}; jaxserve: "
                         f"{', '.join(jaxserve.registered_envs())}; or a gymnax id such as "
                         f"CartPole-v1")
    if not hasattr(env.action_space(params), "n"):
        raise ValueError(f"{env_name} has a continuous action space; the agents need a discrete "
                         f"one")
    return env, params
