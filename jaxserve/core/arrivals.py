"""Arrival processes and token-length distributions, as pure functions of keys and pytrees.

Arrivals: a Markov-modulated Poisson process (MMPP) with `K` phases. Poisson(rate) is the
one-phase case, so one sampler serves both and `vmap` over rates needs no recompile.

Token lengths: a mixture of request classes, each with lognormal prompt and output lengths
(`sigma = 0` gives fixed lengths; two classes give the bimodal short/long mix), or an empirical
table of `(prompt, output)` rows sampled uniformly. Which of the two is used is decided by the
table's (static) length.

The output-length *estimate* a policy sees is made here too: exact, noisy (lognormal
multiplicative noise) or a size class (bucketed by `size_edges`).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxserve.core import rng
from jaxserve.core.types import MAX_TOKENS, numeric_array

ESTIMATE_EXACT, ESTIMATE_NOISY, ESTIMATE_CLASS = 0, 1, 2
# Gaps are `-log(u) / rate` with `u` a float32 uniform >= 2^-126 (float32's smallest normal),
# so `-log(u) <= 87.4`: at `MIN_EVENT_RATE` every gap is at most 87.4e-7^-1 ~ 8.7e8 s
# (< `types.MAX_SECONDS`), finite in float32. A phase's events (arrivals and switches) must come at
# least this often.
MIN_EVENT_RATE = 1e-7


@struct.dataclass
class ArrivalProcess:
    """MMPP parameters.

    Attributes:
      rates: arrival rate in each phase (requests/s). `(K,)` float32.
      switch: phase switching rates (1/s); `switch[i, j]` is the rate of moving from phase `i`
        to `j`, the diagonal is ignored. `(K, K)` float32.
    """

    rates: jax.Array
    switch: jax.Array

    @property
    def num_phases(self) -> int:
        return int(self.rates.shape[-1])


def poisson(rate: float) -> ArrivalProcess:
    """Poisson arrivals at `rate` requests/s (a one-phase MMPP)."""
    return ArrivalProcess(rates=jnp.asarray([rate], jnp.float32),
                          switch=jnp.zeros((1, 1), jnp.float32))


def mmpp(rates: Sequence[float], switch_rates) -> ArrivalProcess:
    """MMPP with per-phase `rates` (req/s) and switching rates (1/s).

    `switch_rates` is either a `(K, K)` matrix (diagonal ignored) or, for two phases, a pair
    `(rate 0->1, rate 1->0)`.
    """
    rates = np.asarray(rates, np.float64)
    sw = np.asarray(switch_rates, np.float64)
    if sw.ndim == 1:
        if rates.shape[0] != 2 or sw.shape[0] != 2:
            raise ValueError("switch_rates as a pair needs exactly two phases")
        sw = np.array([[0.0, sw[0]], [sw[1], 0.0]])
    return ArrivalProcess(rates=jnp.asarray(rates, jnp.float32),
                          switch=jnp.asarray(sw, jnp.float32))


def stationary(proc: ArrivalProcess) -> jax.Array:
    """Stationary phase probabilities of the MMPP's modulating chain, `(K,)`."""
    k = proc.rates.shape[-1]
    if k == 1:
        return jnp.ones((1,), jnp.float32)
    q = proc.switch * (1.0 - jnp.eye(k))
    gen = q - jnp.diag(q.sum(-1))
    # pi solves pi @ gen = 0 with sum(pi) = 1: replace one equation by the normalisation.
    a = gen.T.at[-1].set(1.0)
    b = jnp.zeros(k).at[-1].set(1.0)
    return jnp.clip(solve_small(a, b), 0.0, 1.0)


def solve_small(a: jax.Array, b: jax.Array) -> jax.Array:
    """`x` with `a @ x = b` for a small square `a` `(K, K)`: Gaussian elimination with
    partial pivoting, unrolled over the static `K`.

    Not `jnp.linalg.solve`: under `vmap` on CPU that lowers to jaxlib's batched LAPACK kernel,
    which in jaxlib 0.10 fans the batch out on XLA's intra-op thread pool and blocks a pool
    thread until it is done; when as many such calls run at once as the pool has threads (2 on a
    2-core machine), every thread waits on work queued behind it and the program never ends.
    Plain array operations cannot deadlock, and for the K <= 4 phases of an MMPP they are as
    cheap. `a` must be non-singular (a generator with its last equation replaced by the
    normalisation is, for an irreducible chain).
    """
    k = a.shape[-1]
    m = jnp.concatenate([a, b[:, None]], axis=1).astype(jnp.float32)
    rows = jnp.arange(k)
    for j in range(k):
        # Partial pivoting: the largest remaining entry of column j moves to row j.
        p = j + jnp.argmax(jnp.abs(m[j:, j]))
        rj, rp = m[j], m[p]
        m = m.at[p].set(rj).at[j].set(rp)
        m = m.at[j].set(m[j] / m[j, j])
        factor = jnp.where(rows == j, 0.0, m[:, j])
        m = m - factor[:, None] * m[j][None, :]
    return m[:, k]


