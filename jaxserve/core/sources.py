"""Where requests come from: trace arrays, sampled request streams, and the keys that draw them.

The evaluation discipline lives here, below every layer that draws streams: a key used to
tune or fit a policy (`tuning_key`, `mark_tuning_key`) is recorded, and evaluation refuses it
(`check_not_tuning_key`), so a tuned setting is never scored on the streams it was chosen
on; a trace is split into a fitting and a disjoint scored window with `split_trace`.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxserve.core import arrivals as A
from jaxserve.core.types import Trace, validate_trace


@struct.dataclass
class TraceArrays:
    """A trace (or a window of one) as fixed-shape device arrays.

    Attributes:
      gap: seconds from the previous request's arrival (`gap[0]` is 0). `(L,)` float32.
      prompt, output: token counts. `(L,)` float32.
      length: number of valid rows (<= L); rows past it are padding. int32.
    """

    gap: jax.Array
    prompt: jax.Array
    output: jax.Array
    length: jax.Array


def trace_arrays(trace: Trace, pad_to: int | None = None) -> TraceArrays:
    """Converts a validated host `Trace` to `TraceArrays`, padded to `pad_to` rows.

    Gaps are differences of the float64 arrivals, so rounding to float32 loses nothing that
    accumulates: every gap is exact to its own float32 precision.
    """
    tr = validate_trace(trace)
    n = len(tr)
    pad_to = n if pad_to is None else int(pad_to)
    if pad_to < n:
        raise ValueError(f"pad_to={pad_to} is shorter than the trace ({n} requests)")
    gap = np.zeros(pad_to)
    gap[1:n] = np.diff(tr.arrival_s)
    prompt = np.ones(pad_to)
    prompt[:n] = tr.prompt_tokens
    output = np.ones(pad_to)
    output[:n] = tr.output_tokens
    return TraceArrays(gap=jnp.asarray(gap, jnp.float32), prompt=jnp.asarray(prompt, jnp.float32),
                       output=jnp.asarray(output, jnp.float32), length=jnp.int32(n))


def no_trace() -> TraceArrays:
    """The empty trace of environments driven by a synthetic arrival process."""
    z = jnp.zeros((0,), jnp.float32)
    return TraceArrays(gap=z, prompt=z, output=z, length=jnp.int32(0))


def sample_stream(key, params, n: int) -> TraceArrays:
    """`n` requests drawn from `params.arrivals` and `params.tokens` (first arrival at 0).

    `params`: anything with `arrivals` (`ArrivalProcess`) and `tokens` (`TokenDist`), e.g. a
    `ServingParams`.
    """
    return sample_stream_with_phase(key, params, n)[0]


def sample_stream_with_phase(key, params, n: int) -> tuple[TraceArrays, jax.Array]:
    """`sample_stream`'s requests and the arrival phase of each, `(n,)` int32: the phase of
    the arrival process in which the request arrived (always 0 for a Poisson process). The
    same key gives the same requests as `sample_stream`."""
    k_phase, k_seq = jax.random.split(key)
    phase = A.sample_phase(k_phase, params.arrivals)

    def draw(phase, k):
        k_gap, k_tok = jax.random.split(k)
        gap, phase = A.sample_gap(k_gap, phase, params.arrivals)
        p, o = A.sample_tokens(k_tok, params.tokens, phase)
        return phase, (gap, p, o, phase)

    _, (gap, p, o, ph) = jax.lax.scan(draw, phase, jax.random.split(k_seq, n))
    return (TraceArrays(gap=gap.at[0].set(0.0), prompt=p, output=o, length=jnp.int32(n)),
            jnp.asarray(ph, jnp.int32))


@partial(jax.jit, static_argnames=("n",))
def sample_tokens_n(key, tokens: A.TokenDist, n: int, arrivals: A.ArrivalProcess | None = None):
    """`n` i.i.d. (prompt, output) token lengths from `tokens`, `(n,)` float32 each (jitted).

    With a class mix per arrival phase, each request's phase is drawn from
    `arrivals.arrival_phase_probs(arrivals)` (`arrivals` required then): the mix of all
    arrivals in the long run."""
    if tokens.weights.ndim == 1:
        return jax.vmap(lambda k: A.sample_tokens(k, tokens))(jax.random.split(key, n))
    if arrivals is None:
        raise ValueError("tokens.weights has one row per arrival phase: sampling the mix "
                         "needs the arrival process (arrivals=)")
    logits = jnp.log(jnp.maximum(A.arrival_phase_probs(arrivals), 1e-30))

    def one(k):
        k_ph, k_tok = jax.random.split(k)
        return A.sample_tokens(k_tok, tokens, jax.random.categorical(k_ph, logits))
    return jax.vmap(one)(jax.random.split(key, n))


def params_trace(params) -> Trace | None:
    """The trace held in `params` (its valid rows), or None for synthetic arrivals."""
    tr = params.trace
    if tr.gap.shape[0] == 0 or int(tr.length) == 0:
        return None
    n = int(tr.length)
    gap = np.asarray(tr.gap, np.float64)[:n]
    return Trace(arrival_s=np.cumsum(gap), prompt_tokens=np.asarray(tr.prompt)[:n],
                 output_tokens=np.asarray(tr.output)[:n])


# ----------------------------------------------------------------------------- tuning keys

TUNING_SALT = 0x54554E45  # "TUNE": tuning keys are `fold_in(key, TUNING_SALT)`
_TUNING_KEYS: set[bytes] = set()


def _key_bytes(key) -> bytes:
    k = jax.random.key_data(key) if jnp.issubdtype(jnp.asarray(key).dtype,
                                                   jax.dtypes.prng_key) else key
    return np.asarray(k, np.uint32).tobytes()


def tuning_key(key=None):
    """The key to tune or fit with when `key` (default `PRNGKey(0)`) is an evaluation key.

    `fold_in(key, TUNING_SALT)`: a different key, hence streams independent of the ones
    `evaluate(..., key)` draws. The result is recorded (`mark_tuning_key`).
    """
    key = jax.random.PRNGKey(0) if key is None else key
    return mark_tuning_key(jax.random.fold_in(key, TUNING_SALT))


def mark_tuning_key(key):
    """Records `key` as used for tuning or fitting (evaluation then refuses it); returns it."""
    _TUNING_KEYS.add(_key_bytes(key))
    return key


def is_tuning_key(key) -> bool:
    """True if `key` was used (or derived) for tuning or fitting in this process."""
    return _key_bytes(key) in _TUNING_KEYS


def check_not_tuning_key(key) -> None:
    """Raises ValueError if `key` was used for tuning: evaluation must use other streams."""
    if is_tuning_key(key):
        raise ValueError("this key was used to tune or fit a policy; evaluate on a different "
                         "key (tune with jaxserve.core.sources.tuning_key(eval_key))")


def split_trace(trace: Trace, fit_fraction: float = 0.25) -> tuple[Trace, Trace]:
    """Splits a trace into a fitting window (the first `fit_fraction` of its requests) and
    the disjoint scored window (the rest, arrivals shifted to start at 0).

    Fitted policies (SITA thresholds, `tuned_static`) are fitted on the first and scored on
    the second, never on the requests they are scored on.
    """
    tr = validate_trace(trace)
    n = len(tr)
    if not 0.0 < fit_fraction < 1.0:
        raise ValueError(f"fit_fraction must be in (0, 1), got {fit_fraction}")
    cut = int(round(n * fit_fraction))
    if cut < 2 or n - cut < 2:
        raise ValueError(f"a trace of {n} requests is too short to split into a fitting and a "
                         f"scored window of >= 2 requests each")

    def part(lo, hi):
        a = np.asarray(tr.arrival_s[lo:hi], np.float64)
        return Trace(arrival_s=a - a[0], prompt_tokens=np.asarray(tr.prompt_tokens[lo:hi]),
                     output_tokens=np.asarray(tr.output_tokens[lo:hi]))
    return part(0, cut), part(cut, n)
