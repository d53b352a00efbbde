"""Baseline autoscalers for Autoscaling-v0: fixed, Kubernetes HPA, Knative KPA, Ray Serve.

Every policy has the shared signature `policy(key, obs, state, params) -> int32 action` for ONE
environment; action `a` asks for `a + 1` active replicas, and every policy returns
`clip(desired, min_replicas, max_replicas) - 1`, so the active count stays in its bounds.
(With `params.action_mode = 1`, the env's delta actions, they return the step towards that
target, `autoscaling.action_for_target`.)

What they read. Only what a real autoscaler observes: the per-interval metrics of the past
(`state.history`, row 0 the interval that just ended), the current replica counts
(`autoscaling.counts(state)`) and the time since the last scale event (`since_scale_up`,
`since_scale_down`). Never `state.upcoming` (the future) nor true output lengths.

Stateless by construction. The production autoscalers keep state between decisions (HPA's
recommendation history and scale events, Knative's panic time, Ray Serve's decision counter).
Here that state is recomputed at every decision from `state.history`, so a policy is a pure
function of the env state (jit/vmap-safe, no carry in the harness):

  * decision `D_j` is the one taken `j` control intervals ago (`D_0` is now); it saw history
    row `j` as its latest interval and row `j`'s `active` as its current count (row `j` spans
    `[D_{j+1}, D_j]` and its `active` is the count set by `D_{j+1}`), row `j`'s `serving` as
    its ready count; rows `j >= state.time` do not exist yet (start of the episode);
  * the scale event of `D_j` (`j >= 1`) is `active[j - 1] - active[j]`;
  * windows are converted to numbers of intervals with `params.control_interval_s` (a traced
    leaf) and applied as masks over the `history_len` rows: a window of `W` seconds holds the
    decisions of age `j * dt < W` (`ceil(W / dt)` of them, at least the current one), and an
    averaging window of `W` seconds the `ceil(W / dt)` latest intervals;
  * windows longer than the history the env keeps are truncated to it; when `env` is given the
    factories refuse (ValueError) options whose windows do not fit in `env.history_len`.

With no history yet (`state.time == 0`, right after a reset) every policy keeps the current
count (clipped into its bounds): none of them acts without a metric.

Rounding: every `ceil` is taken with a 1e-4 slack (`ceil(x - 1e-4)`) so that float32 round-off
of an exact integer ratio does not add a replica.

Registry kind "autoscaling"; every factory takes `env=None, params=None`, `min_replicas`
(default 1) and `max_replicas` (default `env.max_replicas`; required without `env`).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxserve.envs import autoscaling as AS
from jaxserve.policies.registry import Policy, register

_H = AS.H
_SLACK = 1e-4


# ----------------------------------------------------------------------------- helpers

def _ceil(x):
    """ceil with a small slack against float32 round-off of exact ratios."""
    return jnp.ceil(x - _SLACK)


def count_below(window_s, dt, xp=jnp):
    """Number of decisions of age `j * dt < window_s` (`j = 0, 1, ...`), at least 1."""
    return xp.maximum(xp.ceil(xp.asarray(window_s) / dt - _SLACK), 1).astype(xp.int32)


def count_upto(window_s, dt, xp=jnp):
    """The largest `j >= 0` with `j * dt <= window_s`."""
    return xp.maximum(xp.floor(xp.asarray(window_s) / dt + _SLACK), 0).astype(xp.int32)


def _rows(state):
    """(history, row index j, row exists) of an AutoscalingState."""
    h = state.history
    j = jnp.arange(h.shape[0])
    return h, j, j < state.time


def _window_mean(x, valid, n):
    """`out[j]` = mean of `x[j : j + n]` over existing rows (`valid`); `(L,)`.

    Row `j` exists whenever any later row does, so the mean is over at least row `j` when
    `valid[j]` (and 0 otherwise)."""
    i = jnp.arange(x.shape[0])
    m = (i[None, :] >= i[:, None]) & (i[None, :] - i[:, None] < n) & valid[None, :]
    return (m * x[None, :]).sum(1) / jnp.maximum(m.sum(1), 1)


def _bounds(state, lo: int, hi: int):
    """(min, max) replicas for this env: `max` capped at its number of slots (static)."""
    r = int(state.mode.shape[0])
    hi = min(hi, r)
    return min(lo, hi), hi


def _finish(desired, state, params, lo: int, hi: int):
    """The action asking for `clip(desired, min, max)` replicas: `target - 1` (in the env's
    default target action mode; `autoscaling.action_for_target` also covers the delta mode,
    one step towards the target)."""
    lo, hi = _bounds(state, lo, hi)
    target = jnp.clip(jnp.asarray(desired).astype(jnp.int32), lo, hi)
    return AS.action_for_target(target, state, params, int(state.mode.shape[0]))


def _default_max_batch(params):
    """Largest per-replica batch limit of the scenario (traced-safe)."""
    return jnp.max(params.serving.gpus.max_batch).astype(jnp.float32)


# ----------------------------------------------------------------------------- validation

def _number(policy, name, v, *, lo=None, lo_open=False, hi=None, hi_open=False,
            integer=False):
    """Host-side check of a scalar option; ValueError naming it."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"policy {policy!r}: {name} must be a number, got {v!r}") from None
    if isinstance(v, bool) or not math.isfinite(f):
        raise ValueError(f"policy {policy!r}: {name} must be a finite number, got {v!r}")
    if integer and f != int(f):
        raise ValueError(f"policy {policy!r}: {name} must be an integer, got {v!r}")
    if lo is not None and (f <= lo if lo_open else f < lo):
        raise ValueError(f"policy {policy!r}: {name} must be {'>' if lo_open else '>='} {lo}, "
                         f"got {v!r}")
    if hi is not None and (f >= hi if hi_open else f > hi):
        raise ValueError(f"policy {policy!r}: {name} must be {'<' if hi_open else '<='} {hi}, "
                         f"got {v!r}")
    return int(f) if integer else f


