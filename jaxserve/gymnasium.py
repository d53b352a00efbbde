"""Gymnasium adapters: the serving environments for non-JAX RL code (Stable-Baselines3, CleanRL).

    import jaxserve.gymnasium as jg
    env = jg.make("Routing-v0", max_steps_in_episode=256)          # gymnasium.Env
    envs = jg.make_vec("Routing-v0", num_envs=64)                  # gymnasium.vector.VectorEnv

`ServingEnv` is a plain `gymnasium.Env` with numpy inputs and outputs and no auto-reset: it
steps with the gymnax environment's `step_env` and reports `is_truncated` as `truncated`.
Seeding follows gymnasium's contract: `reset(seed=s)` re-seeds `self.np_random`, and the JAX key
of the episode is drawn from `np_random` at every reset, so the same seed gives the same
trajectory and `reset()` without a seed continues the stream. Step keys are split from the
episode key on the device.

`ServingVectorEnv` runs `num_envs` copies in one jitted, vmapped call per step. It behaves like
`gymnasium.vector.SyncVectorEnv([lambda: make(name, **overrides)] * num_envs,
autoreset_mode=...)` with the same seeds (`reset(seed=s)` seeds copy `i` with `s + i`), in any
of gymnasium's three autoreset modes (the default is gymnasium's own, `NEXT_STEP`): the same
flags, counts and info keys, and the same floats up to float32 rounding (XLA's vectorised
kernels may round differently in the last bit).

Importing this module also registers every `jaxserve` environment with gymnasium as
`"jaxserve/<name>"` (e.g. `gymnasium.make("jaxserve/Routing-v0")`, and
`gymnasium.make_vec("jaxserve/Routing-v0", num_envs=64)`, which builds a `ServingVectorEnv`).
"""

from __future__ import annotations

import collections
from functools import partial
from typing import Any, NamedTuple

import gymnasium
import jax
import jax.numpy as jnp
import numpy as np
from gymnasium import spaces as gspaces
from gymnasium.envs.registration import EnvSpec
from gymnasium.utils import seeding
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from jaxserve.core.tree import select
from jaxserve.envs import registry

__all__ = ["NAMESPACE", "ServingEnv", "ServingVectorEnv", "make", "make_vec",
           "register_gymnasium_envs"]

NAMESPACE = "jaxserve"
_KEY_IMPL = "threefry2x32"  # JAX keys are carried as raw (2,) uint32 data of this PRNG
_INT32 = np.iinfo(np.int32)

# Traces of the jitted functions below, by name: a test hook showing compiles are shared.
TRACE_COUNTS: collections.Counter = collections.Counter()


# ---------------------------------------------------------------------------------------------
# Jitted kernels, shared by every wrapper instance whose environment has the same static config.
# ---------------------------------------------------------------------------------------------

class _Static:
    """Hashable jit-static handle on a gymnax environment.

    Equal for environments of the same type and static configuration (`env.static`, a frozen
    dataclass), whose `reset_env`/`step_env` depend only on that configuration and the params
    they are passed; so every wrapper instance over such an environment reuses the same compiled
    code, whatever its default params. Environments without `static` are keyed by identity.
    """

    __slots__ = ("env", "_key", "_hash")

    def __init__(self, env):
        self.env = env
        static = getattr(env, "static", None)
        self._key = (type(env), static) if static is not None else (type(env), id(env))
        self._hash = hash(self._key)

    def __eq__(self, other):
        return isinstance(other, _Static) and self._key == other._key

    def __hash__(self):
        return self._hash


def _wrap(key_data):
    return jax.random.wrap_key_data(key_data, impl=_KEY_IMPL)


def _reset_one(env, key_data, params):
    """Episode start from a (2,) uint32 seed: (stream key data, obs, state)."""
    stream, k_reset = jax.random.split(_wrap(key_data))
    obs, state = env.reset_env(k_reset, params)
    return jax.random.key_data(stream), obs, state


def _step_one(env, key_data, state, action, params):
    """One step without auto-reset: (key data, obs, state, reward, terminated, truncated, info)."""
    stream, k_step = jax.random.split(_wrap(key_data))
    obs, state, reward, terminated, info = env.step_env(k_step, state, action, params)
    truncated = env.is_truncated(state, params)
    return (jax.random.key_data(stream), obs, state, reward, jnp.asarray(terminated, jnp.bool_),
            jnp.asarray(truncated, jnp.bool_), info)


