"""Routing-v0's honest default information (only what a deployed router could know) and its
registered scenarios."""

import jax
import numpy as np
import pytest

import jaxserve
from jaxserve.core import arrivals as A
from jaxserve.envs.routing import ROUTING_SCENARIOS
from jaxserve.evaluation.capacity import service_capacity


def test_default_routers_see_a_noisy_prediction_not_the_class():
    _, params = jaxserve.make("Routing-v0")
    assert int(params.estimate_mode) == A.ESTIMATE_NOISY
    assert float(params.estimate_noise) == 1.0
    # The oracle class stays a named option.
    _, p2 = jaxserve.make("Routing-v0", estimate_mode=A.ESTIMATE_CLASS)
    assert int(p2.estimate_mode) == A.ESTIMATE_CLASS
    # Estimates of requests with equal true length differ (noise), and their class follows
    # the estimate, not the true length: the true class does not leak through it.
    out = jax.numpy.full((2000,), 512.0)
    est, cls = jax.vmap(lambda k, o: A.output_estimate(
        k, o, params.estimate_mode, params.estimate_noise, params.size_edges,
        params.size_values))(jax.random.split(jax.random.PRNGKey(0), 2000), out)
    est, cls = np.asarray(est), np.asarray(cls)
    assert np.unique(est).size > 100
    np.testing.assert_array_equal(cls, (est > float(params.size_edges[0])).astype(int))
    # sigma 1: P(512 * e^z <= 128) = P(z <= -1.386) = 8.3%; 2000 draws, +-2% is ~3.3 sd.
    assert abs((cls == 0).mean() - 0.083) < 0.02


@pytest.mark.parametrize("name", sorted(ROUTING_SCENARIOS))
def test_registered_scenarios_build_with_equal_static_shapes(name):
    env, params = jaxserve.make("Routing-v0", scenario=name)
    env0, _ = jaxserve.make("Routing-v0", scenario=sorted(ROUTING_SCENARIOS)[0])
    assert env.static == env0.static  # one program trains the whole family
    assert params.arrivals.rates.shape == (2,)  # bursty: a two-phase MMPP
    mean = float(A.mean_rate(params.arrivals))
    spec = ROUTING_SCENARIOS[name]
    assert mean == pytest.approx(spec["load"] * spec["capacity"], rel=1e-4)
    # The recorded capacity is the scenario mix's (a number, since envs cannot import it).
    assert service_capacity(params) == pytest.approx(spec["capacity"], rel=1e-3)
    assert int(params.estimate_mode) == A.ESTIMATE_NOISY
    obs, state = env.reset(jax.random.PRNGKey(0), params)
    obs, *_ = env.step(jax.random.PRNGKey(1), state, 0, params)
    assert np.all(np.isfinite(np.asarray(obs)))


def test_scenario_overrides_yield_to_explicit_ones_and_unknown_is_an_error():
    _, p = jaxserve.make("Routing-v0", scenario="bursty", arrival_rate=1.0)
    assert p.arrivals.rates.shape == (1,) and float(p.arrivals.rates[0]) == 1.0
    _, p = jaxserve.make("Routing-v0", scenario="bursty_short_queues", slo_s=20.0)
    assert np.all(np.asarray(p.gpus.queue_cap) == 16) and float(p.slo_s) == 20.0
    with pytest.raises(ValueError, match="scenario"):
        jaxserve.make("Routing-v0", scenario="nope")


def test_short_bursts_mix_shifts_with_the_phase_and_the_prompt_says_nothing():
    env, params = jaxserve.make("Routing-v0", scenario="short_bursts")
    assert params.tokens.weights.shape == (2, 2)
    np.testing.assert_allclose(np.asarray(params.tokens.weights), [[0.6, 0.4], [1.0, 0.0]])
    # Both classes share one prompt law: the prompt carries no size information.
    assert np.ptp(np.asarray(params.tokens.prompt_median)) == 0
    assert np.ptp(np.asarray(params.tokens.prompt_sigma)) == 0
    # Arrivals: 30% of the time in bursts at 3x: a burst holds 0.9 / 1.6 of the arrivals, so
    # the mix of all arrivals is 0.7 / 1.6 * 40% = 17.5% long.
    probs = np.asarray(A.arrival_phase_probs(params.arrivals))
    np.testing.assert_allclose(probs, [0.7 / 1.6, 0.9 / 1.6], rtol=1e-4)
    mix = np.asarray(A.mixture_weights(params.tokens, probs))
    assert mix[1] == pytest.approx(0.175, rel=1e-4)


def test_win_experiment_trains_every_scenario_in_one_program():
    """(w) writes a one-mix scenario's class mix once per arrival phase so that all
    scenarios share parameter shapes; the rewritten parameters draw the same requests."""
    from jaxserve.core.sources import sample_stream
    from jaxserve.agents.experiments.routing_win import _per_phase_mix, _shape_signature
    params = {n: jaxserve.make("Routing-v0", scenario=n)[1] for n in ROUTING_SCENARIOS}
    sig = {n: _shape_signature(p) for n, p in params.items()}
    # The per-phase class mix adds an axis to tokens.weights ...
    assert sig["bursty"] == sig["bursty_short_queues"] != sig["short_bursts"]
    # ... which the rewrite adds to the others, changing no request.
    wide = _per_phase_mix(params["bursty"], 2)
    assert _shape_signature(wide) == sig["short_bursts"]
    assert _per_phase_mix(params["short_bursts"], 2) is params["short_bursts"]
    key = jax.random.PRNGKey(3)
    a, b = sample_stream(key, params["bursty"], 500), sample_stream(key, wide, 500)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
