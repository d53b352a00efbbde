"""Routing heuristics for Routing-v0: which GPU gets the arriving request.

Every policy has the shared signature `policy(key, obs, state, params) -> int32 GPU index`
and reads only what a real router knows: the pending request's prompt length, its output
*estimate* (`state.pending.estimate`) and its id, the queues (counts and the waiting requests'
prompts and estimates) and the running batches (`run_count`, and their *expected* end
`est_end`, computed from estimates). The true output lengths (`pending.output`,
`queues.output`) and the running batch's true end (`free_at`, which needs them) are never
read. Audit: `jsq`, `power_of_two`, `join_idle_queue` read counts; `least_work_left`, `sed`
and `sita` read `cluster.queued_work` (`est_end` plus the queues' estimate-based work) and
`single_request_time(prompt, estimate)`; `round_robin`, `weighted_round_robin` read
`req_id` (and profile speeds from workload means); `random` nothing. SITA's *fit* (offline,
`fit_sita`) uses true lengths of a workload sample, as a fit to historical logs would, drawn
with a tuning key (never the evaluation streams).

The oracles `sed_oracle` and `least_work_left_oracle` are the same rules given the true
output lengths (the pending request's `output`, the running batch's true end `free_at`, the
queues' true work): upper references for what perfect size knowledge is worth, never
baselines a real scheduler could run.

Where a policy compares GPUs by expected time (least work left, SED, SITA's groups), a GPU
whose queue is full (`count >= queue_cap`: the request would be dropped) is skipped unless
every queue is full. Ties go to the lowest GPU index.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core import arrivals as A
from jaxserve.core import cluster as C
from jaxserve.core import queues as Q
from jaxserve.core.service import full_batch_rate, per_request_work, single_request_time
from jaxserve.core.sources import mark_tuning_key, sample_tokens_n, tuning_key
from jaxserve.core.static_load import mean_estimate_held
from jaxserve.policies.generic import in_system, power_of_two, random_policy, round_robin
from jaxserve.policies.registry import Policy, register, register_function

_GOLDEN = np.uint32(2654435769)  # floor(2**32 / golden ratio): Fibonacci hashing


def _full(state, params) -> jax.Array:
    return state.cluster.queues.count >= params.gpus.queue_cap


def _argmin_open(cost, state, params) -> jax.Array:
    """argmin of `cost` over GPUs whose queue is not full (all GPUs if every queue is full)."""
    full = _full(state, params)
    cost = jnp.where(full & ~full.all(), jnp.inf, cost)
    return jnp.argmin(cost).astype(jnp.int32)


def workload_means(params):
    """Mean prompt and output tokens of the workload (`params.tokens`), as float32 scalars.

    Lognormal class means `median * exp(sigma^2 / 2)` weighted by class probability (with a
    class mix per arrival phase, the mix of all arrivals, `arrivals.mixture_weights`; the clip
    to `max_*` is ignored), or the table means for an empirical distribution.
    """
    t = params.tokens
    if t.table_prompt.shape[-1] > 0:
        return t.table_prompt.mean(), t.table_output.mean()
    w = A.mixture_weights(t, A.arrival_phase_probs(params.arrivals))
    p = (w * t.prompt_median * jnp.exp(0.5 * t.prompt_sigma ** 2)).sum()
    o = (w * t.output_median * jnp.exp(0.5 * t.output_sigma ** 2)).sum()
    return p.astype(jnp.float32), o.astype(jnp.float32)


def gpu_speeds(params) -> jax.Array:
    """Relative throughput of each GPU on the mean request, `(num_gpus,)`, summing to 1.

    Proportional to `1 / per_request_work(gpu, mean prompt, mean output)`: requests per second
    the GPU serves in full batches.
    """
    p, o = workload_means(params)
    speed = 1.0 / per_request_work(params.gpus, p, o)
    return speed / speed.sum()


# ----------------------------------------------------------------------------- policies

def weighted_round_robin(key, obs, state, params):
    """Deterministic by `req_id`: GPU shares proportional to `gpu_speeds(params)`.

    Request `i` takes the point `u_i = frac(i * 0.618...)` of the golden-ratio (Weyl) sequence,
    computed exactly in uint32 arithmetic, and goes to the GPU whose slice of the cumulative
    share `[0, 1)` contains it. Any window of `n` consecutive requests gives GPU `g`
    `n * share_g + O(log n)` requests, interleaved rather than in runs.
    """
    i = state.pending.req_id.astype(jnp.uint32)
    u = ((i * _GOLDEN) >> 8).astype(jnp.float32) * jnp.float32(2.0 ** -24)
    edges = jnp.cumsum(gpu_speeds(params))
    g = jnp.searchsorted(edges, u, side="right")
    return jnp.minimum(g, state.cluster.num_gpus - 1).astype(jnp.int32)


def jsq(key, obs, state, params):
    """Join the shortest queue: fewest requests waiting plus running; ties to the lowest index."""
    return jnp.argmin(in_system(state)).astype(jnp.int32)


def least_work_left(key, obs, state, params):
    """Smallest expected time to finish what the GPU holds (`cluster.queued_work`, estimates)."""
    return _argmin_open(C.queued_work(state.cluster, params.gpus), state, params)


def sed(key, obs, state, params):
    """Shortest expected delay, for heterogeneous GPUs.

    If some GPUs are idle (nothing waiting or running), the fastest of them for this request
    (smallest `single_request_time(gpu, prompt, estimate)`; ties to the lowest index). Otherwise
    the GPU minimising `queued_work + single_request_time(gpu, prompt, estimate)`: the expected
    time until this request would be finished there, each GPU at its own speed.
    """
    own = single_request_time(params.gpus, state.pending.prompt, state.pending.estimate)
    idle = in_system(state) == 0
    fastest_idle = jnp.argmin(jnp.where(idle, own, jnp.inf)).astype(jnp.int32)
    busy_best = _argmin_open(C.queued_work(state.cluster, params.gpus) + own, state, params)
    return jnp.where(idle.any(), fastest_idle, busy_best)


def _oracle_queued_work(state, params) -> jax.Array:
    """ORACLE: `queued_work` with true output lengths: the running batch's true end and the
    waiting requests' shares from their true outputs. `(num_gpus,)`."""
    cl, gpus = state.cluster, params.gpus
    q, s = cl.queues, cl.servers
    remaining = jnp.where(s.run_count > 0, jnp.maximum(s.free_at, 0.0), 0.0)
    mask = Q.waiting_mask(q)
    shares = per_request_work(jax.tree.map(lambda x: x[:, None], gpus), q.prompt, q.output)
    return remaining + jnp.where(mask, shares, 0.0).sum(-1)


