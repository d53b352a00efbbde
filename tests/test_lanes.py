"""`lanes.compacted_while` equals `lax.while_loop`, alone and under `vmap` (both phases);
`lanes.active_order` equals `jnp.nonzero`; the environments that use `compacted_while`, vmapped
over enough lanes to compact, equal single-environment runs."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.core import cluster as C
from jaxserve.core import lanes
from jaxserve.core.queues import Request
from jaxserve.core.types import GPUProfile, stack_profiles


def _cond(c, consts):
    i, _, limit = c
    return i < limit


def _body(c, consts):
    i, acc, limit = c
    scale, offset = consts
    # A float recurrence, so a lane that ran a wrong number of iterations shows.
    return i + 1, acc * scale + offset + i.astype(jnp.float32), limit


def _plain(c, consts):
    return jax.lax.while_loop(lambda x: _cond(x, consts), lambda x: _body(x, consts), c)


def _carry(limits):
    n = limits.shape[0]
    return (jnp.zeros((n,), jnp.int32), jnp.linspace(0.0, 1.0, n, dtype=jnp.float32), limits)


@pytest.mark.parametrize("consts_batched", [False, True])
def test_vmapped_equals_plain_loop_with_skewed_counts(consts_batched):
    # 512 lanes: most finish in 0-4 iterations, the rest need up to 60, so the dense phase
    # stops early and several compact chunks (64 lanes each) run the rest.
    rng = np.random.default_rng(0)
    limits = np.where(rng.random(512) < 0.6, rng.integers(0, 5, 512), rng.integers(5, 61, 512))
    t = next(t for t in range(61) if (limits > t).sum() <= 512 // lanes.DENSE_FRACTION)
    assert -(-(limits > t).sum() // lanes.chunk_width(512)) >= 2  # the test covers >= 2 chunks
    carry = _carry(jnp.asarray(limits, jnp.int32))
    if consts_batched:
        consts = (jnp.linspace(0.5, 0.9, 512, dtype=jnp.float32), jnp.full((512,), 0.25))
        axes = (0, 0)
    else:
        consts = (jnp.float32(0.7), jnp.float32(0.25))
        axes = (None, None)
    got = jax.jit(jax.vmap(lambda c, k: lanes.compacted_while(_cond, _body, c, k),
                           in_axes=(0, axes)))(carry, consts)
    want = jax.jit(jax.vmap(_plain, in_axes=(0, axes)))(carry, consts)
    np.testing.assert_array_equal(np.asarray(got[0]), limits)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-6)


def test_single_lane_and_nested_vmap():
    carry = (jnp.int32(0), jnp.float32(0.5), jnp.int32(7))
    consts = (jnp.float32(0.9), jnp.float32(0.1))
    single = lanes.compacted_while(_cond, _body, carry, consts)
    want = _plain(carry, consts)
    assert int(single[0]) == 7
    np.testing.assert_allclose(float(single[1]), float(want[1]), rtol=1e-6)
    limits = jnp.asarray(np.arange(24).reshape(3, 8) % 11, jnp.int32)
    nested = jax.vmap(jax.vmap(lambda c: lanes.compacted_while(_cond, _body, c, consts)))(
        (jnp.zeros((3, 8), jnp.int32), jnp.ones((3, 8), jnp.float32), limits))
    np.testing.assert_array_equal(np.asarray(nested[0]), np.asarray(limits))


def test_unbatched_carry_leaves_are_broadcast():
    # Only the limit is batched; the counter and accumulator start shared.
    limits = jnp.asarray([0, 3, 9, 1], jnp.int32)
    got = jax.vmap(lambda lim: lanes.compacted_while(
        _cond, _body, (jnp.int32(0), jnp.float32(1.0), lim),
        (jnp.float32(1.0), jnp.float32(0.0))))(limits)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(limits))
    # acc = 1 + sum(range(limit))
    np.testing.assert_allclose(np.asarray(got[1]), [1.0, 4.0, 37.0, 1.0])


def _lane_body(c, consts, active):
    (scale,), (offset,) = consts  # per-lane consts, then the shared ones
    new = _body(c, (scale, offset))
    return jax.tree.map(lambda a, b: jnp.where(active, a, b), new, c)


@pytest.mark.parametrize("shared_batched", [False, True])
def test_lane_while_equals_a_loop_per_lane(shared_batched):
    """`lane_while` over 4 lanes per environment: alone, each lane as its own `while_loop`;
    under `vmap` of 128 environments (512 lanes: the dense phase, then >= 2 compact chunks)
    the same, with the shared constant per environment or common."""
    rng = np.random.default_rng(2)
    envs, per = 128, 4
    limits = np.where(rng.random((envs, per)) < 0.6, rng.integers(0, 5, (envs, per)),
                      rng.integers(5, 61, (envs, per)))
    carry = (jnp.zeros((envs, per), jnp.int32),
             jnp.asarray(rng.random((envs, per)), jnp.float32),
             jnp.asarray(limits, jnp.int32))
    scale = jnp.asarray(rng.uniform(0.5, 0.9, (envs, per)), jnp.float32)
    offset = (jnp.asarray(rng.uniform(0.0, 0.5, envs), jnp.float32) if shared_batched
              else jnp.float32(0.25))
    got = jax.jit(jax.vmap(lambda c, sc, off: lanes.lane_while(
        lambda x, _: _cond(x, None), _lane_body, c, (sc,), (off,)),
        in_axes=(0, 0, 0 if shared_batched else None)))(carry, scale, offset)
    offs = np.broadcast_to(np.asarray(offset), (envs,))

    def one(c, sc, off):
        return _plain(c, (sc, off))

    want = jax.jit(jax.vmap(jax.vmap(one, in_axes=(0, 0, None))))(
        carry, scale, jnp.asarray(offs))
    np.testing.assert_array_equal(np.asarray(got[0]), limits)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-6)
    alone = lanes.lane_while(lambda x, _: _cond(x, None), _lane_body,
                             jax.tree.map(lambda x: x[0], carry), (scale[0],),
                             (jnp.float32(offs[0]),))
    np.testing.assert_array_equal(np.asarray(alone[0]), limits[0])
    np.testing.assert_allclose(np.asarray(alone[1]), np.asarray(want[1][0]), rtol=1e-6)


def _while_count(jaxpr) -> int:
    """`while` loops in a jaxpr, nested ones included."""
    return str(jaxpr).count("while[")


@pytest.mark.parametrize("outer_shared", [False, True])
def test_nested_vmaps_merge_into_one_batch_of_lanes(outer_shared):
    """PPO's seeds around the environments: under `vmap(vmap(lane_while))` (4 seeds x 32
    environments x 4 lanes = 512 lanes) every lane runs as its own `while_loop`, and the
    lanes are compacted as one batch: the program holds the compact chunks' loops, where
    batching the inner loop again (32 x 4 = 128 lanes: masked, no chunks) would not."""
    rng = np.random.default_rng(3)
    seeds, envs, per = 4, 32, 4
    shape = (seeds, envs, per)
    limits = np.where(rng.random(shape) < 0.6, rng.integers(0, 5, shape),
                      rng.integers(5, 61, shape))
    carry = (jnp.zeros(shape, jnp.int32), jnp.asarray(rng.random(shape), jnp.float32),
             jnp.asarray(limits, jnp.int32))
    scale = jnp.asarray(rng.uniform(0.5, 0.9, shape), jnp.float32)
    # The shared constant: one per seed (batched only by the outer vmap) or common.
    offset = (jnp.asarray(rng.uniform(0.0, 0.5, seeds), jnp.float32) if outer_shared
              else jnp.float32(0.25))

    def inner(c, sc, off):
        return jax.vmap(lambda c1, s1: lanes.lane_while(
            lambda x, _: _cond(x, None), _lane_body, c1, (s1,), (off,)))(c, sc)

    nested = jax.vmap(inner, in_axes=(0, 0, 0 if outer_shared else None))
    got = jax.jit(nested)(carry, scale, offset)
    offs = jnp.asarray(np.broadcast_to(np.asarray(offset), (seeds,)))
    want = jax.jit(jax.vmap(jax.vmap(jax.vmap(lambda c, sc, off: _plain(c, (sc, off)),
                                              in_axes=(0, 0, None)), in_axes=(0, 0, None))))(
        carry, scale, offs)
    np.testing.assert_array_equal(np.asarray(got[0]), limits)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-6)
    # Compacted as one batch: the dense loop, and the chunk loop with its inner while.
    assert _while_count(jax.make_jaxpr(nested)(carry, scale, offset)) >= 3
    flat = jax.vmap(lambda c, sc: lanes.lane_while(
        lambda x, _: _cond(x, None), _lane_body, c, (sc,), (jnp.float32(0.25),)))
    assert _while_count(jax.make_jaxpr(flat)(jax.tree.map(lambda x: x[0], carry),
                                             scale[0])) == 1  # 128 lanes: masked only


def test_nested_compacted_while_equals_plain_loops():
    """`compacted_while` under two `vmap`s (8 x 64 = 512 lanes, consts batched by the outer
    one only) equals a `while_loop` per lane."""
    rng = np.random.default_rng(4)
    limits = np.where(rng.random((8, 64)) < 0.6, rng.integers(0, 5, (8, 64)),
                      rng.integers(5, 61, (8, 64)))
    carry = (jnp.zeros((8, 64), jnp.int32), jnp.asarray(rng.random((8, 64)), jnp.float32),
             jnp.asarray(limits, jnp.int32))
    scale = jnp.asarray(rng.uniform(0.5, 0.9, 8), jnp.float32)

    def inner(c, sc):
        return jax.vmap(lambda c1: lanes.compacted_while(_cond, _body, c1,
                                                         (sc, jnp.float32(0.25))))(c)

    got = jax.jit(jax.vmap(inner))(carry, scale)
    want = jax.jit(jax.vmap(lambda c, sc: jax.vmap(
        lambda c1: _plain(c1, (sc, jnp.float32(0.25))))(c)))(carry, scale)
    np.testing.assert_array_equal(np.asarray(got[0]), limits)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-6)
    assert _while_count(jax.make_jaxpr(jax.vmap(inner))(carry, scale)) >= 3


def test_active_order_equals_nonzero():
    rng = np.random.default_rng(1)
    for rows, cols in ((37, 8), (5, 1), (64, 3)):
        active = rng.random((rows, cols)) < 0.3
        size = rows * cols + 16
        order, count = lanes.active_order(jnp.asarray(active), size)
        want = np.flatnonzero(active.ravel())
        assert int(count) == want.size
        np.testing.assert_array_equal(np.asarray(order)[:want.size], want)
        assert np.all(np.asarray(order)[want.size:] == rows * cols)


def _random_rollout(env, params, steps):
    """`rollout(key)`: `steps` random-action steps from a reset, per step `(reward, arrived,
    completed)`."""
    def rollout(key):
        _, state = env.reset(key, params)

        def step(state, k):
            action = env.action_space(params).sample(jax.random.fold_in(k, 1))
            _, state, reward, _, _, info = env.step(k, state, action, params)
            return state, (reward, info["arrived"], info["completed"])

        return jax.lax.scan(step, state, jax.random.split(key, steps))[1]

    return rollout


def _assert_same_rollout(one, batched_one):
    """A single environment's rollout equals its lane of a batched one (counts exactly)."""
    np.testing.assert_array_equal(np.asarray(one[1]), np.asarray(batched_one[1]))
    np.testing.assert_array_equal(np.asarray(one[2]), np.asarray(batched_one[2]))
    np.testing.assert_allclose(np.asarray(one[0]), np.asarray(batched_one[0]), rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("name, steps", [("Batching-v0", 12), ("Autoscaling-v0", 3)])
def test_env_compacted_loop_equals_single_environments(name, steps):
    # More lanes than MIN_COMPACT_LANES, so the env's loop (Batching-v0's and Autoscaling-v0's
    # arrival loops) takes the compacted path under vmap; the env contract tests use small
    # batches, which run the plain loop. The continuous engine's iterations (LLMRouting-v0)
    # are compacted in the nested test below: one vmap goes through the same rule
    # (`lanes._lane_loop` merges each vmap's axis into the lanes), so a second LLMRouting-v0
    # program here would repeat it.
    import jaxserve

    n = lanes.MIN_COMPACT_LANES + 32
    env, params = jaxserve.make(name)
    keys = jax.random.split(jax.random.PRNGKey(3), n)
    rollout = _random_rollout(env, params, steps)
    batched = jax.jit(jax.vmap(rollout))(keys)
    single = jax.jit(rollout)
    if name == "Batching-v0":
        per_step = np.sort(np.asarray(batched[1]), axis=0)[::-1]  # (lanes, steps), descending
        # In some step the busiest lanes needed more iterations than the lane at the dense
        # phase's cut (a quarter of the lanes), so the compact chunks did run.
        assert np.any(per_step[0] > per_step[n // lanes.DENSE_FRACTION])
    arrived = np.asarray(batched[1]).sum(1)
    # Lanes with the most and fewest arrivals, so the compacted chunks' lanes are among them.
    for i in {int(arrived.argmax()), int(arrived.argmin()), 0, n - 1}:
        _assert_same_rollout(single(keys[i]), jax.tree.map(lambda x: x[i], batched))


@pytest.mark.parametrize("name", ["Routing-v0", "LLMRouting-v0"])
def test_env_under_nested_vmaps_equals_single_environments(name):
    """The engines' batched loops (`cluster.advance_static`'s lanes, the continuous engine's
    `lane_while`) under PPO's shape, `vmap` over 2 seeds of `vmap` over 72 environments,
    which merge into one batch: every environment equals its single run."""
    import jaxserve

    env, params = jaxserve.make(name)
    keys = jax.random.split(jax.random.PRNGKey(5), 144).reshape(2, 72, 2)
    rollout = _random_rollout(env, params, 3)
    nested = jax.jit(jax.vmap(jax.vmap(rollout)))(keys)
    single = jax.jit(rollout)
    done = np.asarray(nested[2]).sum(-1)
    for s, i in {(0, 0), (1, 71), np.unravel_index(done.argmax(), done.shape),
                 np.unravel_index(done.argmin(), done.shape)}:
        _assert_same_rollout(single(keys[s, i]), jax.tree.map(lambda x: x[s, i], nested))


def _gated_body(c, consts, active):
    # The gated contract: the body itself leaves inactive lanes unchanged. It writes one entry
    # of a buffer per iteration, dropped where inactive, and selects only the scalars.
    i, acc, limit, buf = c
    j = jnp.where(active, i % buf.shape[0], buf.shape[0])
    buf = buf.at[j].set(acc, mode="drop")
    i2, acc2, _ = _body((i, acc, limit), consts)
    return jnp.where(active, i2, i), jnp.where(active, acc2, acc), limit, buf


def _selected_body(c, consts):
    i, acc, limit, buf = c
    buf = buf.at[i % buf.shape[0]].set(acc)
    i2, acc2, _ = _body((i, acc, limit), consts)
    return i2, acc2, limit, buf


@pytest.mark.parametrize("num_lanes", [lanes.MIN_COMPACT_LANES // 2, 512])
@pytest.mark.parametrize("path", ["compact", "dense"])
def test_gated_body_equals_selected_body(num_lanes, path, monkeypatch):
    # Both the compacted loop (512 lanes, "compact") and the plain masked loop (few lanes, or
    # the "dense" GPU default) run a gated body to the same values as the selecting form.
    monkeypatch.setattr(lanes, "engine_path", path)
    rng = np.random.default_rng(1)
    limits = jnp.asarray(np.where(rng.random(num_lanes) < 0.6, rng.integers(0, 5, num_lanes),
                                  rng.integers(5, 41, num_lanes)), jnp.int32)
    carry = (*_carry(limits), jnp.zeros((num_lanes, 16), jnp.float32))
    consts = (jnp.float32(0.7), jnp.float32(0.25))
    cond = lambda c, k: _cond(c[:3], k)  # noqa: E731
    gated = jax.jit(jax.vmap(lambda c: lanes.compacted_while(cond, _gated_body, c, consts,
                                                             gated=True)))(carry)
    selected = jax.jit(jax.vmap(lambda c: lanes.compacted_while(cond, _selected_body, c,
                                                                consts)))(carry)
    single = [jax.jit(lambda c: lanes.compacted_while(cond, _gated_body, c, consts,
                                                      gated=True))(
        jax.tree.map(lambda x: x[i], carry)) for i in (0, 1, num_lanes - 1)]
    np.testing.assert_array_equal(np.asarray(gated[0]), np.asarray(limits))
    for g, s in zip(gated, selected):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(s))
    for lane, one in zip((0, 1, num_lanes - 1), single):
        for g, o in zip(gated, one):
            np.testing.assert_allclose(np.asarray(g[lane]), np.asarray(o), rtol=1e-6)
    jax.clear_caches()


def test_disabled_route_changes_nothing():
    # `route(..., enabled=False)` (a gated loop body's inactive lane) writes nothing, while
    # `enabled=True` is the ordinary route; under vmap, lane by lane.
    gpus = stack_profiles([GPUProfile(max_batch=4, queue_cap=3)] * 2)
    cl = C.empty_cluster(2, 4, 4, with_ids=True)
    req = lambda t, i: Request(arrival=jnp.float32(t), prompt=jnp.float32(100 + i),  # noqa
                               output=jnp.float32(20), estimate=jnp.float32(16),
                               size_class=jnp.int32(0), req_id=jnp.int32(i))
    for i in range(4):  # GPU 0 ends full (3 waiting), GPU 1 holds one
        cl, _ = C.route(cl, gpus, req(-0.1 * i, i), jnp.int32(i % 3 == 2))
    cl = C.rebase(cl, jnp.float32(0.05))  # non-zero offsets: a re-anchoring push would show
    for gpu in (0, 1):
        off, dropped = C.route(cl, gpus, req(0.0, 9), jnp.int32(gpu), jnp.bool_(False))
        chex.assert_trees_all_equal(off, cl)
        assert bool(dropped)
        on, d_on = C.route(cl, gpus, req(0.0, 9), jnp.int32(gpu), jnp.bool_(True))
        plain, d_plain = C.route(cl, gpus, req(0.0, 9), jnp.int32(gpu))
        chex.assert_trees_all_equal((on, d_on), (plain, d_plain))
    both = jax.tree.map(lambda x: jnp.stack([x, x]), cl)
    out, dropped = jax.vmap(lambda c, e: C.route(c, gpus, req(0.0, 9), jnp.int32(1), e))(
        both, jnp.array([False, True]))
    chex.assert_trees_all_equal(jax.tree.map(lambda x: x[0], out), cl)
    chex.assert_trees_all_equal(jax.tree.map(lambda x: x[1], out),
                                C.route(cl, gpus, req(0.0, 9), jnp.int32(1))[0])
    assert np.asarray(dropped).tolist() == [True, False]


def test_batch_max_is_identity_alone_and_the_batch_max_under_vmap():
    """`batch_max` returns its input unbatched, the maximum over the mapped axis under `vmap`
    (unbatched, so a switch on it stays one conditional), and over both axes under two (PPO's
    seeds around the environments: still one conditional)."""
    pick = lambda i: jax.lax.switch(  # noqa: E731
        lanes.batch_max(i), [lambda: jnp.int32(10), lambda: jnp.int32(20),
                             lambda: jnp.int32(30)])
    assert int(pick(jnp.int32(1))) == 20
    np.testing.assert_array_equal(jax.vmap(pick)(jnp.array([0, 1, 0])), [20, 20, 20])
    np.testing.assert_array_equal(jax.vmap(jax.vmap(pick))(jnp.array([[0, 1], [0, 0]])),
                                  [[20, 20], [20, 20]])
    for jaxpr in (jax.make_jaxpr(jax.vmap(pick))(jnp.array([0, 1, 0])),
                  jax.make_jaxpr(jax.vmap(jax.vmap(pick)))(jnp.array([[0, 1], [0, 0]]))):
        assert [e.primitive.name for e in jaxpr.eqns].count("cond") == 1
        assert "select_n" not in str(jaxpr)


@pytest.mark.parametrize("path", ["compact", "dense"])
def test_map_rows_equals_fn_alone_and_under_nested_vmap(path, monkeypatch):
    """`map_rows(fn, block)` gives `fn`'s values row by row: alone (150 rows, three blocks,
    the last padded), under `vmap` and under nested `vmap`s (their axes merged into the rows,
    an unbatched argument broadcast), on the blocked ("compact") and plain ("dense") paths.
    A row-wise `fn` of integers, so blocking must reproduce it exactly."""
    monkeypatch.setattr(lanes, "engine_path", path)
    fn = lambda x, y: (x * y[:, :1], (x[:, :, None] * x[:, None, :]).sum(-1))  # noqa: E731
    mapped = lanes.map_rows(fn, 64)
    x = jnp.asarray(np.random.default_rng(0).integers(-9, 9, (150, 5)), jnp.int32)
    y = jnp.asarray(np.random.default_rng(1).integers(-9, 9, (150, 2)), jnp.int32)
    want = fn(x, y)
    chex.assert_trees_all_equal(jax.jit(mapped)(x, y), want)
    xs, ys = x.reshape(6, 25, 5), y.reshape(6, 25, 2)
    got = jax.jit(jax.vmap(mapped))(xs, ys)
    chex.assert_trees_all_equal(jax.tree.map(lambda a: a.reshape((150,) + a.shape[2:]), got),
                                want)
    got = jax.jit(jax.vmap(jax.vmap(mapped, in_axes=(0, None)), in_axes=(0, None)))(
        x.reshape(3, 2, 25, 5), y[:25])
    chex.assert_trees_all_equal(jax.tree.map(lambda a: a.reshape((150,) + a.shape[3:]), got),
                                fn(x, jnp.tile(y[:25], (6, 1))))