class _Layout(NamedTuple):
    """Where each output sits in a packed float32 row (see `_pack`)."""

    obs: tuple            # (shape, dtype) of the observation
    num_obs: int          # observations in the row (the vector step adds the final one)
    floats: tuple         # (name, dtype, shape) of the float info entries, in order
    ints: tuple           # (name, dtype, shape) of the integer/bool info entries, in order


# Layout of each kernel's packed output, recorded when the kernel is traced (so it is known
# before the first result of any cached compile comes back).
_LAYOUTS: dict = {}


def _pack(tag, observations, reward, term, trunc, info):
    """Every per-env output as one float32 vector, so the host fetches one array per step.

    Floats (observations, reward, float info) are stored as float32 (exact for float32 values);
    integers and flags are stored as int32 bit patterns (`bitcast`), so they round-trip exactly.
    """
    obs0 = observations[0]
    names = sorted(info)
    fl = [k for k in names if jnp.issubdtype(info[k].dtype, jnp.floating)]
    it = [k for k in names if k not in fl]
    _LAYOUTS[tag] = _Layout(
        obs=(tuple(obs0.shape), np.dtype(obs0.dtype)), num_obs=len(observations),
        floats=tuple((k, np.dtype(info[k].dtype), tuple(info[k].shape)) for k in fl),
        ints=tuple((k, np.dtype(info[k].dtype), tuple(info[k].shape)) for k in it))
    f32 = [o.ravel().astype(jnp.float32) for o in observations]
    f32 += [jnp.reshape(reward, (1,)).astype(jnp.float32)]
    f32 += [info[k].ravel().astype(jnp.float32) for k in fl]
    i32 = [jnp.stack([term, trunc]).astype(jnp.int32)] + [info[k].ravel().astype(jnp.int32)
                                                          for k in it]
    i32 = jax.lax.bitcast_convert_type(jnp.concatenate(i32), jnp.float32)
    return jnp.concatenate(f32 + [i32])


def _unpack(row: np.ndarray, layout: _Layout):
    """Inverse of `_pack` on the host, for rows with any leading shape.

    Returns (observations list, reward float32, terminated, truncated, info dict of arrays).
    """
    lead = row.shape[:-1]
    pos = 0

    def take(shape, dtype):
        nonlocal pos
        n = int(np.prod(shape, dtype=np.int64))
        seg = row[..., pos:pos + n]
        pos += n
        return seg.reshape(lead + shape).astype(dtype)

    shape, dtype = layout.obs
    observations = [take(shape, dtype) for _ in range(layout.num_obs)]
    reward = take((), np.float32)
    info = {k: take(shp, dt) for k, dt, shp in layout.floats}
    ints = np.ascontiguousarray(row[..., pos:]).view(np.int32)
    term, trunc = ints[..., 0].astype(np.bool_), ints[..., 1].astype(np.bool_)
    pos = 2
    for k, dt, shp in layout.ints:
        n = int(np.prod(shp, dtype=np.int64))
        info[k] = ints[..., pos:pos + n].reshape(lead + shp).astype(dt)
        pos += n
    return observations, reward, term, trunc, info


@partial(jax.jit, static_argnums=0)
def _reset_jit(h: _Static, key_data, params):
    TRACE_COUNTS["reset"] += 1
    return _reset_one(h.env, key_data, params)


@partial(jax.jit, static_argnums=0)
def _step_jit(h: _Static, key_data, state, action, params):
    """(key data, state, packed outputs)."""
    TRACE_COUNTS["step"] += 1
    kd, obs, state, reward, term, trunc, info = _step_one(h.env, key_data, state, action, params)
    return kd, state, _pack((h, "step"), (obs,), reward, term, trunc, info)


@partial(jax.jit, static_argnums=0)
def _vreset_jit(h: _Static, key_data, params):
    """Resets every env from its seed (`key_data[i]`)."""
    TRACE_COUNTS["vreset"] += 1
    return jax.vmap(_reset_one, in_axes=(None, 0, None))(h.env, key_data, params)


_where_jit = jax.jit(select)  # per-env select over pytrees with a leading env axis


