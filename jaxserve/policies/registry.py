"""The policy registry: named factories keyed by (kind, name), with `register`,
`register_function`, `get`, `names`, `options`, `kinds_of` and `kind_of`.

A policy's kind is the environment family it acts in (`KINDS`, defined once as
`envs.base.POLICY_KINDS`: "routing" for Routing-v0, "batching", "autoscaling",
"prefix_routing" for LLMPrefixRouting-v0, "llm_routing" for LLMRouting-v0). A name is unique
within a kind, not across kinds: Routing-v0's `sita_prompt` (a fitted SITA) and
LLMRouting-v0's (a prompt-length threshold) are two registrations, `("routing",
"sita_prompt")` and `("llm_routing", "sita_prompt")`. A rule written once for several
environments (random, round_robin, power_of_two, least_marginal: `policies.generic`, reading
the engine only through `core.engines`) is registered ONCE for several kinds, so each router
exists once in the registry.

`get(name)` without `kind=` works while the name is unambiguous: held by one kind, or by one
registration covering several kinds; otherwise it raises ValueError naming the kinds that
hold it. A factory builds a policy from keyword options. Every factory accepts `env=` and
`params=` (factories that fit something to the scenario need them; the others ignore them),
so callers such as the CLI can pass the scenario uniformly.
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
      kind: the environment family the policy was got for, one of `KINDS`: "routing"
        (Routing-v0), "batching", "autoscaling", "prefix_routing" (LLMPrefixRouting-v0) or
        "llm_routing" (LLMRouting-v0).
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


@dataclasses.dataclass(frozen=True, eq=False)
class _Entry:
    """One registration: `name`, the kinds it serves (the first is its primary kind, that of
    `get(name)` without `kind=`), its factory and whether it ignores the scenario."""

    name: str
    kinds: tuple[str, ...]
    factory: Callable
    scenario_free: bool


_ENTRIES: dict[tuple[str, str], _Entry] = {}  # (kind, name) -> registration
_CACHE: dict = {}


def _check_kind(kind) -> None:
    if kind not in KINDS:
        raise ValueError(f"policy kind must be one of {KINDS}, got {kind!r}")


def register(name: str, kind: str | tuple[str, ...], factory: Callable | None = None, *,
             scenario_free: bool = False):
    """Adds a policy factory `factory(env=None, params=None, **options) -> Policy` under
    `(kind, name)`.

    Usable as a decorator (`@register("jsq", "routing")`) or called with the factory. `kind`
    is one of `KINDS`, or a tuple of them: one registration serving each of those kinds (a
    rule shared by several environments, registered once), the first being its primary kind.
    `scenario_free=True` declares that the factory ignores `env` and `params`: `get` then
    returns the same `Policy` object for the same kind and options, so jitted programs that
    take the policy as a static argument are reused instead of recompiled.
    Raises ValueError for an unknown kind, an empty or repeated kind tuple, or a `(kind,
    name)` pair already registered.
    """
    kinds = tuple(kind) if isinstance(kind, (tuple, list)) else (kind,)
    if not kinds or len(set(kinds)) != len(kinds):
        raise ValueError(f"policy {name!r}: kinds must be distinct and non-empty, got {kind!r}")
    for k in kinds:
        _check_kind(k)

    def deco(fn):
        taken = [k for k in kinds if (k, name) in _ENTRIES]
        if taken:
            raise ValueError(f"policy {name!r} is already registered for kind(s) {taken}")
        entry = _Entry(name=name, kinds=kinds, factory=fn, scenario_free=scenario_free)
        for k in kinds:
            _ENTRIES[(k, name)] = entry
        return fn

    return deco if factory is None else deco(factory)


def register_function(name: str, kind: str | tuple[str, ...], fn: Callable,
                      doc: str | None = None) -> Callable:
    """Registers the fixed policy function `fn(key, obs, state, params) -> action` (no
    options, scenario-free) under `(kind, name)` (`kind` a kind or a tuple of kinds, as in
    `register`); its factory's docstring is `doc`, else the first paragraph of `fn`'s.
    Returns `fn`."""
    primary = kind[0] if isinstance(kind, (tuple, list)) and kind else kind

    def factory(env=None, params=None):
        return Policy(name=name, kind=primary, fn=fn)

    factory.__doc__ = doc if doc is not None else (fn.__doc__ or "").split("\n\n")[0]
    register(name, kind, factory, scenario_free=True)
    return fn


def names(kind: str | None = None) -> tuple[str, ...]:
    """Registered policy names (sorted, each once), optionally only those of one `kind`."""
    if kind is not None:
        _check_kind(kind)
    return tuple(sorted({n for k, n in _ENTRIES if kind is None or k == kind}))


def kinds_of(name: str) -> tuple[str, ...]:
    """The kinds holding a policy `name`, in `KINDS` order (several for a rule registered
    for several kinds, or for different policies sharing a name); ValueError if none."""
    kinds = tuple(k for k in KINDS if (k, name) in _ENTRIES)
    if not kinds:
        raise ValueError(f"unknown policy {name!r}; registered: {', '.join(names())}")
    return kinds


def kind_of(name: str) -> str:
    """The one kind (of `KINDS`) holding policy `name`. ValueError if the name is unknown or
    held by several kinds (then `kinds_of` lists them)."""
    kinds = kinds_of(name)
    if len(kinds) > 1:
        raise ValueError(f"policy {name!r} is held by several kinds {kinds}: use "
                         f"kinds_of({name!r}), or pass kind= where a policy is looked up")
    return kinds[0]


def _resolve(name: str, kind: str | None) -> tuple[str, _Entry]:
    """The kind and registration that `(name, kind)` designate, or a ValueError saying what is
    registered."""
    if kind is not None:
        _check_kind(kind)
        entry = _ENTRIES.get((kind, name))
        if entry is None:
            others = [k for k in KINDS if (k, name) in _ENTRIES]
            held = f" ({name!r} is a policy of kind(s) {others})" if others else ""
            raise ValueError(f"unknown {kind} policy {name!r}{held}; registered {kind} "
                             f"policies: {', '.join(names(kind))}")
        return kind, entry
    entries = []
    for k in kinds_of(name):
        if not any(e is _ENTRIES[(k, name)] for e in entries):
            entries.append(_ENTRIES[(k, name)])
    if len(entries) > 1:
        kinds = kinds_of(name)
        raise ValueError(f"policy {name!r} is ambiguous: kinds {kinds} hold different "
                         f"policies of that name; pass kind= (one of {kinds})")
    return entries[0].kinds[0], entries[0]


def options(name: str, kind: str | None = None) -> tuple[str, ...]:
    """The keyword options the factory of `(kind, name)` takes (besides `env` and `params`);
    `kind` may be left out where `name` is unambiguous (as in `get`)."""
    _, entry = _resolve(name, kind)
    sig = inspect.signature(entry.factory)
    return tuple(p for p in sig.parameters if p not in ("env", "params"))


def get(name: str, kind: str | None = None, **kwargs) -> Policy:
    """Builds the registered policy `(kind, name)` with options `kwargs`.

    With `kind` left out, `name` must be unambiguous: held by one kind, or by one registration
    covering several kinds, which then builds it for its primary kind (the first it was
    registered for). The returned `Policy` has `kind` set to the kind it was got for.

    Raises:
      ValueError: unknown name or kind (the message lists the registered ones), a name held by
        several kinds as different policies without `kind=` (the message names the kinds), an
        option the factory does not take, or an invalid option value.
    """
    kind, entry = _resolve(name, kind)
    factory = entry.factory
    sig = inspect.signature(factory)
    accepts_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    if not accepts_any:
        unknown = sorted(set(kwargs) - set(sig.parameters))
        if unknown:
            opts = [p for p in sig.parameters if p not in ("env", "params")]
            raise ValueError(f"policy {name!r} takes no option(s) {unknown}; options: {opts}")
    cache_key = None
    if entry.scenario_free:
        opts = tuple(sorted((k, v) for k, v in kwargs.items() if k not in ("env", "params")))
        try:
            hash(opts)
            cache_key = (kind, name, opts)
        except TypeError:
            cache_key = None
        if cache_key in _CACHE:
            return _CACHE[cache_key]
    policy = factory(**kwargs)
    if not isinstance(policy, Policy):
        policy = Policy(name=name, kind=kind, fn=policy)
    elif policy.kind != kind:
        policy = dataclasses.replace(policy, kind=kind)
    if cache_key is not None:
        _CACHE[cache_key] = policy
    return policy