def _replica_bounds(policy, env, min_replicas, max_replicas):
    """Validated (min_replicas, max_replicas) as Python ints."""
    slots = None if env is None else int(env.max_replicas)
    if max_replicas is None:
        if slots is None:
            raise ValueError(f"policy {policy!r}: max_replicas is required without env= "
                             f"(it defaults to env.max_replicas)")
        max_replicas = slots
    lo = _number(policy, "min_replicas", min_replicas, lo=1, integer=True)
    hi = _number(policy, "max_replicas", max_replicas, lo=1, integer=True)
    if slots is not None and hi > slots:
        raise ValueError(f"policy {policy!r}: max_replicas must be <= env.max_replicas = "
                         f"{slots}, got {hi}")
    if lo > hi:
        raise ValueError(f"policy {policy!r}: min_replicas ({lo}) must be <= max_replicas "
                         f"({hi})")
    return lo, hi


def _check_history(policy, env, params, needs):
    """Refuses windows longer than the history `env` keeps.

    `needs(dt) -> {option: rows}` gives the history rows each option's window needs at control
    interval `dt` (numpy); checked at the smallest interval of `params` (or the env's default).
    """
    if env is None or not hasattr(env, "history_len"):
        return
    p = params if params is not None else getattr(env, "default_params", None)
    if p is None or not hasattr(p, "control_interval_s"):
        return
    dt = float(np.min(np.asarray(p.control_interval_s, np.float64)))
    if not dt > 0:
        return
    for option, rows in needs(dt).items():
        if int(rows) > env.history_len:
            raise ValueError(
                f"policy {policy!r}: {option} needs {int(rows)} intervals of history at "
                f"control_interval_s={dt:g}, but the env keeps history_len={env.history_len} "
                f"(raise history_len or shorten {option})")


# ----------------------------------------------------------------------------- fixed

def make_fixed(replicas: int, min_replicas: int = 1, max_replicas: int | None = None):
    """Always ask for `replicas` (clipped into `[min_replicas, max_replicas]`)."""

    def fixed(key, obs, state, params):
        hi = state.mode.shape[0] if max_replicas is None else max_replicas
        return _finish(jnp.int32(replicas), state, params, min_replicas, hi)

    return fixed


@register("fixed", "autoscaling")
def _fixed_factory(env=None, params=None, replicas: int | None = None, min_replicas: int = 1,
                   max_replicas: int | None = None):
    """Static provisioning: always `replicas` active replicas (default: `max_replicas`, i.e.
    peak provisioning)."""
    lo, hi = _replica_bounds("fixed", env, min_replicas, max_replicas)
    n = hi if replicas is None else _number("fixed", "replicas", replicas, lo=1, integer=True)
    if not lo <= n <= hi:
        raise ValueError(f"policy 'fixed': replicas must be in [min_replicas, max_replicas] = "
                         f"[{lo}, {hi}], got {n}")
    return Policy(name="fixed", kind="autoscaling", fn=make_fixed(n, lo, hi),
                  info={"replicas": n, "min_replicas": lo, "max_replicas": hi})


# ----------------------------------------------------------------------------- held