def least_work_left_oracle(key, obs, state, params):
    """ORACLE (true output lengths): `least_work_left` on the true remaining work."""
    return _argmin_open(_oracle_queued_work(state, params), state, params)


def sed_oracle(key, obs, state, params):
    """ORACLE (true output lengths): `sed` with the pending request's true output and the
    GPUs' true remaining work."""
    own = single_request_time(params.gpus, state.pending.prompt, state.pending.output)
    idle = in_system(state) == 0
    fastest_idle = jnp.argmin(jnp.where(idle, own, jnp.inf)).astype(jnp.int32)
    busy_best = _argmin_open(_oracle_queued_work(state, params) + own, state, params)
    return jnp.where(idle.any(), fastest_idle, busy_best)


def make_join_idle_queue(fallback: str = "random"):
    """Join-idle-queue: a uniformly random idle GPU if any; else `fallback`.

    `fallback="random"` is the classic JIQ (Lu et al., 2011: with no idle server the dispatcher
    picks one at random); `"jsq"` falls back to join-the-shortest-queue.
    """
    if fallback not in ("random", "jsq"):
        raise ValueError(f"join_idle_queue fallback must be 'random' or 'jsq', got {fallback!r}")

    def join_idle_queue(key, obs, state, params):
        k_idle, k_fb = jax.random.split(key)
        idle = in_system(state) == 0
        pick_idle = jax.random.categorical(k_idle, jnp.where(idle, 0.0, -jnp.inf))
        fb = (random_policy(k_fb, obs, state, params) if fallback == "random"
              else jsq(k_fb, obs, state, params))
        return jnp.where(idle.any(), pick_idle, fb).astype(jnp.int32)

    return join_idle_queue