def mean_rate(proc: ArrivalProcess) -> jax.Array:
    """Long-run mean arrival rate (req/s): phase rates weighted by the stationary law."""
    return (stationary(proc) * proc.rates).sum(-1)


def validate_arrivals(proc: ArrivalProcess, where: str = "arrivals") -> None:
    """Raises ValueError naming the field for NaN/inf/negative rates or a bad shape, or a
    phase whose events (arrival rate + switching rates out) come less often than
    `MIN_EVENT_RATE` (its gaps would not be finite in float32). The upper bound on rates
    depends on how long an environment's event loop runs between rebases, and is checked there
    (`envs.common.check_arrival_horizon`)."""
    rates = numeric_array(proc.rates, f"{where}.rates").astype(np.float64)
    sw = numeric_array(proc.switch, f"{where}.switch").astype(np.float64)
    if rates.ndim != 1 or rates.shape[0] < 1:
        raise ValueError(f"{where}.rates must be a 1-D array of phase rates, got {rates.shape}")
    if sw.shape != (rates.shape[0], rates.shape[0]):
        raise ValueError(f"{where}.switch must have shape {(rates.shape[0],) * 2}, got {sw.shape}")
    for name, v in (("rates", rates), ("switch", sw)):
        if not np.all(np.isfinite(v)):
            raise ValueError(f"{where}.{name} must be finite, got {v}")
        if np.any(v < 0):
            raise ValueError(f"{where}.{name} must be >= 0, got {v}")
    if not np.any(rates > 0):
        raise ValueError(f"{where}.rates must have a positive phase rate, got {rates}")
    if rates.shape[0] > 1:
        off = sw * (1 - np.eye(rates.shape[0]))
        if np.any((off.sum(-1) == 0) & (rates == 0)):
            raise ValueError(f"{where}: a phase with rate 0 and no way out never yields arrivals")
        events = rates + off.sum(-1)
    else:
        events = rates
    if np.any(events < MIN_EVENT_RATE):
        raise ValueError(f"{where}.rates must be >= {MIN_EVENT_RATE:g} events/s in every phase "
                         f"(rate plus switching rates out; slower gaps overflow float32), got "
                         f"{rates}")
    if np.any(sw > 1.0 / MIN_EVENT_RATE):
        raise ValueError(f"{where}.switch must be <= {1.0 / MIN_EVENT_RATE:g} per second, got {sw}")


def sample_gap(key: jax.Array, phase: jax.Array, proc: ArrivalProcess):
    """Time to the next arrival (s) and the phase it happens in.

    Competing exponentials: in phase `j` the next event is an arrival with rate `rates[j]` or a
    switch with rate `sum_k switch[j, k]`; switches are followed until an arrival occurs, so the
    result is exact for the MMPP. One iteration for Poisson.

    Args:
      key: PRNG key.
      phase: current phase, int32 scalar.
      proc: MMPP parameters.

    Returns:
      (gap seconds float32, new phase int32).
    """
    k = proc.rates.shape[-1]
    off = proc.switch * (1.0 - jnp.eye(k, dtype=jnp.float32))
    out = off.sum(-1)

    def cond(c):
        return ~c[3]

    def body(c):
        key, t, ph, _ = c
        key, k_t, k_what, k_to = jax.random.split(key, 4)
        total = proc.rates[ph] + out[ph]
        t = t + jax.random.exponential(k_t, dtype=jnp.float32) / total
        is_arrival = jax.random.uniform(k_what) * total < proc.rates[ph]
        nxt = jax.random.categorical(k_to, jnp.log(jnp.maximum(off[ph], 1e-30)))
        nxt = jnp.where(out[ph] > 0, nxt, ph).astype(jnp.int32)
        return key, t, jnp.where(is_arrival, ph, nxt), is_arrival

    if k == 1:  # Poisson: no phase logic needed.
        gap = jax.random.exponential(key, dtype=jnp.float32) / proc.rates[0]
        return gap, phase
    _, t, ph, _ = jax.lax.while_loop(
        cond, body, (key, jnp.float32(0.0), phase.astype(jnp.int32), jnp.bool_(False)))
    return t, ph