def hold_every(policy, every: int):
    """`policy` deciding only at every `every`-th control instant, keeping the active count in
    between (so a replica it asks for is kept through its warm-up, not cancelled 15 s later).

    A policy trained with `control_interval_s = k * dt` is run on the `dt` environment (the
    baselines' own cadence, same episodes) as `hold_every(policy, k)`. Decisions fall on
    `state.time % every == 0`, the episode's first instant included. Pure, jit/vmap-safe.
    """
    every = int(every)
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    if every == 1:
        return policy

    def held(key, obs, state, params):
        keep = AS.action_for_target((state.mode == AS.ACTIVE).sum(), state, params,
                                    state.mode.shape[0])
        return jnp.where(state.time % every == 0, policy(key, obs, state, params),
                         keep).astype(jnp.int32)

    return held


def in_action_mode(policy, mode: int):
    """`policy`, which acts in `action_mode = mode`, run on an environment whose params use
    another action mode: its action is read as it meant it (`target_from_action` under its
    own mode) and re-expressed by target (`action_for_target`). A learned step policy can so
    be evaluated beside the baselines in the registry's target mode, on the same episodes."""
    mode = int(mode)
    if mode not in (AS.TARGET, AS.DELTA):
        raise ValueError(f"mode must be {AS.TARGET} (target) or {AS.DELTA} (delta), got {mode}")

    def translated(key, obs, state, params):
        own = params.replace(action_mode=jnp.int32(mode))
        r = state.mode.shape[0]
        target, _ = AS.target_from_action(policy(key, obs, state, own), state, own, r)
        return AS.action_for_target(target, state, params, r)

    return translated


def told_price(policy, price: float):
    """`policy` seeing `price` in its observation's price feature (`p / (1 + p)`) instead of
    the environment's: a price-conditioned policy (trained with `price_spread > 1`) is so
    run at the operating point it learned for `price`, while the episode is still charged
    at the environment's own price, as every other policy's is."""
    price = float(price)
    if not np.isfinite(price) or price < 0:
        raise ValueError(f"price must be finite and >= 0, got {price}")
    i = AS.Autoscaling.FEATURES.index("price")

    def told(key, obs, state, params):
        return policy(key, obs.at[..., i].set(price / (1.0 + price)), state, params)

    return told


# ----------------------------------------------------------------------------- scheduled

def make_scheduled(replicas_at_mean: float, lead_s: float | None = None, min_replicas: int = 1,
                   max_replicas: int | None = None):
    """Ask for `ceil(replicas_at_mean * m(t + lead))` replicas, `m` the scenario's diurnal rate
    multiplier (`autoscaling.rate_multiplier`) one `lead_s` ahead (default: one warm-up plus
    one interval, so replicas are warm when the load arrives)."""

    def scheduled(key, obs, state, params):
        hi = state.mode.shape[0] if max_replicas is None else max_replicas
        lead = params.warmup_s + params.control_interval_s if lead_s is None else lead_s
        m = AS.rate_multiplier(state.clock + lead, params)
        return _finish(jnp.ceil(replicas_at_mean * m - 1e-4), state, params, min_replicas, hi)

    return scheduled


@register("scheduled", "autoscaling")
def _scheduled_factory(env=None, params=None, replicas_at_mean: float = 6.0,
                       lead_s: float | None = None, min_replicas: int = 1,
                       max_replicas: int | None = None):
    """Scheduled (predictive) scaling that knows the daily load pattern, in the style of cron
    or scheduled-scaling rules (KEDA's cron scaler, AWS scheduled scaling): replicas follow the
    diurnal rate multiplier one warm-up ahead, scaled so that the mean rate gets
    `replicas_at_mean` (default 6; `jaxserve-autoscale` chooses it per scenario from
    `--scheduled-grid` on tuning episodes disjoint from the reported ones, 7 on the default
    scenario: docs/scaling.md). It reads the scenario's `diurnal_*` parameters, i.e. it is told the
    cycle: a reference for what anticipation is worth, not a reactive autoscaler. Without a
    cycle (`diurnal_amplitude=0`, e.g. a replayed trace) it is `fixed` at
    `ceil(replicas_at_mean)`."""
    lo, hi = _replica_bounds("scheduled", env, min_replicas, max_replicas)
    c = _number("scheduled", "replicas_at_mean", replicas_at_mean, lo=0.0, lo_open=True)
    if lead_s is not None:
        lead_s = _number("scheduled", "lead_s", lead_s, lo=0.0)
    return Policy(name="scheduled", kind="autoscaling", fn=make_scheduled(c, lead_s, lo, hi),
                  info={"replicas_at_mean": c, "lead_s": lead_s, "min_replicas": lo,
                        "max_replicas": hi})


# ----------------------------------------------------------------------------- HPA

HPA_DEFAULTS = dict(target_utilization=0.7, tolerance=0.1, scale_up_stabilization_s=0.0,
                    scale_down_stabilization_s=300.0, scale_up_percent=100.0,
                    scale_up_pods=4, scale_up_period_s=15.0, scale_down_percent=100.0,
                    scale_down_period_s=15.0, cooldown_s=0.0, upscale_cooldown_s=0.0)