# ----------------------------------------------------------------------------- SITA

class SitaFit(NamedTuple):
    """A fitted size-interval assignment.

    Attributes:
      thresholds: `(K - 1,)` increasing output-estimate boundaries (tokens); interval `k` holds
        estimates with `sum(estimate > thresholds) == k`.
      mask: `(K, num_gpus)` bool, the GPU group serving each interval (a partition of the GPUs).
      utilisation: `(num_gpus,)` predicted utilisation at the workload's mean rate.
      max_rho_per_rate: the largest group utilisation per unit arrival rate (1/(req/s)).
      predictor: None (the thresholds apply to the output estimate) or `(3,)` coefficients of
        `fit_size_predictor` (they apply to `predict_size(predictor, prompt, estimate)`).
    """

    thresholds: np.ndarray
    mask: np.ndarray
    utilisation: np.ndarray
    max_rho_per_rate: float
    predictor: np.ndarray | None = None


def sample_workload(params, key=None, num_samples: int = 4096, prompt=None, output=None):
    """A workload sample: prompts, true outputs and the output *estimates* a router would see.

    Draws `num_samples` requests from `params.tokens`, or takes given `prompt`/`output` arrays
    (e.g. a historical trace: never the window it will be scored on, see
    `core.sources.split_trace`); estimates follow `params.estimate_mode`. The key
    (default `tuning_key()`) is recorded as a tuning key, which evaluation refuses.

    Returns:
      (prompt, output, estimate) float64 numpy arrays.
    """
    key = tuning_key() if key is None else mark_tuning_key(key)
    if prompt is None:
        k_tok, key = jax.random.split(key)
        prompt, output = sample_tokens_n(k_tok, params.tokens, int(num_samples),
                                         params.arrivals)
    prompt = jnp.asarray(prompt, jnp.float32)
    output = jnp.asarray(output, jnp.float32)
    if prompt.ndim != 1 or prompt.shape != output.shape or prompt.shape[0] == 0:
        raise ValueError("the workload sample needs 1-D prompt and output arrays of equal length")
    est = _estimates(key, output, params)
    return (np.asarray(prompt, np.float64), np.asarray(output, np.float64),
            np.asarray(est, np.float64))


@jax.jit
def _estimates(key, output, params):
    est, _ = jax.vmap(lambda k, o: A.output_estimate(
        k, o, params.estimate_mode, params.estimate_noise, params.size_edges,
        params.size_values))(jax.random.split(key, output.shape[0]), output)
    return est


