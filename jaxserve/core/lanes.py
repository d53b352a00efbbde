"""Lane compaction: data-dependent loops under `vmap` that stop paying for finished lanes.

Under `vmap` a `lax.while_loop` runs every lane (environment) for the batch's largest
iteration count, masking the lanes that are done. When the counts are skewed (most lanes
finish in a few iterations, a few need many) most of that work is wasted. The helpers here
list the lanes that still have work (`active_order`) and run them in compact chunks
(`chunk_width`); `compacted_while` packages that as a drop-in `while_loop`, and
`lane_while` does the same for loops whose lanes are already an axis of their arguments (the
continuous engine's replicas: under `vmap` the lanes are (environment, replica) pairs);
`one_pass` is `lane_while` cut to one trip (a benchmark's ceiling, not a loop).
`cluster.advance_static` uses the first two for its (environment, GPU) lanes.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxserve.core.tree import select


# ------------------------------------------------------------ the batched path, per backend

ENGINE_PATH_ENV = "JAXSERVE_ENGINE_PATH"
ENGINE_PATHS = ("compact", "dense", "loop")
# Module-level override of the batched path ("compact", "dense", or None: the environment
# variable JAXSERVE_ENGINE_PATH, then the backend's default). Read when a program is traced:
# after changing it, call `jax.clear_caches()` so cached programs are traced again.
engine_path: str | None = None


def batched_path() -> str:
    """How data-dependent loops run under `vmap`, chosen when the program is traced.

    For `cluster.advance_static` and for every `compacted_while` (Batching-v0's and
    Autoscaling-v0's arrival loops, the continuous-batching engine's iteration loop):
    "compact" (lane compaction: `cluster._advance_lanes`, `compacted_while`'s chunks) on CPU,
    where a masked iteration over every lane costs real work and a loop test is cheap;
    "dense" (`cluster._advance_unrolled` vmapped) on GPU/TPU, where masked work over every
    lane is nearly free and each data-dependent loop test is a device-to-host
    synchronisation (`compacted_while` then runs the plain masked loop; `advance_static` its
    unrolled form). Overridden by `engine_path`, then by the
    `JAXSERVE_ENGINE_PATH` environment variable, so both are testable on any backend.
    "loop" (the plain `while_loop` vmapped, as before lane compaction: every lane runs the
    batch's largest event count) is kept for profiling and comparison.
    """
    choice = engine_path or os.environ.get(ENGINE_PATH_ENV) or (
        "compact" if jax.default_backend() == "cpu" else "dense")
    if choice not in ENGINE_PATHS:
        raise ValueError(f"engine path must be one of {ENGINE_PATHS}, got {choice!r} "
                         f"(lanes.engine_path or ${ENGINE_PATH_ENV})")
    return choice


def chunk_width(lanes: int) -> int:
    """Lanes a compacted loop processes at once: a sixteenth of them, at least 64.

    One width means one compiled loop; the number of chunks follows the lanes with work, so
    a step costs at most one partly filled chunk more than its work needs.
    """
    return min(lanes, max(64, -(-lanes // 16)))


def active_order(active: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    """Flat indices of `active`'s True entries in row-major order, padded to `size` with
    `active.size`, and how many there are: `jnp.nonzero(active.ravel(), size=size,
    fill_value=active.size)`.

    `active` is `(rows, columns)` (e.g. environments x GPUs; use `(lanes, 1)` for one flag per
    lane). Each lane's rank comes from a prefix sum within its row plus one over the rows'
    totals, then one scatter places the lanes. `jnp.nonzero` instead runs two prefix sums
    over all lanes and a scatter-add; at 32,768 lanes on CPU it measured 2-4x slower
    (`docs/benchmarks.md`). The prefix sums are `associative_scan`s: XLA's CPU `cumsum` (a
    reduce-window) measured slower still.
    """
    rows, cols = active.shape
    a = active.astype(jnp.int32)
    within = jax.lax.associative_scan(jnp.add, a, axis=1) - a  # exclusive, per row
    row = within[:, -1] + a[:, -1]
    before = jax.lax.associative_scan(jnp.add, row) - row  # exclusive, over rows
    rank = jnp.where(active, before[:, None] + within, size).ravel()
    lanes = jnp.arange(rows * cols, dtype=jnp.int32)
    order = jnp.full((size,), rows * cols, jnp.int32).at[rank].set(lanes, mode="drop")
    return order, before[-1] + row[-1]


@jax.custom_batching.custom_vmap
def batch_max(x: jax.Array) -> jax.Array:
    """`x` itself; under `vmap`, the maximum of `x` over the mapped axis, *unbatched* (under
    nested `vmap`s, over all of them).

    For choosing a static size shared by a whole batch: `lax.switch(batch_max(i), branches)`
    stays one conditional under `vmap` (each branch runs vmapped, once), where a switch on a
    per-lane index becomes a select that runs every branch. Each lane then gets a size at
    least as large as it needs itself, so a branch must compute the same function at every
    size it may be given (only the padding differs). Inside `compacted_while` the batch is
    the lanes of the current phase or chunk.
    """
    return x


@batch_max.def_vmap
def _batch_max_rule(axis_size, in_batched, x):
    (batched,) = in_batched
    # Called again on the reduced value, so that an enclosing `vmap` (e.g. PPO's over seeds
    # around the environments') reduces its axis too; else its lanes would disagree and a
    # `lax.cond` on the result would become a select running every branch.
    return (batch_max(jnp.max(x, axis=0)) if batched else x), False


def map_rows(fn: Callable[..., Any], block: int) -> Callable[..., Any]:
    """`fn` (arrays with a leading axis of independent rows -> a pytree of such arrays), run
    over blocks of `block` rows at a time (`lax.map`) on the "compact" batched path (CPU).

    Under `vmap` every enclosing axis merges into the rows first (the returned function is a
    `custom_vmap` that calls itself on the merged arrays, as `batch_max` does), so a
    per-environment call of a few rows vmapped over thousands of environments runs as one
    blocked map over all their rows. For row-wise work whose intermediates grow faster than
    its inputs (a pairwise `(rows, m, m)` term): done for all rows at once those
    intermediates leave the CPU's caches (measured: a `(1024, 192, 192)` pairwise sum ran in
    ~70 ms at once, ~5.5 ms in blocks of 64 rows: lab/history/benchmarks.md, the section on
    the estimates' packed window, commit dd1da4c, with its micro-benchmark); on GPU/TPU
    ("dense") and for at most `block` rows, `fn` runs unblocked. Rows are padded with zeros
    to a multiple of `block`, so `fn` must accept rows of zeros. Each row's values are `fn`'s
    on that row.
    """
    def plain(*xs):
        rows = xs[0].shape[0]
        if batched_path() != "compact" or rows <= block:
            return fn(*xs)
        pad = -rows % block
        blocks = tuple(jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)).reshape(
            (-1, block) + x.shape[1:]) for x in xs)
        out = jax.lax.map(lambda b: fn(*b), blocks)
        return jax.tree.map(lambda o: o.reshape((-1,) + o.shape[2:])[:rows], out)

    mapped = jax.custom_batching.custom_vmap(plain)

    @mapped.def_vmap
    def _rule(axis_size, in_batched, *xs):
        xs = [x if b else jnp.broadcast_to(x, (axis_size,) + x.shape)
              for x, b in zip(xs, in_batched)]
        rows = xs[0].shape[1]
        out = mapped(*[x.reshape((axis_size * rows,) + x.shape[2:]) for x in xs])
        out = jax.tree.map(lambda o: o.reshape((axis_size, rows) + o.shape[1:]), out)
        return out, jax.tree.map(lambda _: True, out)

    return mapped


DENSE_FRACTION = 4  # the dense phase runs while more than 1/DENSE_FRACTION of lanes are active
# Batches of at most this many lanes run the plain masked loop: their one chunk would be the
# whole batch, so compaction would only add a second compiled loop (evaluation programs of a
# few environments pay compile time, not loop time).
MIN_COMPACT_LANES = 128


def compacted_while(cond_fn: Callable[[Any, Any], jax.Array], body_fn: Callable[..., Any],
                    carry: Any, consts: Any, gated: bool = False) -> Any:
    """`lax.while_loop(lambda c: cond_fn(c, consts), lambda c: body_fn(c, consts), carry)`.

    The same values for one lane, and, lane by lane, under `vmap` (each lane runs the same
    iterations; float results equal up to XLA's vectorised rounding). Under `vmap` it runs
    in two phases: a dense phase (the plain masked loop over the whole batch) while more
    than `1/DENSE_FRACTION` of the lanes still iterate, then the remaining lanes in compact
    chunks of `chunk_width` lanes, each gathered, looped to completion and scattered back.
    So a batch whose lanes need e.g. 4-8 iterations and a few of them 30 pays ~8 full
    iterations plus 30 of a small chunk, not 30 full ones. Only on the "compact" batched path
    (`batched_path`: the CPU default) and for more than `MIN_COMPACT_LANES` lanes; otherwise
    the plain masked loop.

    `cond_fn` and `body_fn` take `(carry, consts)` and must not close over traced values:
    everything traced they read goes through `consts` (which may be batched or not).
    `body_fn` is applied only where `cond_fn` holds: by default the loop selects, lane by
    lane, between the body's output and its input. With `gated=True` the body takes a third
    argument, `active` (a bool scalar per lane), and must itself return its carry unchanged
    where `active` is False; the loop then selects nothing. A body that writes a few entries
    of large buffers (a queue push) can gate those writes (`queues.push`'s `enabled`) instead
    of paying a select over, and XLA's copy of, every buffer in every iteration.
    """
    loop = _compacted(cond_fn, _select_body(body_fn) if not gated else body_fn)
    return loop(carry, consts)


def lane_while(cond_fn: Callable[[Any, Any], jax.Array], body_fn: Callable[..., Any],
               carry: Any, consts: Any, shared: Any = None) -> Any:
    """A gated `compacted_while` over lanes that are already an axis of the arguments.

    Every leaf of `carry` and `consts` has a leading axis of `L` lanes (e.g. the replicas of
    one cluster, which are independent between two arrivals); `shared` (any pytree, may be
    None) is read by every lane. `cond_fn(carry_l, (consts_l, shared))` and
    `body_fn(carry_l, (consts_l, shared), active)` see one lane (the leading axis removed),
    and the body is gated as in `compacted_while(gated=True)`. Alone, the `L` lanes run as a
    masked loop (`L` is small); under `vmap` of `B` environments the `B x L` lanes run as one
    batch, with `compacted_while`'s dense phase and compact chunks over *lanes*, not
    environments: an environment whose one replica has an event due pays for that replica's
    pass, not for all of its replicas. Returns the final carry (leading axis `L`).

    Under nested `vmap`s every one of them merges with the lanes (`_lane_loop`): PPO's
    seeds x environments x replicas are one batch of lanes.
    """
    flags = (jax.tree.map(lambda _: True, consts), jax.tree.map(lambda _: False, shared))
    return _lane_loop(cond_fn, body_fn, flags)(carry, (consts, shared))


def one_pass(cond_fn: Callable[[Any, Any], jax.Array], body_fn: Callable[..., Any],
             carry: Any, consts: Any, shared: Any = None) -> Any:
    """`lane_while`'s signature and gating, but one trip: every lane's body once, active where
    `cond_fn` holds (under `vmap`, one dense pass over every lane). Not the loop's result:
    lanes that needed more trips fall behind. It measures the least that any loop doing a
    masked pass per call pays (`engines.ContinuousEngine(mode="one_pass")`, the benchmark's
    ceiling, `scripts/bench.py --ceiling`)."""
    def lane(c, k):
        return body_fn(c, (k, shared), cond_fn(c, (k, shared)))
    return jax.vmap(lane)(carry, consts)


def _lane_loop(cond_fn, body_fn, lane_flags):
    """The loop over lanes as a `custom_vmap` function `loop(carry, consts)`: every leaf of
    `carry`, and each leaf of `consts` whose `lane_flags` leaf is True, has a leading axis of
    lanes; the other `consts` leaves are read by every lane. Alone it is `_batched_loop`
    over those lanes; under `vmap` of `B` it merges the new axis into the lanes (`B x L`) and
    calls itself, so nested `vmap`s (PPO's seeds around the environments) all merge into one
    batch of lanes, each compacted as one, instead of the outer ones batching the inner
    loop as a plain masked `while_loop`."""
    def plain(carry, consts):
        lanes = jax.tree.leaves(carry)[0].shape[0]
        compact = batched_path() == "compact" and lanes > MIN_COMPACT_LANES
        return _batched_loop(cond_fn, body_fn, carry, consts, lane_flags, lanes, compact)

    loop = jax.custom_batching.custom_vmap(plain)

    @loop.def_vmap
    def _rule(axis_size, in_batched, carry, consts):
        carry_b, consts_b = in_batched
        lead = jax.tree.leaves(carry)[0]
        lanes = lead.shape[1] if jax.tree.leaves(carry_b)[0] else lead.shape[0]

        def merge(x, b):  # a lane leaf: (B, L, ...) or (L, ...) -> (B * L, ...)
            x = x if b else jnp.broadcast_to(x, (axis_size,) + jnp.shape(x))
            return x.reshape((axis_size * lanes,) + x.shape[2:])

        def per_lane(x, b):  # a shared leaf batched here: (B, ...) -> (B * L, ...)
            x = jnp.broadcast_to(x[:, None], (axis_size, lanes) + x.shape[1:])
            return x.reshape((axis_size * lanes,) + x.shape[2:])

        def merge_const(x, b, lane):
            return merge(x, b) if lane else (per_lane(x, b) if b else x)

        flags = jax.tree.map(lambda b, lane: bool(b or lane), consts_b, lane_flags)
        out = _lane_loop(cond_fn, body_fn, flags)(
            jax.tree.map(merge, carry, carry_b),
            jax.tree.map(merge_const, consts, consts_b, lane_flags))
        out = jax.tree.map(lambda x: x.reshape((axis_size, lanes) + x.shape[1:]), out)
        return out, jax.tree.map(lambda _: True, out)

    return loop


def _select_body(body_fn):
    """A gated body (see `compacted_while`) from one that may change inactive lanes."""
    def body(carry, consts, active):
        return select(active, body_fn(carry, consts), carry)
    return body


def _compacted(cond_fn, body_fn):
    def plain(carry, consts):
        return jax.lax.while_loop(lambda c: cond_fn(c, consts),
                                  lambda c: body_fn(c, consts, jnp.bool_(True)), carry)

    loop = jax.custom_batching.custom_vmap(plain)

    @loop.def_vmap
    def _rule(axis_size, in_batched, carry, consts):
        carry_b, consts_b = in_batched
        carry = jax.tree.map(
            lambda x, b: x if b else jnp.broadcast_to(x, (axis_size,) + jnp.shape(x)),
            carry, carry_b)
        # The batch's environments are now lanes (merged with any enclosing vmap's).
        out = _lane_loop(cond_fn, body_fn, consts_b)(carry, consts)
        return out, jax.tree.map(lambda _: True, out)

    return loop


def _axes(batched):
    """vmap `in_axes` for a pytree from its custom_vmap batched flags: 0 or None per leaf."""
    return jax.tree.map(lambda b: 0 if b else None, batched)


def _batched_loop(cond_fn, body_fn, carry, consts, consts_batched, lanes: int,
                  compact: bool = True):
    """The loop over a batch of `lanes` lanes (leading axes) with a gated `body_fn`: the dense
    phase (every lane, masked) while more than `1/DENSE_FRACTION` of the lanes iterate, then
    compact chunks; with `compact=False` the dense phase runs to the end."""
    axes = _axes(consts_batched)
    cond = jax.vmap(cond_fn, in_axes=(0, axes))
    body = jax.vmap(body_fn, in_axes=(0, axes, 0))  # gated: (carry, consts, active)
    dense_above = lanes // DENSE_FRACTION if compact else 0

    # The active flags ride in the carries so each iteration evaluates the condition once.
    def dense_body(c):
        state, active = c
        state = body(state, consts, active)
        return state, cond(state, consts)

    carry, active = jax.lax.while_loop(
        lambda c: jnp.sum(c[1].astype(jnp.int32)) > dense_above, dense_body,
        (carry, cond(carry, consts)))
    if not compact:
        return carry

    chunk = chunk_width(lanes)
    order, num_active = active_order(active[:, None], lanes + chunk)

    def run_chunk(j, carry):
        idx = jax.lax.dynamic_slice(order, (j * chunk,), (chunk,))
        ok = idx < lanes
        lane = jnp.minimum(idx, lanes - 1)
        sub = jax.tree.map(lambda x: x[lane], carry)
        sub_consts = jax.tree.map(lambda x, b: x[lane] if b else x, consts, consts_batched)

        def chunk_body(c):
            state, active = c
            state = body(state, sub_consts, active)
            return state, cond(state, sub_consts) & ok

        sub, _ = jax.lax.while_loop(lambda c: jnp.any(c[1]), chunk_body,
                                    (sub, cond(sub, sub_consts) & ok))
        return jax.tree.map(lambda x, v: x.at[idx].set(v, mode="drop"), carry, sub)

    num_chunks = (num_active + chunk - 1) // chunk
    return jax.lax.fori_loop(0, num_chunks, run_chunk, carry)