def hpa_recommendations(state, target_utilization: float, tolerance: float):
    """HPA's metric-based recommendation of every past decision `D_j`.

    Returns `(recommendation, valid)`, each `(L,)`: float32 replica counts, and whether row
    `j` exists.

    Kubernetes' replica calculator on a utilisation metric, with row `j`'s `utilization` as
    the metric averaged over ready pods, row `j`'s `serving` as the ready pods `S` and row
    `j`'s `active` as the current replicas `N` (warming replicas `U = N - S` are unready):
      ratio = utilization / target;
      no unready pods, or not a scale-up (ratio <= 1): `N` if `|ratio - 1| <= tolerance`,
        else `ceil(ratio * S)` (= `ceil(N * utilization / target)` when all are ready);
      unready pods and ratio > 1: unready pods count as 0% usage (HPA's rule against
        over-scaling while new pods start), `ratio' = ratio * S / N`; `N` if
        `|ratio' - 1| <= tolerance` or `ratio' < 1`, else `ceil(ratio * S)`.
    Rows that do not exist, or with no ready pod (no metric), recommend `N`.
    """
    h, _, valid = _rows(state)
    n = h[:, _H["active"]]
    s = jnp.minimum(h[:, _H["serving"]], n)
    ratio = h[:, _H["utilization"]] / target_utilization
    new = _ceil(ratio * s)
    plain = jnp.where(jnp.abs(ratio - 1.0) <= tolerance, n, new)
    ratio_all = ratio * s / jnp.maximum(n, 1.0)
    with_unready = jnp.where((jnp.abs(ratio_all - 1.0) <= tolerance) | (ratio_all < 1.0), n, new)
    rec = jnp.where((n > s) & (ratio > 1.0), with_unready, plain)
    return jnp.where(valid & (s >= 1), rec, n).astype(jnp.float32), valid


def make_hpa(target_utilization=0.7, tolerance=0.1, scale_up_stabilization_s=0.0,
             scale_down_stabilization_s=300.0, scale_up_percent=100.0, scale_up_pods=4,
             scale_up_period_s=15.0, scale_down_percent=100.0, scale_down_period_s=15.0,
             cooldown_s=0.0, upscale_cooldown_s=0.0, min_replicas=1, max_replicas=None):
    """The HPA policy function (options as in the factory `hpa`; no validation here)."""

    def hpa(key, obs, state, params):
        dt = params.control_interval_s
        h, j, valid = _rows(state)
        c = AS.counts(state)
        cur = c["active"].astype(jnp.float32)
        rec, valid = hpa_recommendations(state, target_utilization, tolerance)
        # Stabilisation: the lowest recommendation of the scale-up window, the highest of the
        # scale-down window; the current count when it lies between them.
        in_up = valid & (j < count_below(scale_up_stabilization_s, dt))
        in_down = valid & (j < count_below(scale_down_stabilization_s, dt))
        up_rec = jnp.min(jnp.where(in_up, rec, jnp.inf))
        down_rec = jnp.max(jnp.where(in_down, rec, -jnp.inf))
        stab = jnp.where(cur < up_rec, up_rec, jnp.where(cur > down_rec, down_rec, cur))
        stab = jnp.where(valid[0], stab, cur)
        # Rate limits over each period: from the count at the period's start, i.e. the current
        # count less the replicas added (plus those removed) by the events within the period.
        act = h[:, _H["active"]]
        delta = jnp.concatenate([jnp.zeros((1,), act.dtype), act[:-1] - act[1:]])

        def period_start(period_s):
            within = valid & (j >= 1) & (j < count_below(period_s, dt))
            added = jnp.where(within, jnp.maximum(delta, 0.0), 0.0).sum()
            removed = jnp.where(within, jnp.maximum(-delta, 0.0), 0.0).sum()
            return cur - added + removed

        start_up = period_start(scale_up_period_s)
        up_limit = jnp.maximum(start_up + scale_up_pods,
                               _ceil(start_up * (1.0 + scale_up_percent / 100.0)))
        up_limit = jnp.maximum(up_limit, cur)
        start_down = period_start(scale_down_period_s)
        down_limit = jnp.minimum(jnp.floor(start_down * (1.0 - scale_down_percent / 100.0)
                                           + _SLACK), cur)
        desired = jnp.where(stab > cur, jnp.minimum(stab, up_limit),
                            jnp.where(stab < cur, jnp.maximum(stab, down_limit), cur))
        # Classic cooldowns after the last scale event (either direction).
        since = jnp.minimum(state.since_scale_up, state.since_scale_down)
        desired = jnp.where((desired < cur) & (since < cooldown_s), cur, desired)
        desired = jnp.where((desired > cur) & (since < upscale_cooldown_s), cur, desired)
        hi = state.mode.shape[0] if max_replicas is None else max_replicas
        return _finish(desired, state, params, min_replicas, hi)

    return hpa


