"""The policy registry: a dict of named factories, `register`, `get` and `names`.

A factory builds a policy from keyword options. Every factory accepts `env=` and `params=`
(factories that fit something to the scenario need them; the others ignore them), so callers
such as the CLI can pass the scenario uniformly.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable

from jaxserve.envs.base import POLICY_KINDS as KINDS


@dataclasses.dataclass(frozen=True, eq=False)
class Policy:
    """A named policy: `policy(key, obs, state, params) -> int32 action` plus what built it.

    Instances hash by identity, so they can be static arguments of `jax.jit`.

    Attributes:
      name: registry name (or a user label).
      kind: "routing", "batching", "autoscaling" or "prefix_routing" (LLMPrefixRouting-v0),
        the environment family the policy acts in.
      fn: the pure JAX function `fn(key, obs, state, params) -> action`.
      info: host-side facts about the policy (fitted thresholds, the SMDP table, a tuning
        grid...). Not used by `fn`.
    """

    name: str
    kind: str
    fn: Callable
    info: dict = dataclasses.field(default_factory=dict)

    def __call__(self, key, obs, state, params):
        return self.fn(key, obs, state, params)


_FACTORIES: dict[str, tuple[str, Callable]] = {}
_CACHEABLE: set[str] = set()
_CACHE: dict = {}


def register(name: str, kind: str, factory: Callable | None = None, *,
             scenario_free: bool = False):
    """Adds a policy factory `factory(env=None, params=None, **options) -> Policy`.

    Usable as a decorator (`@register("jsq", "routing")`) or called with the factory.
    `scenario_free=True` declares that the factory ignores `env` and `params`: `get` then
    returns the same `Policy` object for the same options, so jitted programs that take the
    policy as a static argument are reused instead of recompiled.
    Raises ValueError for a duplicate name or an unknown kind.
    """
    if kind not in KINDS:
        raise ValueError(f"policy kind must be one of {KINDS}, got {kind!r}")

    def deco(fn):
        if name in _FACTORIES:
            raise ValueError(f"policy {name!r} is already registered")
        _FACTORIES[name] = (kind, fn)
        if scenario_free:
            _CACHEABLE.add(name)
        return fn

    return deco if factory is None else deco(factory)


def names(kind: str | None = None) -> tuple[str, ...]:
    """Registered policy names (sorted), optionally only those of one `kind`."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"policy kind must be one of {KINDS}, got {kind!r}")
    return tuple(sorted(n for n, (k, _) in _FACTORIES.items() if kind is None or k == kind))


def kind_of(name: str) -> str:
    """The kind (one of `KINDS`) of a registered policy; ValueError if unknown."""
    _check(name)
    return _FACTORIES[name][0]


def _check(name: str) -> None:
    if name not in _FACTORIES:
        raise ValueError(f"unknown policy {name!r}; registered: {', '.join(names())}")


def options(name: str) -> tuple[str, ...]:
    """The keyword options the factory of `name` takes (besides `env` and `params`)."""
    _check(name)
    sig = inspect.signature(_FACTORIES[name][1])
    return tuple(p for p in sig.parameters if p not in ("env", "params"))


def get(name: str, **kwargs) -> Policy:
    """Builds the registered policy `name` with options `kwargs`.

    Raises:
      ValueError: unknown name (the message lists the registered ones), an option the factory
        does not take, or an invalid option value.
    """
    _check(name)
    kind, factory = _FACTORIES[name]
    sig = inspect.signature(factory)
    accepts_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    if not accepts_any:
        unknown = sorted(set(kwargs) - set(sig.parameters))
        if unknown:
            opts = [p for p in sig.parameters if p not in ("env", "params")]
            raise ValueError(f"policy {name!r} takes no option(s) {unknown}; options: {opts}")
    cache_key = None
    if name in _CACHEABLE:
        opts = tuple(sorted((k, v) for k, v in kwargs.items() if k not in ("env", "params")))
        try:
            hash(opts)
            cache_key = (name, opts)
        except TypeError:
            cache_key = None
        if cache_key in _CACHE:
            return _CACHE[cache_key]
    policy = factory(**kwargs)
    if not isinstance(policy, Policy):
        policy = Policy(name=name, kind=kind, fn=policy)
    if cache_key is not None:
        _CACHE[cache_key] = policy
    return policy