@partial(jax.jit, static_argnums=0)
def _vstep_jit(h: _Static, same_step, key_data, state, actions, params, pre, reset_data):
    """One vectorised step with gymnasium autoreset, in a single dispatch.

    Envs in `pre` (NEXT_STEP: done on the previous step) are reset instead of stepped, returning
    the reset observation, reward 0 and no termination. With `same_step`, envs that end on this
    step are reset after it (the stepped observation is packed as the second, final one). Resets
    draw on `reset_data` (per-env seeds) and are computed only when some env needs one. The mode
    is a traced flag, so one compile serves every autoreset mode.

    Returns (key data, state, packed (num_envs, L) outputs).
    """
    TRACE_COUNTS["vstep"] += 1
    env = h.env
    kd, obs, st, reward, term, trunc, info = jax.vmap(
        _step_one, in_axes=(None, 0, 0, 0, None))(env, key_data, state, actions, params)
    done = term | trunc
    need = pre | (same_step & done)

    def with_reset(_):
        new = jax.vmap(_reset_one, in_axes=(None, 0, None))(env, reset_data, params)
        return select(need, new, (kd, obs, st))

    kd_out, obs_out, st_out = jax.lax.cond(jnp.any(need), with_reset, lambda _: (kd, obs, st),
                                           None)
    reward = jnp.where(pre, 0.0, reward)
    term = term & ~pre
    trunc = trunc & ~pre
    pack = jax.vmap(lambda *a: _pack((h, "vstep"), a[:2], *a[2:]))
    return kd_out, st_out, pack(obs_out, obs, reward, term, trunc, info)


# ---------------------------------------------------------------------------------------------
# Host-side helpers.
# ---------------------------------------------------------------------------------------------

def _gym_spaces(env, params):
    """(observation Box, action Discrete) in gymnasium form."""
    ob = env.observation_space(params)
    shape = tuple(int(d) for d in ob.shape)
    dtype = np.dtype(ob.dtype)
    low = np.broadcast_to(np.asarray(ob.low, dtype), shape).copy()
    high = np.broadcast_to(np.asarray(ob.high, dtype), shape).copy()
    obs_space = gspaces.Box(low=low, high=high, shape=shape, dtype=dtype)
    ac = env.action_space(params)
    if not hasattr(ac, "n"):
        raise TypeError(f"only Discrete action spaces are supported, got {type(ac).__name__}")
    return obs_space, gspaces.Discrete(int(ac.n))


def _draw_seed(rng: np.random.Generator) -> np.ndarray:
    """A JAX key's worth (64 bits) of entropy from a numpy generator."""
    return rng.integers(0, 2 ** 32, size=2, dtype=np.uint32)


def _as_actions(action, shape) -> np.ndarray:
    """Integer action(s) of `shape` as int32; out-of-range values pass through (the environment
    clips them and counts them in `info["invalid_actions"]`), beyond int32 they saturate."""
    a = np.asarray(action)
    if a.shape != shape:
        if a.size != int(np.prod(shape, dtype=np.int64)):
            raise ValueError(f"expected action(s) of shape {shape}, got shape {a.shape}")
        a = a.reshape(shape)
    if a.dtype.kind == "f":
        if not np.all(np.isfinite(a)) or np.any(a != np.round(a)):
            raise ValueError(f"actions must be integers, got {action!r}")
    elif a.dtype.kind not in "iub":
        raise TypeError(f"actions must be integers, got dtype {a.dtype}")
    # float64 holds every int32 exactly and orders huge integers correctly for the clip.
    return np.clip(a.astype(np.float64), _INT32.min, _INT32.max).astype(np.int32)


def _info_value(x: np.ndarray):
    """A 0-d numpy value as the Python scalar gymnasium's info batching expects."""
    return x.item() if np.ndim(x) == 0 else x


def _batched(values: np.ndarray) -> np.ndarray:
    """Per-env info values with the dtype `SyncVectorEnv` gives Python scalars."""
    kind = values.dtype.kind
    if kind == "f":
        return values.astype(np.float64)
    if kind in "iu":
        return values.astype(np.int64)
    return np.array(values)