@register("hpa", "autoscaling")
def _hpa_factory(env=None, params=None, target_utilization: float = 0.7,
                 tolerance: float = 0.1, scale_up_stabilization_s: float = 0.0,
                 scale_down_stabilization_s: float = 300.0, scale_up_percent: float = 100.0,
                 scale_up_pods: int = 4, scale_up_period_s: float = 15.0,
                 scale_down_percent: float = 100.0, scale_down_period_s: float = 15.0,
                 cooldown_s: float = 0.0, upscale_cooldown_s: float = 0.0,
                 min_replicas: int = 1, max_replicas: int | None = None):
    """Kubernetes Horizontal Pod Autoscaler (autoscaling/v2) on GPU utilisation.

    `desired = ceil(current * utilization / target_utilization)` per decision (see
    `hpa_recommendations` for the tolerance and unready-pod rules), then HPA's behaviour:
    stabilisation (scale-down to the highest recommendation of the last
    `scale_down_stabilization_s`; scale-up to the lowest of the last
    `scale_up_stabilization_s`), rate limits (up: the larger of `+scale_up_percent`% and
    `+scale_up_pods` per `scale_up_period_s`; down: `-scale_down_percent`% per
    `scale_down_period_s`), `min_replicas`/`max_replicas`. Optional classic cooldowns (not in
    HPA v2): no scale-down within `cooldown_s` of the last scale event, no scale-up within
    `upscale_cooldown_s` of it (both 0 = off).

    Documented Kubernetes defaults used (kubernetes.io "Horizontal Pod Autoscaling",
    algorithm details and "Default Behavior"; API `HPAScalingRules`): target 70% is the usual
    example (`averageUtilization: 70`, there is no default target); tolerance 0.1
    (`--horizontal-pod-autoscaler-tolerance`); sync period 15 s (our control interval);
    scaleUp: stabilizationWindowSeconds 0, policies Percent 100 and Pods 4 per 15 s,
    selectPolicy Max; scaleDown: stabilizationWindowSeconds 300, policy Percent 100 per 15 s.
    (The `HorizontalPodAutoscalerBehavior` field comment says "4 pods / double per 60
    seconds"; the `HPAScalingRules` defaults and the controller use 15 s periods.)
    """
    name = "hpa"
    lo, hi = _replica_bounds(name, env, min_replicas, max_replicas)
    opts = dict(
        target_utilization=_number(name, "target_utilization", target_utilization, lo=0.0,
                                   lo_open=True),
        tolerance=_number(name, "tolerance", tolerance, lo=0.0),
        scale_up_stabilization_s=_number(name, "scale_up_stabilization_s",
                                         scale_up_stabilization_s, lo=0.0),
        scale_down_stabilization_s=_number(name, "scale_down_stabilization_s",
                                           scale_down_stabilization_s, lo=0.0),
        scale_up_percent=_number(name, "scale_up_percent", scale_up_percent, lo=0.0),
        scale_up_pods=_number(name, "scale_up_pods", scale_up_pods, lo=0, integer=True),
        scale_up_period_s=_number(name, "scale_up_period_s", scale_up_period_s, lo=0.0,
                                  lo_open=True),
        scale_down_percent=_number(name, "scale_down_percent", scale_down_percent, lo=0.0,
                                   hi=100.0),
        scale_down_period_s=_number(name, "scale_down_period_s", scale_down_period_s, lo=0.0,
                                    lo_open=True),
        cooldown_s=_number(name, "cooldown_s", cooldown_s, lo=0.0),
        upscale_cooldown_s=_number(name, "upscale_cooldown_s", upscale_cooldown_s, lo=0.0))
    if opts["scale_up_percent"] == 0 and opts["scale_up_pods"] == 0:
        raise ValueError("policy 'hpa': scale_up_percent and scale_up_pods cannot both be 0 "
                         "(no scale-up would ever be allowed)")

    def needs(dt):
        return {k: count_below(opts[k], dt, np)
                for k in ("scale_up_stabilization_s", "scale_down_stabilization_s",
                          "scale_up_period_s", "scale_down_period_s")}

    _check_history(name, env, params, needs)
    return Policy(name=name, kind="autoscaling",
                  fn=make_hpa(**opts, min_replicas=lo, max_replicas=hi),
                  info={**opts, "min_replicas": lo, "max_replicas": hi})


# ----------------------------------------------------------------------------- Knative

