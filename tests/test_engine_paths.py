"""Which batched event loop the environments take under `vmap` (`cluster.batched_path`).

Tracing only (no compilation): a spy on each path's function records which one a vmapped
step traces. Routing-v0 and Autoscaling-v0 (whose per-arrival loop calls `advance_static`)
must take the forced path; the paths' exactness is tested against the reference in
tests/test_engine_reference.py.
"""

import jax
import jax.numpy as jnp
import pytest

import jaxserve
from jaxserve.core import cluster as C
from jaxserve.core import lanes

SPIED = {"compact": "_advance_lanes", "dense": "_advance_unrolled", "loop": "_advance_dense"}


def traced_paths(name, path, monkeypatch):
    taken = []
    for fn_name in SPIED.values():
        fn = getattr(C, fn_name)
        monkeypatch.setattr(C, fn_name,
                            lambda *a, _fn=fn, _n=fn_name: taken.append(_n) or _fn(*a))
    monkeypatch.setattr(lanes, "engine_path", path)
    jax.clear_caches()
    env, params = jaxserve.make(name, max_steps_in_episode=4)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    _, states = jax.vmap(lambda k: env.reset(k, params))(keys)
    jax.make_jaxpr(jax.vmap(lambda k, s: env.step(k, s, jnp.int32(0), params)))(keys, states)
    jax.clear_caches()
    return set(taken)


@pytest.mark.parametrize("name", ["Routing-v0", "Autoscaling-v0"])
@pytest.mark.parametrize("path", ["compact", "dense"])
def test_vmapped_steps_take_the_chosen_batched_path(name, path, monkeypatch):
    assert traced_paths(name, path, monkeypatch) == {SPIED[path]}


def test_batched_path_choice_and_override(monkeypatch):
    monkeypatch.delenv(lanes.ENGINE_PATH_ENV, raising=False)
    monkeypatch.setattr(lanes, "engine_path", None)
    assert C.batched_path() == ("compact" if jax.default_backend() == "cpu" else "dense")
    monkeypatch.setenv(lanes.ENGINE_PATH_ENV, "dense")
    assert C.batched_path() == "dense"
    monkeypatch.setattr(lanes, "engine_path", "compact")  # the module switch wins
    assert C.batched_path() == "compact"
    monkeypatch.setattr(lanes, "engine_path", "sparse")
    with pytest.raises(ValueError, match="engine path"):
        C.batched_path()


@pytest.mark.parametrize("path, compacts", [("compact", True), ("dense", False)])
def test_compacted_while_follows_the_batched_path(path, compacts, monkeypatch):
    # Batching-v0's arrival loop (`lanes.compacted_while`) compacts its lanes only on the
    # "compact" path; elsewhere (the GPU default) it is the plain masked loop.
    calls = []
    real = lanes._batched_loop
    # `_batched_loop(..., compact)` runs both; its last argument says whether it compacts.
    monkeypatch.setattr(lanes, "_batched_loop", lambda *a: calls.append(a[-1]) or real(*a))
    monkeypatch.setattr(lanes, "engine_path", path)
    jax.clear_caches()
    env, params = jaxserve.make("Batching-v0", max_steps_in_episode=4)
    for lanes_, big in ((lanes.MIN_COMPACT_LANES + 1, True), (lanes.MIN_COMPACT_LANES, False)):
        calls.clear()
        keys = jax.random.split(jax.random.PRNGKey(0), lanes_)
        _, states = jax.eval_shape(jax.vmap(lambda k: env.reset(k, params)), keys)
        jax.make_jaxpr(jax.vmap(lambda k, s: env.step(k, s, jnp.int32(1), params)))(keys, states)
        # Small batches (evaluation) never compact: their one chunk would be the batch.
        assert calls and any(calls) == (compacts and big)
    jax.clear_caches()