def fit_sita(params, key=None, num_samples: int = 4096, prompt=None, output=None,
             max_intervals: int = 32, batches_per_interval: int = 64,
             predictor: str | None = None, order: str | None = None) -> SitaFit:
    """Fits SITA thresholds and GPU groups to a workload so that load is balanced.

    Method (host-side, on a workload sample):
      1. Sample the workload (`sample_workload`): prompt, true output and output *estimate*.
      2. Atoms: the distinct estimate values (a size-class estimate has one per class), or, with
         more than `max_intervals` distinct values, `max_intervals` quantile bins. Thresholds
         can only fall between atoms: the router sees the estimate, nothing finer.
      3. Service rate of GPU `g` for an interval `I` of atoms: `mu_g(I) = B_g / E[T_g(S)]`,
         `S` a full batch of `B_g` requests drawn from the sample's requests in `I` (Monte
         Carlo, `batches_per_interval` batches, true outputs: the batch runs for its longest).
         Interval `I` served by group `G`, arrivals split across `G` in proportion to
         `mu_g(I)`, has utilisation `rho = lambda * q_I / sum_{g in G} mu_g(I)`, `q_I` the
         fraction of requests in `I`.
      4. SITA separates sizes: `K = min(atoms, GPUs)` intervals, each with its own group (with
         few atoms and many GPUs every atom gets a group of GPUs; with many atoms each GPU gets
         an interval). Intervals (contiguous in estimate) map monotonically to groups
         (contiguous in a GPU order by speed, slow-first or fast-first: both are tried). A
         dynamic program over (atoms used, GPUs used) finds the partition minimising the
         largest `rho` (load balance); a second one, among partitions within 1e-6 of that
         optimum, minimises the mean full-batch service time
         `sum_I q_I |G_I| / sum_{g in G_I} mu_g(I)`.
    At run time the policy sends a request to its interval's group and, within the group, to
    the GPU with the least work left.

    `predictor` chooses the size SITA splits on (steps 2-4 read it in place of the estimate):
    None, the output estimate; `"prompt"` or `"predicted"`, the output length predicted from
    the prompt alone or from prompt and estimate (`fit_size_predictor`, least squares on the
    same tuning sample). The thresholds are then predicted output lengths (tokens).

    `order` fixes the orientation of step 4: `"slow_first"` (the smallest sizes on the slowest
    GPUs) or `"fast_first"`; None (default) tries both and keeps the better by the objectives
    above. They are load-balance objectives, blind to queueing delay, so which orientation
    gives the lower latency is for a simulation to say (`tuning.tune_sita_overflow`).

    Returns:
      `SitaFit`.
    """
    if predictor is not None and predictor not in SIZE_PREDICTORS:
        raise ValueError(f"fit_sita: predictor must be None or one of {SIZE_PREDICTORS}, got "
                         f"{predictor!r}")
    if order not in (None, "slow_first", "fast_first"):
        raise ValueError(f"fit_sita: order must be None, 'slow_first' or 'fast_first', got "
                         f"{order!r}")
    prompt, output, est = sample_workload(params, key, num_samples, prompt, output)
    coef = None
    if predictor is not None:
        coef = fit_size_predictor(prompt, output, est, use_estimate=predictor == "predicted",
                                  where=f"fit_sita(predictor={predictor!r})")
        est = np.asarray(predict_size(coef, prompt, est), np.float64)
    bs = np.maximum(np.asarray(params.gpus.max_batch).astype(int), 1)
    num_gpus = bs.shape[0]
    uniq = np.unique(est)
    if uniq.shape[0] <= max_intervals:
        labels = np.searchsorted(uniq, est)
        cuts = (uniq[:-1] + uniq[1:]) / 2.0
    else:
        edges = np.unique(np.quantile(est, np.linspace(0, 1, max_intervals + 1)[1:-1]))
        labels = np.sum(est[:, None] > edges[None, :], axis=1)
        keep = np.unique(labels)  # drop empty bins
        labels = np.searchsorted(keep, labels)
        cuts = edges[keep[:-1]]
    m = int(labels.max()) + 1
    total = float(labels.shape[0])
    rng = np.random.default_rng(0)
    mu = np.full((m + 1, m + 1, num_gpus), np.nan)  # mu[a0, a1, g] for atoms [a0, a1)
    qfrac = np.zeros((m + 1, m + 1))
    for a0 in range(m):
        for a1 in range(a0 + 1, m + 1):
            idx = np.flatnonzero((labels >= a0) & (labels < a1))
            qfrac[a0, a1] = idx.shape[0] / total
            draw = rng.choice(idx, (batches_per_interval, int(bs.max())))
            mu[a0, a1] = full_batch_rate(params.gpus, prompt[draw], output[draw])
    speed = np.nanmean(mu[0, m][None], axis=0)
    k_blocks = min(m, num_gpus)

    best = None
    orders = {"slow_first": np.argsort(speed, kind="stable"),
              "fast_first": np.argsort(-speed, kind="stable")}
    for gpu_order in [v for o, v in orders.items() if order in (None, o)]:
        rho = np.full((m + 1, m + 1, num_gpus + 1, num_gpus + 1), np.inf)
        svc = np.full_like(rho, np.inf)
        for a0 in range(m):
            for a1 in range(a0 + 1, m + 1):
                if k_blocks == m and a1 != a0 + 1:
                    continue  # one atom per interval
                c_mu = np.concatenate([[0.0], np.cumsum(mu[a0, a1, gpu_order])])
                for b0 in range(num_gpus):
                    b1 = np.arange(b0 + 1, num_gpus + 1)
                    if k_blocks == num_gpus:
                        b1 = b1[:1]  # one GPU per group
                    cap = c_mu[b1] - c_mu[b0]
                    rho[a0, a1, b0, b1] = qfrac[a0, a1] / cap
                    svc[a0, a1, b0, b1] = qfrac[a0, a1] * (b1 - b0) / cap
        r_star, _ = _partition_dp(rho, m, num_gpus, objective="max")
        s_star, path = _partition_dp(np.where(rho <= r_star * (1.0 + 1e-6), svc, np.inf), m,
                                     num_gpus, objective="sum")
        if best is None or (r_star < best[0] * (1 - 1e-6)
                            or (r_star <= best[0] * (1 + 1e-6) and s_star < best[1])):
            best = (r_star, s_star, gpu_order, path)
    r_star, _, gpu_order, path = best
    lam = float(np.asarray(A.mean_rate(params.arrivals)))
    mask = np.zeros((len(path), num_gpus), bool)
    util = np.zeros(num_gpus)
    thresholds = []
    for k, (a0, a1, b0, b1) in enumerate(path):
        gpus = gpu_order[b0:b1]
        mask[k, gpus] = True
        util[gpus] = lam * qfrac[a0, a1] / mu[a0, a1, gpus].sum()
        if a1 < m:
            thresholds.append(cuts[a1 - 1])
    return SitaFit(thresholds=np.asarray(thresholds, np.float64), mask=mask, utilisation=util,
                   max_rho_per_rate=float(r_star), predictor=coef)