def _add_masked(out: dict, info: dict, mask: np.ndarray) -> dict:
    """Adds per-env `info` arrays for the envs in `mask` (zero elsewhere) with `_key` masks,
    gymnasium's vector-info layout; keys no env reports are left out."""
    if not mask.any():
        return out
    for k, v in info.items():
        v = _batched(v)
        m = mask.reshape(mask.shape + (1,) * (v.ndim - 1))
        out[k] = np.where(m, v, np.zeros_like(v))
        out[f"_{k}"] = mask.copy()
    return out


def _spec(name: str, overrides: dict) -> EnvSpec | None:
    try:
        return EnvSpec(id=f"{NAMESPACE}/{name}", entry_point=f"{__name__}:ServingEnv",
                       vector_entry_point=f"{__name__}:ServingVectorEnv",
                       nondeterministic=False, kwargs={"name": name, **overrides})
    except Exception:  # a user-registered name gymnasium cannot parse as an id
        return None


def _build(name, gymnax_env, params, overrides):
    if gymnax_env is None:
        if name is None:
            raise ValueError("give an environment name or gymnax_env=")
        return registry.make(name, **overrides)
    if name is not None or overrides:
        raise ValueError("give either a name (with overrides) or gymnax_env= (with params=)")
    params = gymnax_env.default_params if params is None else params
    if hasattr(gymnax_env, "check_params"):
        gymnax_env.check_params(params)
    return gymnax_env, params


def _check_render_mode(render_mode):
    if render_mode is not None:
        raise ValueError(f"jaxserve environments do not render; render_mode must be None, "
                         f"got {render_mode!r}")


# ---------------------------------------------------------------------------------------------
# Single environment.
# ---------------------------------------------------------------------------------------------

class ServingEnv(gymnasium.Env):
    """A jaxserve environment as a `gymnasium.Env` (numpy in and out, no auto-reset).

    Args:
      name: a registered environment (`jaxserve.registered_envs()`), built with `overrides`.
      gymnax_env, params: or an already built gymnax environment and its params.
      render_mode: must be None (nothing to render).

    `reset(seed=None, options=None) -> (obs, {})`; `options` is accepted and ignored.
    `step(action) -> (obs, reward, terminated, truncated, info)`: `obs` a float32 array,
    `reward` a float, the flags Python bools, `info` the step's `StepMetrics` as Python scalars
    (`arrived`, `completed`, `dropped`, `latency_sum`, `slo_met`, `busy_time`,
    `in_system_time`, `elapsed`, `invalid_actions`). Actions are integers (numpy or Python);
    out-of-range ones are mapped by the environment and counted in `info["invalid_actions"]`.
    Stepping past the end of an episode continues the simulation; call `reset`.
    """

    metadata = {"render_modes": [], "render_fps": None}

    def __init__(self, name: str | None = None, *, render_mode: str | None = None,
                 gymnax_env=None, params=None, **overrides):
        _check_render_mode(render_mode)
        self.render_mode = None
        self.gymnax_env, self.params = _build(name, gymnax_env, params, overrides)
        self.observation_space, self.action_space = _gym_spaces(self.gymnax_env, self.params)
        self._h = _Static(self.gymnax_env)
        self._key = None      # (2,) uint32 device array: this episode's step-key stream
        self._state = None
        if name is not None:
            self.spec = _spec(name, overrides)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        seed_data = _draw_seed(self.np_random)
        self._key, obs, self._state = _reset_jit(self._h, seed_data, self.params)
        return np.array(obs), {}

    def step(self, action):
        if self._state is None:
            raise gymnasium.error.ResetNeeded("call reset() before step()")
        a = _as_actions(action, ())
        self._key, self._state, packed = _step_jit(self._h, self._key, self._state, a,
                                                   self.params)
        (obs,), reward, term, trunc, info = _unpack(np.asarray(packed),
                                                    _LAYOUTS[(self._h, "step")])
        return (obs, float(reward), bool(term), bool(trunc),
                {k: _info_value(v) for k, v in info.items()})

    def render(self):
        return None

    def close(self):
        self._state = None
        self._key = None
        super().close()


# ---------------------------------------------------------------------------------------------
# Vector environment.
# ---------------------------------------------------------------------------------------------

