"""The environment registry: `make(name, **overrides) -> (env, params)`.

The table of registered environments and `make`; nothing else. Each builder lives beside its
environment and owns that environment's default scenario (`envs.routing.make_routing`,
`envs.batching.make_batching`, `envs.autoscaling.make_autoscaling`,
`envs.llm_routing.make_llm_routing`, `envs.llm_autoscaling.make_llm_autoscaling`,
`envs.llm_prefix_routing.make_llm_prefix_routing`); the keywords every builder shares are
documented at `envs.defaults.build_params`.
"""

from __future__ import annotations

from typing import Callable

from jaxserve.envs.autoscaling import make_autoscaling
from jaxserve.envs.batching import make_batching
from jaxserve.envs.llm_autoscaling import make_llm_autoscaling
from jaxserve.envs.llm_prefix_routing import make_llm_prefix_routing
from jaxserve.envs.llm_routing import make_llm_routing
from jaxserve.envs.routing import make_routing

_REGISTRY: dict[str, Callable] = {
    "Routing-v0": make_routing,
    "Batching-v0": make_batching,
    "Autoscaling-v0": make_autoscaling,
    "LLMRouting-v0": make_llm_routing,
    "LLMAutoscaling-v0": make_llm_autoscaling,
    "LLMPrefixRouting-v0": make_llm_prefix_routing,
}


def register(name: str):
    """Decorator adding an environment builder `builder(**overrides) -> (env, params)`."""
    def deco(fn):
        if name in _REGISTRY:
            raise ValueError(f"environment {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn
    return deco


def registered_envs() -> tuple[str, ...]:
    """Names accepted by `make`."""
    return tuple(sorted(_REGISTRY))


def make(name: str, **overrides):
    """Builds environment `name` with its default scenario and `overrides`.

    Returns:
      (env, params): a gymnax `Environment` and its `ServingParams`.
    Raises:
      ValueError: unknown name, unknown override, or an invalid value (naming the field).
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown environment {name!r}; registered: {', '.join(registered_envs())}")
    return _REGISTRY[name](**overrides)
