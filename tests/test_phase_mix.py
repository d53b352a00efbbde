"""A class mix that depends on the arrival phase (`TokenDist.weights` of shape (phases, classes)).

Statistical checks use fixed keys; each states its tolerance against the binomial standard
deviation of the frequency it checks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxserve
from jaxserve.core import arrivals as A
from jaxserve.core.sources import sample_stream, sample_tokens_n
from jaxserve.policies.routing import workload_means

ROWS = [[0.9, 0.1], [0.4, 0.6]]  # phase 0: 10% long; phase 1 (bursts): 60% long
ARRIVALS = A.mmpp([1.0, 5.0], (0.05, 0.2))  # 20% of the time in phase 1, 5x the rate


def _tokens(rows=ROWS):
    return A.with_phase_weights(A.bimodal_tokens(long_frac=0.2, sigma=0.3), rows)


def test_construction_and_validation_name_the_field():
    tok = _tokens()
    assert tok.weights.shape == (2, 2)
    A.validate_tokens(tok)
    with pytest.raises(ValueError, match="phase_weights"):
        A.with_phase_weights(A.bimodal_tokens(), [0.5, 0.5])  # not one row per phase
    with pytest.raises(ValueError, match="phase_weights"):
        A.with_phase_weights(A.bimodal_tokens(), [[1.0, 0.0, 0.0]])  # 3 columns, 2 classes
    with pytest.raises(ValueError, match="tokens.weights"):
        A.validate_tokens(tok.replace(weights=jnp.asarray([[1.0, 0.0], [0.0, 0.0]])))
    # The rows must match the arrival process's phases (checked by `make`, outside jit).
    with pytest.raises(ValueError, match="tokens.weights has 2 phase rows"):
        jaxserve.make("Routing-v0", arrival_rate=1.0, tokens=tok)
    # Sampling without a phase is refused at trace time rather than silently using row 0.
    with pytest.raises(ValueError, match="arrival phase"):
        A.sample_tokens(jax.random.PRNGKey(0), tok)
    with pytest.raises(ValueError, match="arrival process"):
        sample_tokens_n(jax.random.PRNGKey(0), tok, 8)


def test_one_row_equals_the_plain_mix_bit_for_bit():
    # Backward compatibility: a single phase row under Poisson arrivals draws exactly the
    # requests of the plain (C,) mix from the same keys.
    base = A.bimodal_tokens(long_frac=0.3)
    env, p1 = jaxserve.make("Routing-v0", arrival_rate=1.5, tokens=base)
    _, p2 = jaxserve.make("Routing-v0", arrival_rate=1.5,
                          tokens=A.with_phase_weights(base, [[0.7, 0.3]]))

    def run(params):
        _, state = env.reset(jax.random.PRNGKey(3), params)

        def body(state, k):
            _, state, *_ = env.step_env(k, state, 0, params)
            return state, (state.pending.prompt, state.pending.output)
        return jax.lax.scan(body, state, jax.random.split(jax.random.PRNGKey(4), 200))[1]

    for a, b in zip(run(p1), run(p2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_mix_frequencies_per_phase_in_the_environment():
    env, params = jaxserve.make("Routing-v0", arrivals=ARRIVALS, tokens=_tokens())

    def episode(k):
        _, state = env.reset(k, params)

        def body(state, k):
            rec = (state.phase, state.pending.output > 128.0)
            _, state, *_ = env.step_env(k, state, jnp.int32(0), params)
            return state, rec
        return jax.lax.scan(body, state, jax.random.split(k, 1000))[1]

    phase, long_ = jax.jit(jax.vmap(episode))(jax.random.split(jax.random.PRNGKey(0), 4))
    phase, long_ = np.asarray(phase).ravel(), np.asarray(long_).ravel()
    # Share of arrivals in phase 1: pi_1 r_1 / sum = 0.2 * 5 / (0.8 + 1.0) = 0.556. Phases
    # come in runs (mean 5 s, ~20 requests), so its sampling error is larger than a binomial's:
    # over 4 x 1000 requests ~0.05; 0.1 is the tolerance.
    assert abs((phase == 1).mean() - 1.0 / 1.8) < 0.1
    for p, row in enumerate(ROWS):
        m = phase == p
        # Given the phase, classes are independent draws: >= 1500 requests per phase, binomial
        # sd <= sqrt(0.25 / 1500) = 0.013; 0.05 is ~4 sd (the size-class edge 128 sits > 4
        # log-sd from both medians, so output > 128 is the class).
        assert m.sum() > 1500
        assert abs(long_[m].mean() - row[1]) < 0.05, (p, long_[m].mean())


def test_stream_and_fit_sample_use_the_arrival_weighted_mix():
    _, params = jaxserve.make("Routing-v0", arrivals=ARRIVALS, tokens=_tokens())
    probs = np.asarray(A.arrival_phase_probs(ARRIVALS))
    np.testing.assert_allclose(probs, [0.8 / 1.8, 1.0 / 1.8], rtol=1e-5)
    mix = np.asarray(A.mixture_weights(params.tokens, probs))
    np.testing.assert_allclose(mix[1], probs @ np.asarray(ROWS)[:, 1], rtol=1e-5)  # 0.378
    # 20000 draws: binomial sd 0.0034; 0.015 is ~4 sd.
    _, out = sample_tokens_n(jax.random.PRNGKey(1), params.tokens, 20000, params.arrivals)
    assert abs((np.asarray(out) > 128).mean() - mix[1]) < 0.015
    tr = sample_stream(jax.random.PRNGKey(2), params, 4000)  # runs of phases: sd ~0.02
    assert abs((np.asarray(tr.output) > 128).mean() - mix[1]) < 0.08
    # The workload's mean output is the mix's (lognormal means, sigma 0.3).
    _, o_mean = workload_means(params)
    expect = (mix * np.array([32.0, 512.0])).sum() * np.exp(0.045)
    assert float(o_mean) == pytest.approx(expect, rel=1e-4)