SIZE_PREDICTORS = ("prompt", "predicted")


def fit_size_predictor(prompt, output, estimate, use_estimate: bool = True,
                       where: str = "fit_size_predictor") -> np.ndarray:
    """Least-squares predictor of log output length from what a router sees, `(3,)` float64.

    Fits `log1p(output) ~ c0 + c1 * log1p(prompt) + c2 * log1p(estimate)` on a workload
    sample (`sample_workload`, tuning streams); `use_estimate=False` fixes `c2 = 0` (prompt
    only). The fitted coefficients are what `predict_size` applies at run time.

    Raises:
      ValueError: the sample has fewer than 3 rows (the message starts with `where`).
    """
    p, o, e = (np.log1p(np.asarray(x, np.float64)) for x in (prompt, output, estimate))
    if p.shape[0] < 3:
        raise ValueError(f"{where}: the workload sample needs at least 3 requests")
    cols = [np.ones_like(p), p] + ([e] if use_estimate else [])
    coef, *_ = np.linalg.lstsq(np.stack(cols, axis=1), o, rcond=None)
    return np.concatenate([coef, np.zeros(3 - coef.shape[0])])


def predict_size(coef, prompt, estimate):
    """Predicted output length (tokens, >= 1) from `fit_size_predictor`'s coefficients:
    `expm1(c0 + c1 * log1p(prompt) + c2 * log1p(estimate))`. Works on numpy or jax arrays."""
    xp = jnp if isinstance(prompt, jax.Array) or isinstance(estimate, jax.Array) else np
    c = xp.asarray(coef, xp.float32) if xp is jnp else np.asarray(coef, np.float64)
    z = c[0] + c[1] * xp.log1p(prompt) + c[2] * xp.log1p(estimate)
    # Clipped so a wild estimate cannot overflow float32 (e^80 ~ 5e34).
    return xp.maximum(xp.expm1(xp.clip(z, -80.0, 80.0)), 1.0)