class ServingVectorEnv(VectorEnv):
    """`num_envs` copies of a jaxserve environment, stepped in one jitted, vmapped call.

    Equivalent to `gymnasium.vector.SyncVectorEnv([lambda: ServingEnv(name, **overrides)] *
    num_envs, autoreset_mode=autoreset_mode)`: with the same seeds, the same observations,
    rewards, flags and infos (infos as gymnasium batches them: a `(num_envs,)` array per key
    plus a boolean `_key` mask of the envs that report it), floats up to float32 rounding.

    Args:
      name / gymnax_env, params / overrides: as `ServingEnv`; all copies share the params.
      num_envs: number of copies.
      autoreset_mode: a `gymnasium.vector.AutoresetMode` (or its string value):
        NEXT_STEP (default, gymnasium's): a copy that ended on step t is reset on step t + 1,
          which ignores its action and returns the first observation, reward 0,
          terminated = truncated = False and no info (its `_key` masks are False).
        SAME_STEP: a copy that ends is reset within the same step; the returned observation is
          the new episode's first, the last one is in `info["final_obs"]` (object array, None
          for copies that did not end) and its step info in `info["final_info"]`, with masks
          `info["_final_obs"]`, `info["_final_info"]`.
        DISABLED: no autoreset; reset ended copies with `reset(options={"reset_mask": mask})`
          before stepping them again (stepping one raises `gymnasium.error.ResetNeeded`).
      render_mode: must be None.

    `reset(seed=None | int | list, options=None)`: an int seeds copy i with `seed + i`, a list
    gives one seed (or None) per copy, None continues each copy's stream.
    `options={"reset_mask": bool array}` resets only the copies in the mask.
    """

    metadata = {"render_modes": [], "render_fps": None,
                "autoreset_mode": AutoresetMode.NEXT_STEP}

    def __init__(self, name: str | None = None, num_envs: int = 1, *,
                 autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
                 render_mode: str | None = None, gymnax_env=None, params=None, **overrides):
        super().__init__()
        _check_render_mode(render_mode)
        num_envs = int(num_envs)
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        self.autoreset_mode = (autoreset_mode if isinstance(autoreset_mode, AutoresetMode)
                               else AutoresetMode(autoreset_mode))
        self.metadata = {**type(self).metadata, "autoreset_mode": self.autoreset_mode}
        self.render_mode = None
        self.num_envs = num_envs
        self.gymnax_env, self.params = _build(name, gymnax_env, params, overrides)
        self.single_observation_space, self.single_action_space = _gym_spaces(
            self.gymnax_env, self.params)
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self.action_space = batch_space(self.single_action_space, num_envs)
        self._h = _Static(self.gymnax_env)
        # Per-copy numpy generators (as each SyncVectorEnv sub-env has) and the seed each copy
        # will use at its next reset, drawn ahead so that resets inside a step need no host work.
        self._rngs = [seeding.np_random()[0] for _ in range(num_envs)]
        self._next_seed = np.stack([_draw_seed(g) for g in self._rngs])
        self._key = None      # (num_envs, 2) uint32 device array: per-copy step-key streams
        self._state = None
        self._obs = None
        self._autoreset = np.zeros(num_envs, np.bool_)

    def _take_seeds(self, idx) -> None:
        """Marks the pending seeds of copies `idx` as used and draws their next ones."""
        for i in idx:
            self._next_seed[i] = _draw_seed(self._rngs[i])

    def reset(self, *, seed: int | list[int | None] | None = None,
              options: dict[str, Any] | None = None):
        n = self.num_envs
        if seed is None:
            seeds = [None] * n
        elif isinstance(seed, (int, np.integer)):
            super().reset(seed=int(seed))
            seeds = [int(seed) + i for i in range(n)]
        else:
            seeds = [None if s is None else int(s) for s in seed]
            if len(seeds) != n:
                raise ValueError(f"got {len(seeds)} seeds for num_envs={n}")
        mask = None if options is None else options.get("reset_mask")
        if mask is not None:
            mask = np.asarray(mask)
            if mask.shape != (n,) or mask.dtype != np.bool_ or not mask.any():
                raise ValueError(f"options['reset_mask'] must be a bool array of shape ({n},) "
                                 f"with some True entry, got {mask!r}")
            if self._state is None:
                raise gymnasium.error.ResetNeeded("reset all copies before a masked reset")
        idx = range(n) if mask is None else np.flatnonzero(mask)
        for i in idx:
            if seeds[i] is not None:
                self._rngs[i] = seeding.np_random(seeds[i])[0]
                self._next_seed[i] = _draw_seed(self._rngs[i])
        seed_data = self._next_seed.copy()
        self._take_seeds(idx)
        new = _vreset_jit(self._h, seed_data, self.params)
        if mask is None:
            self._key, obs, self._state = new
            self._autoreset[:] = False
        else:  # a partial reset is rare: reuse the full reset's compile and select
            self._key, obs, self._state = _where_jit(mask, new,
                                                     (self._key, self._obs, self._state))
            self._autoreset[mask] = False
        self._obs = obs = np.array(obs)
        return obs.copy(), {}

    def step(self, actions):
        if self._state is None:
            raise gymnasium.error.ResetNeeded("call reset() before step()")
        mode = self.autoreset_mode
        if mode == AutoresetMode.DISABLED and self._autoreset.any():
            raise gymnasium.error.ResetNeeded(
                f"copies {np.flatnonzero(self._autoreset).tolist()} have ended; with autoreset "
                f"disabled, reset them with reset(options={{'reset_mask': mask}})")
        a = _as_actions(actions, (self.num_envs,))
        same_step = mode == AutoresetMode.SAME_STEP
        pre = self._autoreset if mode == AutoresetMode.NEXT_STEP else np.zeros_like(
            self._autoreset)
        self._key, self._state, packed = _vstep_jit(
            self._h, np.bool_(same_step), self._key, self._state, a, self.params, pre,
            self._next_seed)
        (obs, final_obs), reward, term, trunc, info = _unpack(np.asarray(packed),
                                                              _LAYOUTS[(self._h, "vstep")])
        self._obs = obs
        done = term | trunc
        infos: dict[str, Any] = {}
        if same_step:
            self._take_seeds(np.flatnonzero(done))
            if done.any():
                fo = np.full(self.num_envs, None, dtype=object)
                for i in np.flatnonzero(done):
                    fo[i] = final_obs[i].copy()
                infos["final_obs"], infos["_final_obs"] = fo, done.copy()
                infos["final_info"] = _add_masked({}, info, done)
                infos["_final_info"] = done.copy()
            _add_masked(infos, info, ~done)
        else:
            self._take_seeds(np.flatnonzero(pre))
            self._autoreset = done.copy()
            _add_masked(infos, info, ~pre)
        return obs.copy(), reward.astype(np.float64), term, trunc, infos

    def render(self):
        return None

    def close_extras(self, **kwargs):
        self._state = None
        self._key = None
        self._obs = None


