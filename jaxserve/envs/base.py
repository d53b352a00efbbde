"""What every jaxserve environment shares beyond the gymnax API.

* Static configuration (`StaticConfig`): each environment class names a frozen dataclass of
  its shapes and other compile-time choices (`Static`, e.g. `RoutingStatic`), validated in its
  `__post_init__` (ValueError), as Craftax's `StaticEnvParams`. The instance holds it as
  `env.static`, reads its fields as attributes (`env.num_gpus`), hashes by it and by the
  default params' values, and rebuilds with some fields changed with `replace_static`.
  Everything a user may sweep is an array leaf of the params, so `vmap` over params needs no
  recompile. The mixin also carries the lean auto-reset `step` of the serving environments.
* `policy_kind`: each environment class names the family of registered policies that act in
  it (one of `POLICY_KINDS`: `"routing"`, `"batching"`, `"autoscaling"`, `"prefix_routing"`
  (LLMPrefixRouting-v0), `"llm_routing"` (LLMRouting-v0), `"disagg_routing"`
  (LLMDisaggRouting-v0); None for an environment without
  registered heuristics). The harness, the CLIs and the policy registry (keyed by kind and
  name) read this attribute instead of switching on classes.
* The serving engine (`ENGINE`, a class attribute: `core.engines.STATIC` or `CONTINUOUS`):
  `env.with_engine(engine)` runs the same environment on another configuration of it (e.g.
  `ContinuousEngine(decode_runs=False)`, or a benchmark's `mode="off"`), the one supported
  way to change what the step's engine does; the engine is part of the environment's
  identity (hash, jit cache).
* `with_static(env, **changes)`: `env.replace_static(...)` cached, the one place a variant of
  an environment (a replay window, a per-request log) is built, so jit, which keys its cache
  on the static `env`, compiles each variant once.
* Observation clipping: `clip_features` and `feature_box`, one bound (`FEATURE_CLIP`) so that
  every feature is finite and inside the observation space at any load.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from gymnax.environments import spaces

from jaxserve.core import rng
from jaxserve.core.types import INT32_MAX, MAX_SLOTS
from jaxserve.envs import common

# Every family of registered policies, defined here once (`policies.registry` reads it as
# `KINDS`): an environment class's `policy_kind` is one of them or None.
POLICY_KINDS = ("routing", "batching", "autoscaling", "prefix_routing", "llm_routing",
                "disagg_routing")
# The families the evaluation harness and CLIs handle (`policy_kind`); the LLM environments'
# routers ("prefix_routing", "llm_routing") are compared by `scripts/prefix_routers.py` and
# `agents.experiments.llm_routing_study` instead.
EVALUATED_KINDS = ("routing", "batching", "autoscaling")
FEATURE_CLIP = 1e3  # keeps time features finite and inside the observation space at any load


def policy_kind(env: Any) -> str:
    """The registered-policy family of `env` (its `policy_kind` attribute), one of
    `EVALUATED_KINDS`.

    Raises:
      ValueError: `env` is not a jaxserve environment whose registered policies the
        evaluation CLIs handle.
    """
    kind = getattr(env, "policy_kind", None)
    if kind not in EVALUATED_KINDS:
        why = (f" (its {kind!r} policies are compared outside the evaluation CLIs)"
               if isinstance(kind, str) and kind in POLICY_KINDS else "")
        raise ValueError(f"not a jaxserve Routing, Batching or Autoscaling environment: "
                         f"{type(env).__name__}{why}")
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


# ------------------------------------------------------------------------ static configuration

def check_sizes(static: Any, positive: tuple[str, ...] = (),
                nonnegative: tuple[str, ...] = (), slots: tuple[str, ...] = ()) -> None:
    """Validates integer fields of a frozen static dataclass (call from its `__post_init__`).

    Each named field must be an integer (an integral float or numpy integer is accepted and
    stored as a Python int, so equal configurations hash equal): `positive` ones >= 1,
    `nonnegative` ones >= 0, `slots` ones (queue and batch slots per GPU or replica) in
    `[1, MAX_SLOTS]`.

    Raises:
      ValueError: naming the first field that is not an integer or is out of range.
    """
    for names, low, high in ((positive, 1, INT32_MAX), (nonnegative, 0, INT32_MAX),
                             (slots, 1, MAX_SLOTS)):
        for name in names:
            v = getattr(static, name)
            object.__setattr__(static, name, as_size(name, v, low, high))  # frozen: set once


def as_size(name: str, value: Any, low: int = 1, high: int = INT32_MAX) -> int:
    """`value` as a Python int in `[low, high]` (static sizes index int32 arrays: `high` is at
    most 2^31 - 1; slot counts pass `high=MAX_SLOTS`).

    An integral float or numpy integer is accepted; strings (`"4"`), booleans, non-integral
    or non-finite numbers are refused.

    Raises:
      ValueError: naming `name`.
    """
    if isinstance(value, (bool, np.bool_, str, bytes)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        i = int(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if i != value:
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if i < low:
        raise ValueError(f"{name} must be >= {low}, got {value!r}")
    if i > high:
        what = " (MAX_SLOTS: queue and batch slots per GPU or replica)" if high == MAX_SLOTS else ""
        raise ValueError(f"{name} must be <= {high}{what}, got {value!r}")
    return i


class StaticConfig:
    """Mixin for the serving environments: typed static configuration and a bandwidth-lean step.

    A subclass sets `Static` to a frozen dataclass of its static fields (shapes such as the
    number of GPUs and the queue buffer, and Python-level choices such as the reward's form).
    The constructor takes those fields (positionally in the dataclass's order, or by name)
    and the default params:

        env = Routing(num_gpus=4, queue_buffer=64, default=params)
        env.static        # RoutingStatic(num_gpus=4, queue_buffer=64, ...), validated
        env.num_gpus      # 4: static fields read as attributes (read-only)

    `replace_static` returns a new instance with some fields changed (e.g. a longer trace
    window or a request log). Instances of one class with equal `static` and equal default
    params (by value) compare and hash equal, so jit, which keys its cache on the static
    `self`, reuses compiled code across them.

    `step` keeps gymnax 1.0's contract exactly (auto-reset, `(obs, state, reward, terminated,
    truncated, info)`, `info["final_observation"]`) but does not select the queues' slot
    arrays on reset: a reset queue has count 0, so stale slots are never read, and skipping
    them saves a full pass over the state (most of its bytes) on every step. An environment
    whose reset admits requests (Batching-v0) sets `reset_fills_queues = True` and gets the
    plain select.
    """

    Static: ClassVar[type]  # the frozen dataclass of static fields, set by each environment
    reset_fills_queues: ClassVar[bool] = False  # reset writes queue slots (see above)

    def __init__(self, *args, default=None, **fields):
        super().__init__()
        self.static = self.Static(*args, **fields)
        self._default = default

    def __getattr__(self, name):
        # Reached only when ordinary lookup fails: static fields read through to `static`
        # (`__dict__` directly, so a half-built or copied instance cannot recurse).
        static = self.__dict__.get("static")
        if static is not None and name in static.__dataclass_fields__:
            return getattr(static, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name, value):
        if name in self.Static.__dataclass_fields__:
            raise AttributeError(f"{name} is static configuration; use replace_static")
        super().__setattr__(name, value)

    @property
    def default_params(self):
        """The scenario's parameters, as built by `jaxserve.make`."""
        return self._default

    def _key(self):
        # Default params are part of the identity: gymnax's `step(..., params=None)` bakes them
        # into the compiled program. Hashed by value so equal scenarios share compiled code.
        if "_default_digest" not in self.__dict__:
            h = hashlib.sha1(str(jax.tree.structure(self.default_params)).encode())
            for leaf in jax.tree.leaves(self.default_params):
                a = np.asarray(leaf)
                h.update(str((a.dtype, a.shape)).encode() + a.tobytes())
            self._default_digest = h.hexdigest()
        return (type(self), self.static, self._default_digest, getattr(self, "ENGINE", None))

    def __eq__(self, other):
        return isinstance(other, StaticConfig) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def replace_static(self, **changes):
        """A new environment with the static fields in `changes` replaced (and re-validated).

        Raises:
          ValueError: a name in `changes` is not a static field, or a value is invalid.
        """
        fields = {f.name: getattr(self.static, f.name) for f in dataclasses.fields(self.static)}
        unknown = set(changes) - set(fields)
        if unknown:
            raise ValueError(f"{type(self).__name__} has no static field(s) {sorted(unknown)}; "
                             f"static fields: {tuple(fields)}")
        env = type(self)(default=self._default, **{**fields, **changes})
        if "ENGINE" in self.__dict__:
            env.ENGINE = self.ENGINE
        return env

    def with_engine(self, engine):
        """This environment with its serving engine replaced by `engine`, another
        configuration of the same engine class (`core.engines`: e.g.
        `ContinuousEngine(decode_runs=False)`, or `mode="one_pass"` / `"off"`, the
        benchmark's measuring variants). The engine is part of the environment's identity,
        so jit compiles each engine's step once.

        Raises:
          ValueError: the environment has no engine, or `engine` is not an instance of its
            engine's class.
        """
        base = getattr(type(self), "ENGINE", None)
        if base is None:
            raise ValueError(f"{type(self).__name__} has no serving engine to replace")
        if not isinstance(engine, type(base)):
            raise ValueError(f"{type(self).__name__} runs a {type(base).__name__}; got "
                             f"{type(engine).__name__}")
        env = self.replace_static()
        env.ENGINE = engine
        return env

    def check_params(self, params) -> None:
        """Raises ValueError (naming the field) if `params` do not fit this environment."""
        common.validate_params(params, self.queue_buffer, getattr(self, "max_batch", None),
                               getattr(self, "num_gpus", None))

    def step_and_reset(self, key, state, action, params):
        """`step_env`'s five outputs, and the `(obs, state)` an auto-reset would start from.

        By default the two draw from independent keys (a split of `key`). An environment whose
        step draws one request overrides this to draw both from one PRNG call on `key`.
        """
        key_step, key_reset = rng.split(key)
        return (self.step_env(key_step, state, action, params),
                self.reset_env(key_reset, params))

    @functools.partial(jax.jit, static_argnames=("self",))
    def step(self, key, state, action, params=None):
        """gymnax 1.0 step with auto-reset; see the class docstring."""
        if params is None:
            params = self.default_params
        (obs_st, state_st, reward, terminated, info), (obs_re, state_re) = self.step_and_reset(
            key, state, action, params)
        truncated = self.is_truncated(state_st, params)
        done = jnp.logical_or(terminated, truncated)
        if not self.reset_fills_queues:
            q_st, q_re = state_st.cluster.queues, state_re.cluster.queues
            q_re = q_re.replace(arrival=q_st.arrival, prompt=q_st.prompt, output=q_st.output,
                                estimate=q_st.estimate, req_id=q_st.req_id)
            state_re = state_re.replace(cluster=state_re.cluster.replace(queues=q_re))
        state = jax.tree.map(lambda r, s: jax.lax.select(done, r, s), state_re, state_st)
        obs = jax.lax.select(done, obs_re, obs_st)
        info = {**info, "terminated": terminated, "truncated": truncated,
                "final_observation": obs_st}
        return obs, state, reward, terminated, truncated, info