def knative_desired(state, params, target_concurrency, stable_window_s=60.0,
                    panic_window_percentage=10.0, panic_threshold_percentage=200.0,
                    max_scale_up_rate=1000.0, max_scale_down_rate=2.0):
    """KPA's desired pod count of every past decision `D_j` (before the scale-down delay).

    Returns `(desired, panic, valid)`, each `(L,)`: `desired[j]` float32, `panic[j]` whether
    `D_j` was in panic mode. `target_concurrency` may be traced.
    """
    dt = params.control_interval_s
    h, j, valid = _rows(state)
    conc = h[:, _H["concurrency"]]
    ready = jnp.maximum(h[:, _H["serving"]], 1.0)
    cur = h[:, _H["active"]]
    n_stable = count_below(stable_window_s, dt)
    n_panic = count_below(stable_window_s * panic_window_percentage / 100.0, dt)
    dspc = _ceil(_window_mean(conc, valid, n_stable) / target_concurrency)
    dppc = _ceil(_window_mean(conc, valid, n_panic) / target_concurrency)
    max_up = _ceil(max_scale_up_rate * ready)
    max_down = jnp.floor(ready / max_scale_down_rate + _SLACK)
    stable = jnp.clip(dspc, max_down, max_up)
    panic_count = jnp.clip(dppc, max_down, max_up)
    trigger = valid & (dppc / ready >= panic_threshold_percentage / 100.0)
    # D_j is in panic if some D_k (k >= j) triggered at most one stable window before it.
    k = jnp.arange(h.shape[0])
    lasting = (k[None, :] >= j[:, None]) & (k[None, :] - j[:, None]
                                            <= count_upto(stable_window_s, dt))
    panic = (lasting & trigger[None, :]).any(1)
    desired = jnp.where(panic, jnp.maximum(jnp.maximum(stable, panic_count), cur), stable)
    return desired.astype(jnp.float32), panic, valid


def make_knative(target_concurrency=None, stable_window_s=60.0, panic_window_percentage=10.0,
                 panic_threshold_percentage=200.0, max_scale_up_rate=1000.0,
                 max_scale_down_rate=2.0, scale_down_delay_s=0.0, target_utilization=0.7,
                 min_replicas=1, max_replicas=None):
    """The Knative KPA policy function (options as in the factory `knative`)."""

    def knative(key, obs, state, params):
        target = (target_utilization * _default_max_batch(params) if target_concurrency is None
                  else jnp.float32(target_concurrency))
        desired, _, valid = knative_desired(
            state, params, target, stable_window_s, panic_window_percentage,
            panic_threshold_percentage, max_scale_up_rate, max_scale_down_rate)
        j = jnp.arange(desired.shape[0])
        # Scale-down delay: the highest desired count of the last scale_down_delay_s.
        in_delay = valid & (j < count_below(scale_down_delay_s, params.control_interval_s))
        out = jnp.max(jnp.where(in_delay, desired, -jnp.inf))
        out = jnp.where(valid[0], out, AS.counts(state)["active"])
        hi = state.mode.shape[0] if max_replicas is None else max_replicas
        return _finish(out, state, params, min_replicas, hi)

    return knative