# ---------------------------------------------------------------------------------------------
# Factories and gymnasium registration.
# ---------------------------------------------------------------------------------------------

def make(name: str, **overrides) -> ServingEnv:
    """`jaxserve.make(name, **overrides)` as a `gymnasium.Env` (see `ServingEnv`)."""
    return ServingEnv(name, **overrides)


def make_vec(name: str, num_envs: int, *,
             autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
             **overrides) -> ServingVectorEnv:
    """`num_envs` copies of `jaxserve.make(name, **overrides)` as one gymnasium `VectorEnv`
    stepped in a single jitted, vmapped call (see `ServingVectorEnv`)."""
    env = ServingVectorEnv(name, num_envs, autoreset_mode=autoreset_mode, **overrides)
    spec = _spec(name, overrides)
    if spec is not None:
        spec.kwargs.update(num_envs=int(num_envs), vectorization_mode="vector_entry_point")
        if env.autoreset_mode != AutoresetMode.NEXT_STEP:
            spec.kwargs["autoreset_mode"] = env.autoreset_mode.value
    env.spec = spec
    return env


def register_gymnasium_envs() -> tuple[str, ...]:
    """Registers every jaxserve environment with gymnasium as `"jaxserve/<name>"` (skipping ids
    already registered); call again after `jaxserve.register`-ing new ones. Returns the ids."""
    ids = []
    for name in registry.registered_envs():
        gid = f"{NAMESPACE}/{name}"
        if gid not in gymnasium.registry:
            try:
                gymnasium.register(id=gid, entry_point=f"{__name__}:ServingEnv",
                                   vector_entry_point=f"{__name__}:ServingVectorEnv",
                                   nondeterministic=False, kwargs={"name": name})
            except Exception:  # a name gymnasium cannot parse as an id
                continue
        ids.append(gid)
    return tuple(ids)


register_gymnasium_envs()