def _partition_dp(cost, m, n, objective):
    """Best monotone partition of atoms [0, m) and GPUs [0, n) into matched blocks.

    `cost[a0, a1, b0, b1]` is the cost of block (atoms [a0, a1), GPUs [b0, b1)); the total is
    the max (objective "max") or the sum ("sum") over blocks. Returns (value, blocks).
    """
    combine = max if objective == "max" else (lambda x, y: x + y)
    f = np.full((m + 1, n + 1), np.inf)
    f[0, 0] = 0.0
    back = {}
    for a in range(1, m + 1):
        for b in range(1, n + 1):
            for a0 in range(a):
                for b0 in range(b):
                    if not np.isfinite(f[a0, b0]) or not np.isfinite(cost[a0, a, b0, b]):
                        continue
                    v = combine(f[a0, b0], cost[a0, a, b0, b])
                    if v < f[a, b]:
                        f[a, b] = v
                        back[(a, b)] = (a0, b0)
    path, ab = [], (m, n)
    while ab != (0, 0):
        a0, b0 = back[ab]
        path.append((a0, ab[0], b0, ab[1]))
        ab = (a0, b0)
    return float(f[m, n]), path[::-1]


def make_sita(fit: SitaFit):
    """The SITA policy of a fit: interval by thresholds on the estimate (or, with a fitted
    `predictor`, on the output length it predicts from prompt and estimate), then least work
    left within the interval's GPU group (full queues skipped unless the whole group is full)."""
    thresholds = jnp.asarray(fit.thresholds, jnp.float32)
    mask = jnp.asarray(fit.mask, bool)
    coef = fit.predictor

    def sita(key, obs, state, params):
        size = state.pending.estimate
        if coef is not None:
            size = predict_size(coef, state.pending.prompt, size)
        k = jnp.sum(size > thresholds).astype(jnp.int32)
        allowed = mask[k]
        full = _full(state, params)
        open_ = allowed & ~full
        use = jnp.where(open_.any(), open_, allowed)
        work = C.queued_work(state.cluster, params.gpus)
        return jnp.argmin(jnp.where(use, work, jnp.inf)).astype(jnp.int32)

    return sita


def make_sita_overflow(fit: SitaFit, overflow_s):
    """SITA that spills a request out of its size interval's group when that group is congested.

    The request's SITA choice `g` (interval by thresholds, least work left in the interval's
    group) is kept unless some GPU would finish it more than `overflow_s` seconds sooner:
    with `delay = queued_work + single_request_time(gpu, prompt, estimate)` (SED's expected
    completion, estimates only), the request goes to `argmin delay` when
    `delay[g] > min(delay) + overflow_s`. `overflow_s = inf` is SITA, `0` is close to SED.
    Full queues are skipped unless every queue is full. `overflow_s` may be traced, so one
    program can evaluate a grid of thresholds (`jaxserve.evaluation.tuning.tune_sita_overflow`).
    """
    sita = make_sita(fit)

    def sita_overflow(key, obs, state, params):
        g = sita(key, obs, state, params)
        own = single_request_time(params.gpus, state.pending.prompt, state.pending.estimate)
        delay = C.queued_work(state.cluster, params.gpus) + own
        full = _full(state, params)
        best = jnp.argmin(jnp.where(full & ~full.all(), jnp.inf, delay)).astype(jnp.int32)
        spill = delay[g] > delay[best] + overflow_s
        return jnp.where(spill, best, g).astype(jnp.int32)

    return sita_overflow


def make_sita_burst(fit: SitaFit, overflow_s, burst_work_s, burst_tokens):
    """`make_sita_overflow(fit, overflow_s)` that may send a short request to a fast GPU.

    A request in SITA's shortest size interval goes to the fastest GPU with the least queued
    work (`cluster.queued_work`, s, from estimates; full queues skipped) when that GPU holds
    less than `burst_work_s` seconds of work and its requests' mean output estimate
    (`static_load.mean_estimate_held`, tokens) is below `burst_tokens`: in a burst of short
    requests the fast GPUs hold only short work, and sending more short requests there beats
    SITA's partition, which is fitted to the average mix (docs/results.md, what the learned
    router does in short_bursts). Otherwise SITA with overflow decides. `burst_work_s <= 0`
    is `make_sita_overflow` itself. All three thresholds may be traced (one program evaluates
    a grid, `evaluation.tuning.tune_sita_burst`). Reads only estimates, as `sita` does.
    """
    base = make_sita_overflow(fit, overflow_s)
    first = jnp.asarray(fit.thresholds, jnp.float32)[:1]
    coef = fit.predictor

    def sita_burst(key, obs, state, params):
        g = base(key, obs, state, params)
        size = state.pending.estimate
        if coef is not None:
            size = predict_size(coef, state.pending.prompt, size)
        short = jnp.all(size <= first)  # no threshold: a single interval, every size short
        speed = gpu_speeds(params)
        fast = (speed >= speed.max() * (1 - 1e-6)) & ~_full(state, params)
        work = C.queued_work(state.cluster, params.gpus)
        f = jnp.argmin(jnp.where(fast, work, jnp.inf)).astype(jnp.int32)
        light = ((work[f] < burst_work_s)
                 & (mean_estimate_held(state.cluster)[f] < burst_tokens))
        return jnp.where(short & fast.any() & light, f, g).astype(jnp.int32)

    return sita_burst


