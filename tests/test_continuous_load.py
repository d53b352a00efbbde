"""The continuous-load estimates (`core.continuous_load`: the LLM envs' shaping potentials and
marginal-backlog feature) read windows of running and waiting slots sized to the batch's
largest replica (`lanes.batch_max`). They must equal the full-width pairwise formula, alone
and under `vmap` over a batch whose lanes need different windows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core import continuous as CB
from jaxserve.core import continuous_load as CL
from jaxserve.core import queues as Q
from jaxserve.core.replica import replica_profile, stack_replicas

MAX_SEQS, QUEUE = 20, 100
# Jitted once here: called eagerly, `advance`'s event loop compiled a `while` program for
# each state, and `route` dispatched (and compiled) its operations one by one.
_route, _advance = jax.jit(CB.route), jax.jit(CB.advance)


def _state(n_requests: int, seed: int, advance_s: float):
    """Two replicas holding `n_requests` requests routed at t = 0 (alternately), then run for
    `advance_s` seconds: some running, some waiting."""
    rng = np.random.default_rng(seed)
    prof = stack_replicas([replica_profile("opt13b-a100-80g", max_seqs=MAX_SEQS,
                                           queue_cap=QUEUE)] * 2)
    rep = CB.empty_replicas(2, QUEUE, MAX_SEQS)
    for i in range(n_requests):
        out = float(rng.integers(2, 400))
        req = Q.Request(arrival=jnp.float32(-rng.uniform(0, 5)),
                        prompt=jnp.float32(rng.integers(1, 200)), output=jnp.float32(out),
                        estimate=jnp.float32(out * rng.uniform(0.5, 2.0)),
                        size_class=jnp.int32(0), req_id=jnp.int32(i))
        rep, dropped, _ = _route(rep, prof, req, jnp.int32(i % 2))
        assert not bool(dropped)
    rep, *_ = _advance(rep, prof, jnp.float32(advance_s), jnp.float32(jnp.inf))
    return rep, prof


def _full_width(rep, prof, prompt, estimate, slo_ttft, slo_tpot):
    """The estimates over every slot (the pairwise formula of the module docstring, no
    window): (remaining times, backlog, marginal backlog, expected SLO misses)."""
    run, q = rep.run, rep.queues
    col = jax.tree.map(lambda x: x[:, None], prof)
    w_valid, win = Q.front(q, q.capacity)
    valid = jnp.concatenate([jnp.arange(rep.max_seqs)[None, :] < run.count[:, None], w_valid],
                            -1)
    cat = lambda a, b: jnp.concatenate([jnp.asarray(a, jnp.float32),  # noqa: E731
                                        jnp.asarray(b, jnp.float32)], -1)
    z = lambda x: jnp.where(valid, x, 0.0)  # noqa: E731
    tokens = cat(run.prompt, win.prompt)
    est = jnp.maximum(cat(run.estimate, win.estimate), 1.0)
    gen = cat(run.gen, jnp.zeros_like(win.estimate))  # waiting requests start over
    age = z(-cat(run.arrival, win.arrival))
    k = z(jnp.maximum(est - gen, 1.0))
    pre = z(jnp.maximum(tokens - cat(run.comp, jnp.zeros_like(win.estimate)), 0.0))
    c = z(col.alpha + col.gamma + col.delta * (tokens + gen + k / 2.0))
    blocks = z(jnp.ceil((tokens + est) / col.block_size.astype(jnp.float32)))
    shared = jnp.minimum(k[..., :, None], k[..., None, :])
    decode = (prof.c0 + prof.beta)[:, None] * k + (shared * c[..., None, :]).sum(-1)
    stall = CL._prefill_time(jax.tree.map(lambda x: x[:, None], prof), pre).sum(-1)
    slow = CL._slowdown(prof, valid.sum(-1), blocks.sum(-1))
    finish = jnp.where(valid, (decode + stall[:, None]) * slow[:, None], 0.0)
    p = jnp.float32(prompt)
    kx = jnp.maximum(jnp.float32(estimate), 1.0)
    cx = prof.alpha + prof.gamma + prof.delta * (p + kx / 2.0)
    bx = jnp.ceil((p + kx) / prof.block_size.astype(jnp.float32))
    stall_x = CL._prefill_time(prof, p)
    n = valid.sum(-1)
    slow1 = CL._slowdown(prof, n + 1, blocks.sum(-1) + bx)
    base = finish.sum(-1) / slow
    own = ((prof.c0 + prof.beta) * kx + (c * jnp.minimum(k, kx)).sum(-1) + cx * kx + stall
           + stall_x)
    marginal = (base + cx * jnp.minimum(k, kx).sum(-1) + n * stall_x + own) * slow1 - base * slow
    deadline = slo_ttft + slo_tpot * jnp.maximum(est - 1.0, 0.0)
    misses = (valid & (age + finish > deadline)).sum()
    return finish, finish.sum(), marginal, misses


def _windowed(rep, prof, prompt, estimate, slo_ttft, slo_tpot):
    return (CL.remaining_times(rep, prof)[0], CL.expected_backlog(rep, prof),
            CL.marginal_backlog(rep, prof, prompt, estimate),
            CL.expected_slo_misses(rep, prof, slo_ttft, slo_tpot))


def _check(got, want):
    finish, backlog, marginal, misses = got
    # The window packs each replica's requests (running, then waiting) where the formula
    # reads them in slot layout: each row sums the same nonzero terms in another order, and
    # a vmapped program vectorises the sums differently again: float32 rounding only.
    np.testing.assert_allclose(finish, want[0], rtol=1e-6)
    # The backlog sums every slot: a different summation order, float32 rounding only.
    np.testing.assert_allclose(backlog, want[1], rtol=1e-6)
    # The marginal backlog is a difference of two sums of the replica's backlog's size: its
    # rounding is relative to that sum (a few float32 ulps of it), not to the difference.
    np.testing.assert_allclose(marginal, want[2], rtol=0, atol=4e-6 * float(want[1]))
    assert int(misses) == int(want[3])


def test_windows_equal_the_full_width_formula_alone_and_under_vmap():
    args = (300.0, 120.0, 2.0, 0.1)
    small = _state(6, 0, 0.5)  # the smallest windows (16 running, 8 waiting)
    large = _state(2 * (MAX_SEQS + 70), 1, 2.0)  # full widths: 20 running, 120 waiting
    assert int(small[0].run.count.max()) <= 16 and int(small[0].queues.count.max()) <= 8
    assert int(large[0].run.count.max()) > 16 and int(large[0].queues.count.max()) > 64
    for rep, prof in (small, large):
        want = jax.jit(_full_width)(rep, prof, *args)
        got = jax.jit(_windowed)(rep, prof, *args)
        _check(got, want)
        # The step's combined call gives the two separate ones' values.
        both = jax.jit(CL.backlog_and_marginal)(rep, prof, *args[:2])
        np.testing.assert_array_equal(both[0], got[1])
        np.testing.assert_array_equal(both[1], got[2])
    # One batch holding both: every lane gets the large windows, results unchanged.
    batch = jax.tree.map(lambda a, b: jnp.stack([a, b]), small[0], large[0])
    got = jax.jit(jax.vmap(_windowed, in_axes=(0, None) + (None,) * 4))(batch, small[1],
                                                                          *args)
    for i, (rep, prof) in enumerate((small, large)):
        _check(jax.tree.map(lambda x: x[i], got), jax.jit(_full_width)(rep, prof, *args))


def test_wide_windows_run_in_row_blocks_under_nested_vmap(monkeypatch):
    """Past `_BLOCK_WIDTH` the pairwise term runs in blocks of replicas (`lanes.map_rows`)
    once `vmap`s merge more replicas than a block. Here the threshold is lowered to 64 so
    that a 2-replica cluster holding ~90 requests each (window 96, blocks of 256 replicas)
    takes that path: 5 x 32 copies give 320 rows (two blocks, the second padded). Every
    copy equals the formula."""
    monkeypatch.setattr(CL, "_BLOCK_WIDTH", 64)
    args = (300.0, 120.0, 2.0, 0.1)
    rep, prof = _state(2 * (MAX_SEQS + 70), 1, 2.0)
    need = int((rep.run.count + rep.queues.count).max())
    width = min(m for m in CL._widths(MAX_SEQS + rep.queues.capacity) if m >= need)
    assert width > CL._BLOCK_WIDTH
    assert CL._block_rows(width) < 5 * 32 * 2 < 2 * CL._block_rows(width)
    copies = jax.tree.map(lambda x: jnp.broadcast_to(x, (5, 32) + x.shape), rep)
    inner = jax.vmap(_windowed, in_axes=(0, None) + (None,) * 4)
    outer = jax.vmap(inner, in_axes=(0, None) + (None,) * 4)
    assert " scan[" in str(jax.make_jaxpr(outer)(copies, prof, *args))  # the blocked map
    got = jax.jit(outer)(copies, prof, *args)
    want = jax.jit(_full_width)(rep, prof, *args)
    for i in range(5):
        for j in (0, 31):
            _check(jax.tree.map(lambda x: x[i, j], got), want)


def test_windows_past_the_sort_width_equal_the_formula(monkeypatch):
    """Past `_SORT_WIDTH` (a window over 2,048 requests: `queue_buffer=2000` or a
    `queue_cap=4096` replica) the pairwise term is summed from the requests sorted by decodes
    left (`_pairwise_sorted`), with no `(width, width)` term. Here the threshold is lowered to
    64 so that the large state's window (96) takes that path, alone and under `vmap` beside a
    lane of small windows: the estimates still equal the formula."""
    monkeypatch.setattr(CL, "_BLOCK_WIDTH", 32)
    monkeypatch.setattr(CL, "_SORT_WIDTH", 64)
    args = (300.0, 120.0, 2.0, 0.1)
    small = _state(6, 0, 0.5)
    large = _state(2 * (MAX_SEQS + 70), 1, 2.0)
    need = int((large[0].run.count + large[0].queues.count).max())
    assert min(m for m in CL._widths(MAX_SEQS + QUEUE) if m >= need) > CL._SORT_WIDTH

    def windowed(*a):  # a new function: jit's and make_jaxpr's caches hold the unpatched one
        return _windowed(*a)

    assert " sort[" in str(jax.make_jaxpr(windowed)(*large, *args))
    for rep, prof in (small, large):
        _check(jax.jit(windowed)(rep, prof, *args), jax.jit(_full_width)(rep, prof, *args))
    batch = jax.tree.map(lambda a, b: jnp.stack([a, b]), small[0], large[0])
    got = jax.jit(jax.vmap(windowed, in_axes=(0, None) + (None,) * 4))(batch, small[1],
                                                                         *args)
    for i, (rep, prof) in enumerate((small, large)):
        _check(jax.tree.map(lambda x: x[i], got), jax.jit(_full_width)(rep, prof, *args))


def test_sorted_pairwise_equals_the_pairwise_sum_with_ties_and_empty_slots():
    """`_pairwise_sorted` at a real width past 2,048, with tied `k` and empty positions
    (`k = c = 0`), against the `(m, m)` sum in float64."""
    rng = np.random.default_rng(0)
    m = 2100
    k = rng.integers(1, 50, (3, m)).astype(np.float32)  # many ties
    c = rng.uniform(0.0, 1e-3, (3, m)).astype(np.float32)
    k[:, 1500:], c[:, 1500:] = 0.0, 0.0
    want = (np.minimum(k[:, :, None], k[:, None, :]).astype(np.float64)
            * c[:, None, :]).sum(-1)
    got = jax.jit(CL._pairwise_sorted, static_argnums=2)(k, c, True)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    np.testing.assert_array_equal(np.asarray(got)[:, 1500:], 0.0)
    np.testing.assert_allclose(jax.jit(CL._pairwise_sorted, static_argnums=2)(k, c, False),
                               want.sum(-1), rtol=2e-6)
    assert CL._block_rows(m) == 8  # past 2,048 the block size no longer fails either