@register("knative", "autoscaling")
def _knative_factory(env=None, params=None, target_concurrency: float | None = None,
                     target_utilization: float = 0.7, stable_window_s: float = 60.0,
                     panic_window_percentage: float = 10.0,
                     panic_threshold_percentage: float = 200.0,
                     max_scale_up_rate: float = 1000.0, max_scale_down_rate: float = 2.0,
                     scale_down_delay_s: float = 0.0, min_replicas: int = 1,
                     max_replicas: int | None = None):
    """Knative Pod Autoscaler (KPA) on concurrency (requests in system).

    Per decision (knative.dev "Configuring the autoscaler", "Additional autoscaling
    configuration for Knative Pod Autoscaler"; `pkg/autoscaler/scaling/autoscaler.go`):
      stable = mean concurrency over `stable_window_s`, `dspc = ceil(stable / target)`;
      panic = mean concurrency over the panic window (`panic_window_percentage`% of the stable
        window), `dppc = ceil(panic / target)`;
      both clipped to `[floor(ready / max_scale_down_rate), ceil(max_scale_up_rate * ready)]`
        (`ready` = serving replicas, at least 1): at most halves per decision by default;
      panic starts when `dppc / ready >= panic_threshold_percentage / 100` and lasts until no
        trigger for a whole stable window; in panic the count never goes down:
        `max(dspc, dppc, current)` (Knative's `maxPanicPods`); otherwise `dspc`;
      scale-down delay: the highest of these over the last `scale_down_delay_s`.
    Documented defaults: stable-window 60 s, panic-window-percentage 10 (6 s),
    panic-threshold-percentage 200, max-scale-up-rate 1000, max-scale-down-rate 2,
    scale-down-delay 0 s, container-concurrency-target-default 100 and target utilisation 70%.

    Choices for this simulator:
      * `target_concurrency` (per replica) defaults to `target_utilization * max_batch` =
        0.7 B. Knative's target is the container's concurrency limit times the target
        utilisation (70%), with 100 as a soft default for containers that set no limit. An
        LLM replica's real concurrency limit is its batch size B (requests beyond B queue), so
        `containerConcurrency = B`; 100 would be far too high for B = 16. B is read from
        `params` at run time (the largest replica's `max_batch`).
      * The 6 s panic window is shorter than one 15 s control interval; it is rounded up to
        whole intervals, so with 15 s intervals the panic window is the latest interval
        (`ceil(6 / 15) = 1`) and the stable window the latest 4 intervals.
      * Knative's ticks are 2 s and its metrics per-second; ours are per control interval.
    """
    name = "knative"
    lo, hi = _replica_bounds(name, env, min_replicas, max_replicas)
    opts = dict(
        target_concurrency=None if target_concurrency is None else _number(
            name, "target_concurrency", target_concurrency, lo=0.0, lo_open=True),
        target_utilization=_number(name, "target_utilization", target_utilization, lo=0.0,
                                   lo_open=True, hi=1.0),
        stable_window_s=_number(name, "stable_window_s", stable_window_s, lo=0.0,
                                lo_open=True),
        panic_window_percentage=_number(name, "panic_window_percentage",
                                        panic_window_percentage, lo=0.0, lo_open=True,
                                        hi=100.0),
        panic_threshold_percentage=_number(name, "panic_threshold_percentage",
                                           panic_threshold_percentage, lo=0.0, lo_open=True),
        max_scale_up_rate=_number(name, "max_scale_up_rate", max_scale_up_rate, lo=1.0,
                                  lo_open=True),
        max_scale_down_rate=_number(name, "max_scale_down_rate", max_scale_down_rate, lo=1.0,
                                    lo_open=True),
        scale_down_delay_s=_number(name, "scale_down_delay_s", scale_down_delay_s, lo=0.0))

    def needs(dt):
        stable = count_below(opts["stable_window_s"], dt, np)
        panic = count_below(opts["stable_window_s"] * opts["panic_window_percentage"] / 100,
                            dt, np)
        lasting = count_upto(opts["stable_window_s"], dt, np)
        own = max(stable, lasting + panic)
        return {"stable_window_s": own,
                "scale_down_delay_s": count_below(opts["scale_down_delay_s"], dt, np) - 1 + own}

    _check_history(name, env, params, needs)
    return Policy(name=name, kind="autoscaling",
                  fn=make_knative(**opts, min_replicas=lo, max_replicas=hi),
                  info={**opts, "min_replicas": lo, "max_replicas": hi})


# ----------------------------------------------------------------------------- Ray Serve

def ray_serve_desired(state, params, target_ongoing_requests, look_back_period_s=30.0,
                      upscaling_factor=1.0, downscaling_factor=1.0, min_replicas=1,
                      max_replicas=None):
    """Ray Serve's desired replica count of every past decision `D_j`, `(L,)` float32.

    `_calculate_desired_num_replicas`: with `total` the ongoing requests (row `concurrency`,
    averaged over `look_back_period_s`) and `running` the running replicas (row `serving`,
    at least 1), `error = total / (target * running)`, `factor = upscaling_factor` if
    `error >= 1` else `downscaling_factor`, `desired = ceil(running * (1 + (error - 1) *
    factor))`, one less if the smoothing left it stuck at `running` although
    `ceil(running * error) < running`; clipped into `[min_replicas, max_replicas]`.
    """
    dt = params.control_interval_s
    h, _, valid = _rows(state)
    total = _window_mean(h[:, _H["concurrency"]], valid, count_below(look_back_period_s, dt))
    running = jnp.maximum(h[:, _H["serving"]], 1.0)
    error = total / (target_ongoing_requests * running)
    factor = jnp.where(error >= 1.0, upscaling_factor, downscaling_factor)
    desired = _ceil(running * (1.0 + (error - 1.0) * factor))
    stuck = (_ceil(running * error) < running) & (desired == running)
    desired = jnp.where(stuck, desired - 1.0, desired)
    lo, hi = _bounds(state, min_replicas, state.mode.shape[0] if max_replicas is None
                     else max_replicas)
    return jnp.clip(desired, lo, hi).astype(jnp.float32), valid