def sample_phase(key: jax.Array, proc: ArrivalProcess) -> jax.Array:
    """A phase drawn from the MMPP's stationary law (int32)."""
    if proc.rates.shape[-1] == 1:
        return jnp.int32(0)
    logits = jnp.log(jnp.maximum(stationary(proc), 1e-12))
    return jax.random.categorical(key, logits).astype(jnp.int32)


@struct.dataclass
class TokenDist:
    """Distribution of (prompt, output) token lengths.

    Attributes:
      weights: class probabilities (need not be normalised). `(C,)`, or `(P, C)`: one row per
        phase of the arrival process, so the class mix depends on the phase a request arrives
        in (`with_phase_weights`; samplers then need that phase).
      prompt_median, prompt_sigma: lognormal prompt length per class (tokens, log-space sd).
      output_median, output_sigma: lognormal output length per class.
      max_prompt, max_output: lengths are rounded and clipped to `[1, max]` (tokens).
      table_prompt, table_output: empirical `(M,)` rows; when `M > 0` rows are drawn uniformly
        from the table instead of from the classes.
    """

    weights: jax.Array
    prompt_median: jax.Array
    prompt_sigma: jax.Array
    output_median: jax.Array
    output_sigma: jax.Array
    max_prompt: jax.Array
    max_output: jax.Array
    table_prompt: jax.Array
    table_output: jax.Array


def _f32(x):
    return jnp.asarray(x, jnp.float32)


def class_mixture(weights, prompt_median, prompt_sigma, output_median, output_sigma,
                  max_prompt=32768, max_output=32768) -> TokenDist:
    """A mixture of lognormal request classes (one entry per class in each argument)."""
    w = np.atleast_1d(np.asarray(weights, np.float64))
    args = [np.broadcast_to(np.asarray(a, np.float64), w.shape)
            for a in (prompt_median, prompt_sigma, output_median, output_sigma)]
    return TokenDist(_f32(w), *map(_f32, args), _f32(max_prompt), _f32(max_output),
                     jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.float32))


def fixed_tokens(prompt: int, output: int) -> TokenDist:
    """Every request has exactly `prompt` and `output` tokens."""
    return class_mixture([1.0], [prompt], [0.0], [output], [0.0])


def lognormal_tokens(prompt_median, prompt_sigma, output_median, output_sigma,
                     max_prompt=32768, max_output=32768) -> TokenDist:
    """Independent lognormal prompt and output lengths (tokens)."""
    return class_mixture([1.0], [prompt_median], [prompt_sigma], [output_median],
                         [output_sigma], max_prompt, max_output)


def bimodal_tokens(long_frac=0.2, short=(256, 32), long=(1024, 512), sigma=0.3,
                   max_prompt=32768, max_output=32768) -> TokenDist:
    """Short/long mixture: a fraction `long_frac` of requests is long.

    `short` and `long` are (prompt median, output median) in tokens; `sigma` the lognormal
    spread of both classes.
    """
    return class_mixture([1 - long_frac, long_frac], [short[0], long[0]], [sigma, sigma],
                         [short[1], long[1]], [sigma, sigma], max_prompt, max_output)


def with_phase_weights(dist: TokenDist, phase_weights) -> TokenDist:
    """`dist` with a class mix per arrival phase: `phase_weights[p]` (`(P, C)`, rows need not
    be normalised) are the class probabilities of a request arriving in phase `p` of the
    arrival process (`ArrivalProcess` with `P` phases; checked by `validate_tokens` and the
    environments' parameter validation). The classes' lengths are `dist`'s."""
    w = np.asarray(phase_weights, np.float64)
    c = np.asarray(dist.prompt_median).shape[-1]
    if w.ndim != 2 or w.shape[1] != c or dist.table_prompt.shape[-1] > 0:
        raise ValueError(f"phase_weights must have shape (phases, {c}) (one row per arrival "
                         f"phase, one column per class of a class mixture), got {w.shape}")
    return dist.replace(weights=_f32(w))