# ----------------------------------------------------------------------------- registry
# Kind "routing". `random`, `round_robin`, `power_of_two` and `least_marginal` are registered
# once for Routing-v0 and LLMRouting-v0 by `policies.generic`.

def _simple(name, fn, doc):
    register_function(name, "routing", fn, doc)


_simple("jsq", jsq, "Join the shortest queue (waiting + running).")
_simple("least_work_left", least_work_left, "Least expected work left (queued_work).")
_simple("sed", sed, "Shortest expected delay; fastest idle GPU first.")
_simple("sed_oracle", sed_oracle,
        "ORACLE: SED with true output lengths (a reference, not a realisable baseline).")
_simple("least_work_left_oracle", least_work_left_oracle,
        "ORACLE: least work left with true output lengths (a reference).")


@register("weighted_round_robin", "routing", scenario_free=True)
def _wrr_factory(env=None, params=None):
    """Weighted round robin by GPU speed (deterministic by req_id)."""
    return Policy(name="weighted_round_robin", kind="routing", fn=weighted_round_robin)


@register("join_idle_queue", "routing", scenario_free=True)
def _jiq_factory(env=None, params=None, fallback: str = "random"):
    """Join-idle-queue with a random (default) or JSQ fallback."""
    return Policy(name="join_idle_queue", kind="routing", fn=make_join_idle_queue(fallback),
                  info={"fallback": fallback})


@register("sita", "routing")
def _sita_factory(env=None, params=None, fit: SitaFit | None = None, key=None,
                  num_samples: int = 4096, prompt=None, output=None):
    """SITA, fitted to `params` (and optionally a workload sample) unless `fit` is given."""
    if fit is None:
        if params is None:
            raise ValueError("policy 'sita' needs params= (to fit it) or fit=")
        fit = fit_sita(params, key=key, num_samples=num_samples, prompt=prompt, output=output)
    return Policy(name="sita", kind="routing", fn=make_sita(fit), info={"fit": fit})


def _sita_predictor_factory(name: str, predictor: str):
    def factory(env=None, params=None, fit: SitaFit | None = None, key=None,
                num_samples: int = 4096, prompt=None, output=None):
        if fit is None:
            if params is None:
                raise ValueError(f"policy {name!r} needs params= (to fit it) or fit=")
            fit = fit_sita(params, key=key, num_samples=num_samples, prompt=prompt,
                           output=output, predictor=predictor)
        elif fit.predictor is None:
            raise ValueError(f"policy {name!r} needs a fit with a size predictor "
                             f"(fit_sita(..., predictor={predictor!r}))")
        return Policy(name=name, kind="routing", fn=make_sita(fit), info={"fit": fit})
    factory.__doc__ = (f"SITA splitting on the output length predicted from "
                       f"{'the prompt' if predictor == 'prompt' else 'prompt and estimate'} "
                       f"(`fit_sita(..., predictor={predictor!r})`), fitted to `params` on "
                       f"tuning streams unless `fit` is given.")
    return factory


register("sita_prompt", "routing", _sita_predictor_factory("sita_prompt", "prompt"))
register("sita_predicted", "routing", _sita_predictor_factory("sita_predicted", "predicted"))