def make_ray_serve(target_ongoing_requests=2.0, look_back_period_s=30.0, upscale_delay_s=30.0,
                   downscale_delay_s=600.0, upscaling_factor=1.0, downscaling_factor=1.0,
                   min_replicas=1, max_replicas=None):
    """The Ray Serve policy function (options as in the factory `ray_serve`)."""

    def ray_serve(key, obs, state, params):
        dt = params.control_interval_s
        target = (_default_max_batch(params) if target_ongoing_requests is None
                  else jnp.float32(target_ongoing_requests))
        desired, valid = ray_serve_desired(state, params, target, look_back_period_s,
                                           upscaling_factor, downscaling_factor, min_replicas,
                                           max_replicas)
        h, j, _ = _rows(state)
        cur = h[:, _H["active"]]
        up = valid & (desired > cur)
        down = valid & (desired < cur)
        # Ray's decision counter: scale once the same direction was decided at this and the
        # previous `int(delay / interval)` decisions, all after the last scale event (the
        # counter restarts at every scale and every change of direction).
        since = jnp.minimum(state.since_scale_up, state.since_scale_down)

        def run(flags, delay_s):
            n = count_upto(delay_s, dt)
            span = j <= n
            fits = n < j.shape[0]
            after_event = (n.astype(jnp.float32) + 0.5) * dt < since
            return fits & after_event & jnp.all(jnp.where(span, flags, True))

        c = AS.counts(state)
        fire = (up[0] & run(up, upscale_delay_s)) | (down[0] & run(down, downscale_delay_s))
        out = jnp.where(fire, desired[0], c["active"])
        hi = state.mode.shape[0] if max_replicas is None else max_replicas
        return _finish(out, state, params, min_replicas, hi)

    return ray_serve


@register("ray_serve", "autoscaling")
def _ray_serve_factory(env=None, params=None, target_ongoing_requests: float | None = 2.0,
                       look_back_period_s: float = 30.0, upscale_delay_s: float = 30.0,
                       downscale_delay_s: float = 600.0, upscaling_factor: float = 1.0,
                       downscaling_factor: float = 1.0, min_replicas: int = 1,
                       max_replicas: int | None = None):
    """Ray Serve's default autoscaling policy (`replica_queue_length_autoscaling_policy`).

    `desired = ceil(total ongoing requests / target_ongoing_requests)` (with the smoothing
    factors, see `ray_serve_desired`), the ongoing requests (waiting + running, all replicas)
    averaged over `look_back_period_s`. Scale up only when `desired > current` at every
    decision of the last `upscale_delay_s` (`int(upscale_delay_s / interval) + 1` decisions in
    a row, Ray's decision counter), scale down only when `desired < current` for
    `downscale_delay_s`; then go to the current decision's `desired`, within
    `[min_replicas, max_replicas]`.

    Documented Ray Serve defaults (docs.ray.io `ray.serve.config.AutoscalingConfig`, "Advanced
    Ray Serve Autoscaling"): target_ongoing_requests 2 (since Ray 2.32; 1 before),
    look_back_period_s 30, upscale_delay_s 30, downscale_delay_s 600, smoothing /
    upscaling / downscaling factors 1.0 (metrics_interval_s 10 s and the 0.1 s control loop
    become our control interval).

    Choice for this simulator: the default target stays Ray's 2, which is meant for a
    synchronous replica serving one request at a time. A batched LLM replica runs up to
    `max_batch` B requests at once, so the sensible setting is `target_ongoing_requests = B`
    (or a fraction of it): pass `target_ongoing_requests=None` to use the scenario's B
    (read from `params` at run time). With the default 2 and B = 16 the policy asks for far
    more replicas than the load needs.
    """
    name = "ray_serve"
    lo, hi = _replica_bounds(name, env, min_replicas, max_replicas)
    opts = dict(
        target_ongoing_requests=None if target_ongoing_requests is None else _number(
            name, "target_ongoing_requests", target_ongoing_requests, lo=0.0, lo_open=True),
        look_back_period_s=_number(name, "look_back_period_s", look_back_period_s, lo=0.0,
                                   lo_open=True),
        upscale_delay_s=_number(name, "upscale_delay_s", upscale_delay_s, lo=0.0),
        downscale_delay_s=_number(name, "downscale_delay_s", downscale_delay_s, lo=0.0),
        upscaling_factor=_number(name, "upscaling_factor", upscaling_factor, lo=0.0,
                                 lo_open=True),
        downscaling_factor=_number(name, "downscaling_factor", downscaling_factor, lo=0.0,
                                   lo_open=True))

    def needs(dt):
        look = count_below(opts["look_back_period_s"], dt, np)
        return {"look_back_period_s": look,
                "upscale_delay_s": count_upto(opts["upscale_delay_s"], dt, np) + look,
                "downscale_delay_s": count_upto(opts["downscale_delay_s"], dt, np) + look}

    _check_history(name, env, params, needs)
    return Policy(name=name, kind="autoscaling",
                  fn=make_ray_serve(**opts, min_replicas=lo, max_replicas=hi),
                  info={**opts, "min_replicas": lo, "max_replicas": hi})