def arrival_phase_probs(proc: ArrivalProcess) -> jax.Array:
    """Probability that a request arrives in each phase, `(K,)`: `pi_k rates_k / sum`, the
    stationary phase law weighted by the phase's arrival rate."""
    w = stationary(proc) * proc.rates
    return w / w.sum(-1, keepdims=True)


def mixture_weights(dist: TokenDist, phase_probs=None):
    """The class probabilities of the whole mix, `(C,)`, normalised: `weights` itself, or for
    per-phase weights the rows (each normalised) averaged with `phase_probs` (`(P,)`, e.g.
    `arrival_phase_probs`; required then)."""
    w = dist.weights
    if w.ndim == 1:
        return w / w.sum()
    if phase_probs is None:
        raise ValueError("tokens.weights has one row per arrival phase: the mix needs the "
                         "phase probabilities (arrival_phase_probs of the arrival process)")
    rows = w / w.sum(-1, keepdims=True)
    return (jnp.asarray(phase_probs)[..., :, None] * rows).sum(-2)


def empirical_tokens(prompt_tokens, output_tokens) -> TokenDist:
    """Rows `(prompt_tokens[i], output_tokens[i])` drawn uniformly (e.g. from a real trace)."""
    p = np.asarray(prompt_tokens, np.float64)
    o = np.asarray(output_tokens, np.float64)
    if p.ndim != 1 or p.shape != o.shape or p.shape[0] == 0:
        raise ValueError("empirical_tokens needs two 1-D arrays of equal, non-zero length")
    if np.any(p < 1) or np.any(o < 1) or not np.all(np.isfinite(p + o)):
        raise ValueError("empirical_tokens: token counts must be finite and >= 1")
    return TokenDist(_f32([1.0]), _f32([p.mean()]), _f32([0.0]), _f32([o.mean()]), _f32([0.0]),
                     _f32(p.max()), _f32(o.max()), _f32(p), _f32(o))


def validate_tokens(dist: TokenDist, where: str = "tokens") -> None:
    """Raises ValueError naming the field for invalid token-length parameters.

    `max_prompt`, `max_output` (the clip of every drawn length) and their sum are at most
    `types.MAX_TOKENS`, as are the empirical table's rows.
    """
    for f in ("weights", "prompt_median", "prompt_sigma", "output_median", "output_sigma",
              "max_prompt", "max_output", "table_prompt", "table_output"):
        v = numeric_array(getattr(dist, f), f"{where}.{f}").astype(np.float64)
        if not np.all(np.isfinite(v)) or np.any(v < 0):
            raise ValueError(f"{where}.{f} must be finite and >= 0, got {v}")
        if f not in ("weights", "prompt_sigma", "output_sigma") and np.any(v > MAX_TOKENS):
            raise ValueError(f"{where}.{f} must be <= {MAX_TOKENS} tokens, got {v}")
    if np.any(np.asarray(dist.max_prompt, np.float64) + np.asarray(dist.max_output, np.float64)
              > MAX_TOKENS):
        raise ValueError(f"{where}.max_prompt + {where}.max_output must be <= {MAX_TOKENS} "
                         f"tokens (a request's prompt + output), got {np.asarray(dist.max_prompt)}"
                         f" + {np.asarray(dist.max_output)}")
    w = np.asarray(dist.weights, np.float64)
    c = np.asarray(dist.prompt_median).shape[-1]
    if w.ndim not in (1, 2) or w.shape[-1] != c:
        raise ValueError(f"{where}.weights must have shape ({c},) or (phases, {c}) (one column "
                         f"per class), got {w.shape}")
    if w.ndim == 2 and np.asarray(dist.table_prompt).shape[-1] > 0:
        raise ValueError(f"{where}.weights: per-phase weights need a class mixture, not an "
                         f"empirical table")
    if not np.all(w.sum(-1) > 0):
        raise ValueError(f"{where}.weights must have a positive entry (in every phase's row)")
    for f in ("prompt_median", "output_median", "max_prompt", "max_output"):
        if np.any(np.asarray(getattr(dist, f)) < 1):
            raise ValueError(f"{where}.{f} must be >= 1 token")


