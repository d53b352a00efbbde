"""The disaggregation engine (`core/disaggregation.py`, `core/disagg_replay.py`) against the
pure-Python reference `jaxserve/reference/disaggregation.py`, request by request.

One batch of random workloads (two P and two D replicas, `N` requests each) runs as one
compiled, vmapped replay; each workload is compared with the reference on its own. Kinds:

* `ties`: integer arrival times (several requests per instant), dyadic coefficients and a
  link whose transfers last a dyadic `base_latency` (0 bytes per token, so equal shares
  change nothing; 0 s included: a transfer that ends at its start instant). Every time is
  exact in float32 and float64, ties between arrivals, iteration ends and transfer ends are
  frequent and must be broken as the page's section 9 says: equality is exact (atol 0).
* `unshared`: the same, with bytes moving at the full bandwidth (powers of two: exact).
* `pressure`: dyadic, D replicas with 6-10 blocks of 4 tokens: D preempts often.
* `mixed`: dyadic, about a third of the requests not disaggregated (run on D alone).
* `no_p`: no request disaggregated (the reference is run with an empty P pool, and the
  colocated reference `reference/continuous.py` must agree too).
* `saturation`: exponential arrivals, a shared link of small bandwidth and non-dyadic bytes
  per token (transfers overlap, each with its share fixed at its start). Times are float32
  sums of spans below ~100 s, so they match to 1e-3 s (float32 keeps ~1e-5 s there; the
  margin covers the few dozen additions along a request's path); counts exactly.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.core import disaggregation as PD
from jaxserve.core.disagg_replay import replay_arrays, replay_sizes, result_dict, simulate_disagg
from jaxserve.reference import continuous as cref
from jaxserve.reference.disaggregation import _PDReplica as PDReplica
from jaxserve.reference.disaggregation import simulate
from jaxserve.core.replica import ReplicaProfile
from tests.test_continuous_engine import as_dicts, dyadic_replica
from tests.test_reference_disaggregation import LINK as HAND_LINK
from tests.test_reference_disaggregation import prof as hand_prof

N = 40  # requests per workload: one trace length, one compilation
KINDS = ("ties", "unshared", "pressure", "mixed", "no_p", "saturation")
SEEDS = (0, 1)
FIELDS = ("prefill_done", "transfer_start", "transfer_end", "first_token", "finish")
CONFIGS = [(True, 0.0), (False, 0.0), (True, 0.25), (False, 0.125)]


def make_case(kind, seed):
    """`(arrival, prompt, output, P profiles, D profiles, p_route, d_route, link)`."""
    rng = np.random.default_rng(1000 * KINDS.index(kind) + seed)
    dyadic = kind != "saturation"
    if dyadic:
        arrival = np.cumsum(rng.choice([0.0, 0.0, 1.0, 1.0, 2.0], size=N))
    else:
        arrival = np.cumsum(rng.exponential(0.5, size=N))
    prompt = rng.integers(1, 25, size=N)
    output = rng.integers(1, 13, size=N)
    chunked, wm = CONFIGS[int(rng.integers(len(CONFIGS)))]
    d_blocks = (6, 11) if kind == "pressure" else (10, 17)
    pp = [dyadic_replica(rng, chunked, wm, kv_blocks=int(rng.integers(10, 17))) for _ in range(2)]
    dp = [dyadic_replica(rng, chunked, wm, kv_blocks=int(rng.integers(*d_blocks)))
          for _ in range(2)]
    p_route = rng.integers(0, 2, size=N)
    if kind == "mixed":
        p_route = np.where(rng.random(N) < 0.35, -1, p_route)
    if kind == "no_p":
        p_route = np.full(N, -1)
    d_route = rng.integers(0, 2, size=N)
    if kind in ("ties", "pressure", "mixed", "no_p"):
        link = dict(bandwidth=1024.0, base_latency=float(rng.choice([0.0, 0.25, 1.0])),
                    kv_bytes_per_token=0.0, shared=True)
    elif kind == "unshared":
        link = dict(bandwidth=2.0 ** 12, base_latency=0.25, kv_bytes_per_token=2.0 ** 6,
                    shared=False)
    else:
        link = dict(bandwidth=3000.0, base_latency=0.01, kv_bytes_per_token=97.3, shared=True)
    return arrival, prompt, output, pp, dp, p_route, d_route, link


CASES = [(k, s) for k in KINDS for s in SEEDS]


def reference(case):
    arrival, prompt, output, pp, dp, p_route, d_route, link = case
    pools = [] if (p_route < 0).all() else as_dicts(pp)
    return simulate(arrival, prompt, output, pools, as_dicts(dp), p_route, d_route, link)


def engine_inputs(case):
    arrival, prompt, output, pp, dp, p_route, d_route, link = case
    gap = np.append(np.diff(arrival), np.inf)
    return (PD.pool_profile(pp, dp), jnp.arange(len(pp) + len(dp)) < len(pp),
            PD.make_link(**link),
            jnp.asarray(gap, jnp.float32), jnp.asarray(prompt), jnp.asarray(output),
            jnp.asarray(p_route), jnp.asarray(d_route))


def common_sizes(cases):
    sizes = [replay_sizes(c[3], c[4], N) for c in cases]
    return tuple(int(max(s[k] for s in sizes)) for k in range(len(sizes[0])))


def hand_cases():
    """The reference's hand-computed cases (`tests/test_reference_disaggregation.py`), as
    `(name, case)` padded to the batch's shape: two P and two D replicas (unused ones added)
    and `N` requests (the added ones arrive 1000 s after the last, each alone on an added
    or idle D replica, after everything else has drained). Queue caps of 100 become 6 (no
    case queues more than 3 requests), and `moe_tokens` 4 with `moe = 0` (the batch's static
    value: the term is then exactly 0)."""
    def rp(**kw):
        d = {**hand_prof(**kw), "moe_tokens": 4}
        d["queue_cap"] = min(d["queue_cap"], 6)
        return ReplicaProfile(**d)

    unshared = dict(HAND_LINK, shared=False)
    raw = [("one request", [0.0], [8], [3], [rp()], [rp()], [0], [0], HAND_LINK),
           ("shared link", [0.0, 0.0], [8, 8], [2, 2], [rp(), rp()], [rp()], [0, 1], [0, 0],
            HAND_LINK),
           ("unshared link", [0.0, 0.0], [8, 8], [2, 2], [rp(), rp()], [rp()], [0, 1], [0, 0],
            unshared),
           ("end at a start", [0.0, 1.25], [8, 8], [2, 2], [rp(), rp()], [rp()], [0, 1],
            [0, 0], HAND_LINK),
           ("D pressure", [0.0, 0.0], [6, 6], [5, 5], [rp(), rp()], [rp(kv_blocks=4)], [0, 1],
            [0, 0], unshared),
           ("never fits D", [0.0], [8], [4], [rp()], [rp(kv_blocks=2)], [0], [0], HAND_LINK),
           ("P queue cap", [0.0] * 3, [8] * 3, [2] * 3, [rp(queue_cap=1)], [rp()], [0] * 3,
            [0] * 3, HAND_LINK),
           ("D boundary after a preemption", [0.0, 0.0], [2, 24], [8, 2], [rp()],
            [rp(kv_blocks=4, block_size=8)], [-1, 0], [0, 0],
            dict(HAND_LINK, kv_bytes_per_token=0.0)),
           ("D queue cap with remote", [0.0, 2.0, 3.0], [8, 4, 4], [2, 2, 2], [rp()],
            [rp(queue_cap=1)], [0, -1, -1], [0, 0, 0], HAND_LINK)]
    out = []
    for name, arrival, prompt, output, pp, dp, p_route, d_route, link in raw:
        k = len(arrival)
        pad = N - k
        case = (np.array(arrival + [arrival[-1] + 1000.0] * pad),
                np.array(prompt + [1] * pad), np.array(output + [1] * pad),
                pp + [rp()] * (2 - len(pp)), dp + [rp()] * (2 - len(dp)),
                np.array(p_route + [-1] * pad), np.array(d_route + [1] * pad), link)
        out.append((name, k, len(pp), len(dp), (arrival, prompt, output, pp, dp, p_route,
                                                  d_route, link), case))
    return out


@functools.lru_cache(maxsize=1)
def batch_results():
    """Every case in one vmapped replay; returns (raw batched outputs, sizes: large enough
    for the hand cases too, which then share the unbatched compilation)."""
    cases = [make_case(*c) for c in CASES]
    sizes = common_sizes(cases + [h[-1] for h in hand_cases()])
    inputs = [engine_inputs(c) for c in cases]
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *inputs)
    run = jax.jit(jax.vmap(functools.partial(replay_arrays, sizes=sizes)))
    return jax.device_get(run(*stacked)), sizes


def case_result(b):
    raw, _ = batch_results()
    case = make_case(*CASES[b])
    out = jax.tree.map(lambda x: x[b], raw)
    return result_dict(out, case[0], case[5], case[6], num_prefill=2), case


def assert_equal(got, want, atol, npre):
    for k in ("dropped", "never_fit", "preemptions", "p_replica", "d_replica"):
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    for k in FIELDS:
        np.testing.assert_array_equal(np.isnan(got[k]), np.isnan(want[k]), err_msg=k)
        ok = ~np.isnan(want[k])
        np.testing.assert_allclose(got[k][ok], want[k][ok], rtol=0, atol=atol, err_msg=k)
    pools = (("prefill", npre), ("decode", None))
    for pool, keep in pools:
        g, w = got[f"{pool}_iterations"], want[f"{pool}_iterations"]
        if keep == 0:  # an empty P pool: the engine's unused replicas never iterate
            assert g.sum() == 0 and got[f"{pool}_preemptions"].sum() == 0
            continue
        np.testing.assert_array_equal(g, w, err_msg=f"{pool}_iterations")
        np.testing.assert_array_equal(got[f"{pool}_preemptions"], want[f"{pool}_preemptions"])
        np.testing.assert_allclose(got[f"{pool}_busy"], want[f"{pool}_busy"], rtol=1e-5,
                                   atol=0 if atol == 0 else 1e-3)


@pytest.mark.parametrize("b", range(len(CASES)), ids=[f"{k}-{s}" for k, s in CASES])
def test_random_workloads_equal_reference(b):
    got, case = case_result(b)
    want = reference(case)
    atol = 1e-3 if CASES[b][0] == "saturation" else 0.0
    assert_equal(got, want, atol, npre=0 if (case[5] < 0).all() else 2)
    # Every request not dropped finishes (no replica is left stalled: page section 8 step 3).
    assert np.isfinite(want["finish"][~want["dropped"]]).all()


def test_no_disaggregation_is_the_colocated_reference():
    """With no request disaggregated the engine equals `reference/continuous.py` (page
    section 13), per request."""
    for b, (kind, _) in enumerate(CASES):
        if kind != "no_p":
            continue
        got, case = case_result(b)
        arrival, prompt, output, _, dp, _, d_route, _ = case
        want = cref.simulate(arrival, prompt, output, d_route, as_dicts(dp))
        np.testing.assert_array_equal(got["dropped"], want["dropped"])
        np.testing.assert_array_equal(got["never_fit"], want["never_fit"])
        np.testing.assert_array_equal(got["preemptions"], want["preemptions"])
        np.testing.assert_array_equal(got["first_token"], want["first_token"])
        np.testing.assert_array_equal(got["finish"], want["finish"])
        assert np.isnan(got["transfer_start"]).all() and np.isnan(got["prefill_done"]).all()


def test_workloads_exercise_every_rule(monkeypatch):
    """The batch does exercise what it claims (guards against vacuous equality): drops,
    never-fit requests, preemptions on P and on D, transfers sharing the link, transfers
    waiting for D's blocks, requests not disaggregated, zero-length transfers, ties of
    transfer ends with other events, and D boundaries that preempted and scheduled nothing
    (followed by another at the same instant: page section 8, step 3)."""
    seen = dict(drop=0, never=0, pre_p=0, pre_d=0, overlap=0, wait_d=0, local=0, zero=0,
                tie=0, again=0)
    schedule = PDReplica.schedule

    def counted(self, t):
        schedule(self, t)
        seen["again"] += self.end is None and not self.stalled

    monkeypatch.setattr(PDReplica, "schedule", counted)
    for kind, seed in CASES:
        case = make_case(kind, seed)
        w = reference(case)
        seen["drop"] += (w["dropped"] & ~w["never_fit"]).sum()
        seen["never"] += w["never_fit"].sum()
        seen["pre_p"] += w.get("prefill_preemptions", np.zeros(1)).sum()
        seen["pre_d"] += w["decode_preemptions"].sum()
        s, e = w["transfer_start"], w["transfer_end"]
        ok = ~np.isnan(s)
        if kind == "saturation":
            seen["overlap"] += sum(((s[ok] <= x) & (e[ok] > x)).sum() > 1 for x in s[ok])
        seen["wait_d"] += (s[ok] > w["prefill_done"][ok]).sum()
        seen["local"] += ((case[5] < 0) & ~w["dropped"]).sum()
        seen["zero"] += (e[ok] == s[ok]).sum()
        events = np.concatenate([case[0], w["finish"][~np.isnan(w["finish"])]])
        seen["tie"] += np.isin(e[ok], events).sum()
    assert all(v > 0 for v in seen.values()), seen


def test_vmap_equals_single_jitted_runs():
    """Two workloads replayed alone (`simulate_disagg`: `jit`, unbatched, the batch's static
    sizes) give the batched rows bit for bit."""
    _, sizes = batch_results()
    for b in (CASES.index(("pressure", 1)), CASES.index(("saturation", 0))):
        want, case = case_result(b)
        arrival, prompt, output, pp, dp, p_route, d_route, link = case
        got = simulate_disagg(arrival, prompt, output, pp, dp, p_route, d_route, link,
                              sizes=sizes)
        assert got.keys() == want.keys()
        for k in got:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_hand_computed_cases_equal_reference():
    """The reference's hand-computed cases (exact dyadic times: one request's life, equal
    link shares, a transfer ending at another's start, D preemption and local recompute,
    never-fit and queue-cap drops, a D boundary that preempted and scheduled nothing, D's
    queue cap counting its remote list) through the engine, request by request."""
    _, sizes = batch_results()
    for name, k, n_p, n_d, orig, case in hand_cases():
        arrival, prompt, output, pp, dp, p_route, d_route, link = orig
        want = simulate(arrival, prompt, output, as_dicts(pp), as_dicts(dp), p_route, d_route,
                        link)
        got = simulate_disagg(*case, sizes=sizes)
        got = {key: (v[:k] if v.shape == (N,) else v) for key, v in got.items()}
        got["prefill_iterations"] = got["prefill_iterations"][:n_p]
        got["prefill_busy"] = got["prefill_busy"][:n_p]
        got["prefill_preemptions"] = got["prefill_preemptions"][:n_p]
        for key in ("decode_iterations", "decode_busy", "decode_preemptions"):
            got[key] = got[key][:n_d]
        try:
            assert_equal(got, want, 0.0, npre=n_p)
        except AssertionError as e:
            raise AssertionError(f"hand case {name!r}: {e}") from None


def test_simulate_disagg_with_an_empty_p_pool():
    """The host entry point with no P replica (four D replicas: the same compiled replay as
    the test above) equals the reference with an empty P pool, and the colocated one."""
    arrival, prompt, output, pp, dp, _, _, link = make_case("pressure", 0)
    # Mostly to the small D replicas (2 and 3): preemptions.
    d_route = np.random.default_rng(9).choice([0, 2, 2, 3, 3], size=N)
    _, sizes = batch_results()
    got = simulate_disagg(arrival, prompt, output, [], pp + dp, np.full(N, -1), d_route, link,
                          sizes=sizes)
    want = simulate(arrival, prompt, output, [], as_dicts(pp + dp), np.full(N, -1), d_route,
                    link)
    assert_equal(got, want, 0.0, npre=0)
    assert got["prefill_iterations"].shape == (0,) and got["decode_iterations"].shape == (4,)
    colo = cref.simulate(arrival, prompt, output, d_route, as_dicts(pp + dp))
    for k in ("first_token", "finish", "preemptions", "dropped"):
        np.testing.assert_array_equal(got[k], colo[k], err_msg=k)
    assert (want["preemptions"] > 0).any() and want["dropped"].any()


def test_invalid_configuration_is_refused():
    arrival, prompt, output, pp, dp, p_route, d_route, link = make_case("ties", 0)
    bad = [
        dict(prefill_route=np.full(N, 2)),  # no P replica 2
        dict(prefill_route=np.full(N, -2)),
        dict(decode_route=np.full(N, 2)),
        dict(prefill_profiles=[], prefill_route=np.zeros(N, int)),
        dict(decode_profiles=[]),
        dict(arrival=arrival[::-1]),
        dict(prompt=np.zeros(N, int)),
        dict(link=dict(link, bandwidth=0.0)),
        dict(link=dict(link, shared="yes")),
        dict(link=dict(link, latency=1.0)),
        dict(decode_profiles=[dict(c0=1.0)]),
        dict(sizes=(1, 1, 1, 1, 1)),
    ]
    base = dict(arrival=arrival, prompt=prompt, output=output, prefill_profiles=pp,
                decode_profiles=dp, prefill_route=p_route, decode_route=d_route, link=link)
    for kw in bad:
        with pytest.raises(ValueError):
            simulate_disagg(**{**base, **kw})


THRESHOLD = 8  # disaggregate prompts of at least this many tokens (llm-d's rule's shape)


def ref_decode_rule(i, view):
    """The D replica with the least KV in use (first on ties)."""
    kv = [v.kv_usage for v in view["decode"]]
    return int(np.argmin(kv))


def ref_prefill_rule(i, view, d):
    """Prompts of `THRESHOLD` tokens or more go to the P replica with the fewest waiting,
    then running, requests; shorter ones stay on D."""
    if view["prompt"] < THRESHOLD:
        return -1
    keys = [(v.waiting, v.running) for v in view["prefill"]]
    return min(range(len(keys)), key=lambda k: keys[k])


def jax_rule(views, prompt):
    """`ref_decode_rule` and `ref_prefill_rule` on `replica_views`."""
    is_p = views["is_prefill"]
    num_p = is_p.sum().astype(jnp.int32)
    d = jnp.argmin(jnp.where(is_p, jnp.inf, views["kv_usage"])).astype(jnp.int32) - num_p
    big = jnp.iinfo(jnp.int32).max
    p = jnp.argmin(jnp.where(is_p, views["waiting"] * 4096 + views["running"], big))
    return jnp.where(prompt >= THRESHOLD, p.astype(jnp.int32), -1), d


def test_stepwise_routing_on_views_equals_reference_routers():
    """The engine driven step by step (route each arrival by a rule of the replicas' views,
    advance to the next arrival, rebase: what an environment does) equals the reference
    with the same rule as callable routers: the views (running, waiting with pending and
    remote requests, KV usage with sends and reservations) agree at every arrival."""
    _, sizes = batch_results()
    run = jax.jit(functools.partial(replay_arrays, sizes=sizes, router=jax_rule))
    for kind, seed in (("pressure", 0), ("ties", 1), ("saturation", 1)):
        case = make_case(kind, seed)
        arrival, prompt, output, pp, dp, _, _, link = case
        want = simulate(arrival, prompt, output, as_dicts(pp), as_dicts(dp), ref_prefill_rule,
                        ref_decode_rule, link)
        zeros = np.zeros(N, np.int32)
        out = jax.device_get(run(*engine_inputs(case[:5] + (zeros, zeros, link))))
        got = result_dict(out, arrival, out["p_route"], out["d_route"], num_prefill=2)
        atol = 1e-3 if kind == "saturation" else 0.0
        assert_equal(got, want, atol, npre=2)
        assert (want["p_replica"] >= 0).any() and (want["p_replica"] < 0).any()
        assert len(set(want["d_replica"])) == 2