def uniforms(key: jax.Array, n: int) -> jax.Array:
    """`n` uniforms in (0, 1) from one PRNG call (float32).

    The engine draws all of a request's randomness this way: one counter-based PRNG call
    instead of a split and a call per quantity, which dominates step cost on CPUs. Equal to
    `jax.random.uniform(key, (n,), float32, minval=tiny, maxval=1.0)` bit for bit
    (`core.rng`: the same hash, unrolled, so it costs one fused kernel on CPU).
    """
    return rng.uniforms(key, n)


def tokens_from_uniforms(u: jax.Array, dist: TokenDist, phase=None):
    """(prompt, output) token lengths from three uniforms `u` (class or row, two normals).

    Float32 integers in `[1, max]`; the law of `sample_tokens`. `phase` (int32, the arrival
    phase of the request) selects the class mix when `dist.weights` has one row per phase,
    and is then required (a ValueError at trace time otherwise); it is ignored otherwise.
    """
    if dist.table_prompt.shape[-1] > 0:
        m = dist.table_prompt.shape[-1]
        i = jnp.minimum((u[0] * m).astype(jnp.int32), m - 1)
        return dist.table_prompt[i], dist.table_output[i]
    w = dist.weights
    if w.ndim == 2:
        if phase is None:
            raise ValueError("tokens.weights has one row per arrival phase: sampling needs the "
                             "request's arrival phase")
        w = w[jnp.clip(phase, 0, w.shape[0] - 1)]
    cdf = jnp.cumsum(w)
    # The default "scan" method: "compare_all" measured ~20% slower per Routing-v0 step at
    # 256 envs on CPU (same-process A/B, docs/benchmarks.md), though it runs fewer thunks.
    c = jnp.minimum(jnp.searchsorted(cdf, u[0] * cdf[-1], side="right"),
                    w.shape[-1] - 1)
    zp, zo = jax.scipy.special.ndtri(u[1]), jax.scipy.special.ndtri(u[2])
    p = jnp.round(dist.prompt_median[c] * jnp.exp(dist.prompt_sigma[c] * zp))
    o = jnp.round(dist.output_median[c] * jnp.exp(dist.output_sigma[c] * zo))
    return jnp.clip(p, 1.0, dist.max_prompt), jnp.clip(o, 1.0, dist.max_output)


def sample_tokens(key: jax.Array, dist: TokenDist, phase=None):
    """One request's (prompt, output) token lengths, float32 integers in `[1, max]` (`phase`:
    see `tokens_from_uniforms`)."""
    return tokens_from_uniforms(uniforms(key, 3), dist, phase)


def size_class(output, size_edges):
    """Size class of an output length: the number of `size_edges` (tokens) it exceeds (int32)."""
    return jnp.sum(output[..., None] > size_edges, axis=-1).astype(jnp.int32)


def estimate_from_uniform(u, output, mode, noise_sigma, size_edges, size_values):
    """The output estimate and size class from one uniform `u`; see `output_estimate`."""
    true_cls = size_class(output, size_edges)
    z = jax.scipy.special.ndtri(u)
    noisy = jnp.round(output * jnp.exp(noise_sigma * z))
    est = jnp.select([mode == ESTIMATE_EXACT, mode == ESTIMATE_NOISY],
                     [output, noisy], size_values[true_cls])
    est = jnp.maximum(est, 1.0).astype(jnp.float32)
    # The class a scheduler sees is its estimate's class: with noisy estimates the true class
    # must not leak through it.
    cls = jnp.where(mode == ESTIMATE_CLASS, true_cls, size_class(est, size_edges))
    return est, cls


def output_estimate(key: jax.Array, output, mode, noise_sigma, size_edges, size_values):
    """The output-length estimate (tokens) a scheduler sees, and the size class.

    Args:
      key: PRNG key (used by the noisy mode).
      output: true output length (tokens).
      mode: `ESTIMATE_EXACT` (true length), `ESTIMATE_NOISY` (true length times
        `exp(noise_sigma * z)`) or `ESTIMATE_CLASS` (the class's representative length
        `size_values[class]`). An int32 leaf, so it can be swept under vmap.
      size_edges: `(E,)` increasing class boundaries in tokens.
      size_values: `(E + 1,)` representative length of each class (tokens).

    Returns:
      (estimate float32 >= 1, class int32: the class of the estimate, which in size-class
      mode is the true class).
    """
    return estimate_from_uniform(uniforms(key, 1)[0], output, mode, noise_sigma, size_edges,
                                 size_values)
