"""The pure-Python reference of prefill/decode disaggregation (`docs/disaggregation.md`) on
hand-computed cases with dyadic numbers (exact in floats), and its colocated special case
against `jaxserve/reference/continuous.py`."""

import numpy as np

from jaxserve.reference import continuous
from jaxserve.reference.disaggregation import simulate

C0, ALPHA, ALPHA2, GAMMA = 0.5, 1 / 16, 1 / 256, 1 / 4


def prof(**kw):
    p = dict(c0=C0, alpha=ALPHA, alpha2=ALPHA2, beta=0.0, gamma=GAMMA, delta=0.0, moe=0.0,
             moe_tokens=1, kv_blocks=64, block_size=4, max_seqs=8, max_tokens=64,
             chunked_prefill=True, watermark=0.0, queue_cap=100)
    p.update(kw)
    return p


# 1024 bytes per token, 4 tokens per block: 4096 bytes per block; 8192 bytes/s moves a block
# in 0.5 s.
LINK = dict(bandwidth=8192.0, base_latency=0.25, kv_bytes_per_token=1024.0, shared=True)


def prefill_T(p):
    """Seconds of one iteration prefilling `p` tokens from scratch, alone."""
    return C0 + ALPHA * p + ALPHA2 * p * p


def first_D_T(p):
    """Seconds of D's first iteration of a transferred request: one token after `p - 1`."""
    return C0 + ALPHA + ALPHA2 * p


DECODE_T = C0 + ALPHA + GAMMA  # one decode alone (delta = 0)


def test_one_request_through_p_link_and_d():
    r = simulate([0.0], [8], [3], [prof()], [prof()], [0], [0], LINK)
    t_p = prefill_T(8)  # 1.25
    assert r["prefill_done"][0] == t_p
    # D allocates at once (idle); the transfer moves 2 blocks = 8192 bytes in 1 s, plus 0.25 s.
    assert r["transfer_start"][0] == t_p
    assert r["transfer_end"][0] == t_p + 0.25 + 1.0
    first = t_p + 1.25 + first_D_T(8)
    assert r["first_token"][0] == first  # the client's first token comes from D
    assert r["finish"][0] == first + 2 * DECODE_T
    assert (r["p_replica"][0], r["d_replica"][0]) == (0, 0)
    assert r["preemptions"][0] == 0 and not r["dropped"][0]
    assert r["prefill_iterations"][0] == 1 and r["decode_iterations"][0] == 3


def test_two_transfers_share_the_link_equally():
    # Two P replicas prefill one request each; both hand over at t_p and one D allocates both
    # at t_p: the first transfer starts alone (n = 1), the second with n = 2 (half the link).
    args = ([0.0, 0.0], [8, 8], [2, 2], [prof(), prof()], [prof()], [0, 1], [0, 0])
    r = simulate(*args, LINK)
    t_p = prefill_T(8)
    assert list(r["transfer_start"]) == [t_p, t_p]
    assert r["transfer_end"][0] == t_p + 0.25 + 1.0
    assert r["transfer_end"][1] == t_p + 0.25 + 2.0
    # Not shared: both take the full bandwidth.
    r2 = simulate(*args, dict(LINK, shared=False))
    assert list(r2["transfer_end"]) == [t_p + 1.25, t_p + 1.25]
    # Shared: request 0 is ready first and D serves it alone (first token, then its one
    # decode); request 1 becomes ready while D is busy and is admitted at the next boundary.
    t0 = t_p + 1.25 + first_D_T(8)
    assert r["first_token"][0] == t0
    assert r["finish"][0] == t0 + DECODE_T
    assert r["first_token"][1] == t0 + DECODE_T + first_D_T(8)
    # Not shared: both are ready together and D computes both last prompt tokens at once.
    both = t_p + 1.25 + C0 + 2 * ALPHA + 2 * ALPHA2 * 8
    assert list(r2["first_token"]) == [both, both]


def test_a_transfer_ending_at_a_start_no_longer_counts():
    # Request 1 reaches D exactly when request 0's transfer ends (t_p + 1.25): it starts alone.
    t_p = prefill_T(8)
    r = simulate([0.0, 1.25], [8, 8], [2, 2], [prof(), prof()], [prof()], [0, 1], [0, 0], LINK)
    assert r["transfer_end"][0] == t_p + 1.25
    assert r["transfer_start"][1] == 1.25 + t_p
    assert r["transfer_end"][1] == 1.25 + t_p + 1.25


def test_decode_kv_pressure_preempts_and_recomputes_on_d():
    # D has 4 blocks of 4 tokens; each request reserves 2 (6 prompt tokens) and computes up to
    # 6 + 5 - 1 = 10 tokens = 3 blocks, so the two cannot both finish without a preemption.
    # The victim is the last admitted and recomputes locally (no second transfer).
    d = prof(kv_blocks=4)
    r = simulate([0.0, 0.0], [6, 6], [5, 5], [prof(), prof()], [d], [0, 1], [0, 0],
                 dict(LINK, shared=False))
    assert r["decode_preemptions"][0] >= 1
    assert r["preemptions"][0] == 0 and r["preemptions"][1] >= 1
    assert not r["dropped"].any()
    assert np.isfinite(r["finish"]).all()
    assert r["finish"][1] > r["finish"][0]
    # The page's arithmetic up to the preemption: both hand over at t_p, both transfers end at
    # t_p + 0.25 + 1 (2 blocks each, not shared); one D iteration computes both last tokens,
    # needing no block beyond the reservation (4 of 4 in use).
    t_p = prefill_T(6)
    t_x = t_p + 1.25
    assert list(r["transfer_end"]) == [t_x, t_x]
    t1 = t_x + C0 + 2 * ALPHA + 2 * ALPHA2 * 6
    assert list(r["first_token"]) == [t1, t1]
    # Two decodes together (C 6 -> 7 -> 8 fit in 2 blocks each); the third needs a third block
    # for request 0 with none free: request 1 is preempted and request 0 decodes alone.
    t3 = t1 + 2 * (C0 + 2 * ALPHA + 2 * GAMMA)
    assert r["finish"][0] == t3 + 2 * DECODE_T
    assert r["decode_preemptions"][0] == 1 and r["preemptions"][1] == 1


def test_drops_at_arrival():
    # Never fits on D (3 blocks needed, 2 there) although P could prefill it.
    r = simulate([0.0], [8], [4], [prof()], [prof(kv_blocks=2)], [0], [0], LINK)
    assert r["dropped"][0] and r["never_fit"][0]
    assert np.isnan(r["prefill_done"][0]) and np.isnan(r["first_token"][0])
    # P's queue cap: three arrivals at one instant, cap 1: the first waits, the others drop.
    r = simulate([0.0] * 3, [8] * 3, [2] * 3, [prof(queue_cap=1)], [prof()], [0] * 3, [0] * 3,
                 LINK)
    assert list(r["dropped"]) == [False, True, True]
    assert not r["never_fit"].any()
    assert np.isfinite(r["finish"][0])


def test_colocated_special_case_equals_continuous():
    rng = np.random.default_rng(7)
    n = 60
    arrival = np.sort(rng.integers(0, 200, n)) / 16.0
    prompt = rng.integers(1, 40, n)
    output = rng.integers(1, 30, n)
    replica = rng.integers(0, 2, n)
    profiles = [prof(kv_blocks=24, max_tokens=32, max_seqs=4, queue_cap=6),
                prof(kv_blocks=20, max_tokens=24, chunked_prefill=False, queue_cap=5,
                     delta=1 / 1024)]
    ref = continuous.simulate(arrival, prompt, output, replica, profiles)
    assert ref["preemptions"].sum() > 0 and ref["dropped"].sum() > 0  # the case is not idle
    for p_pool in ([], [prof()]):
        r = simulate(arrival, prompt, output, p_pool, profiles, np.full(n, -1), replica, LINK)
        np.testing.assert_array_equal(r["first_token"], ref["first_token"])
        np.testing.assert_array_equal(r["finish"], ref["finish"])
        np.testing.assert_array_equal(r["dropped"], ref["dropped"])
        np.testing.assert_array_equal(r["never_fit"], ref["never_fit"])
        np.testing.assert_array_equal(r["preemptions"], ref["preemptions"])
        np.testing.assert_array_equal(r["decode_iterations"], ref["iterations"])
        assert np.isnan(r["transfer_start"]).all()


def test_routing_callables_see_only_router_state():
    seen = []

    def d_rule(i, view):
        seen.append(view)
        return 0

    def p_rule(i, view, d):
        return 0 if view["prompt"] > 4 else -1  # a prefix-free threshold decider

    r = simulate([0.0, 0.0], [8, 2], [2, 2], [prof()], [prof()], p_rule, d_rule, LINK)
    assert list(r["p_replica"]) == [0, -1]
    assert np.isnan(r["transfer_start"][1]) and np.isfinite(r["finish"]).all()
    v = seen[1]["prefill"][0]
    assert (v.running, v.waiting, v.kv_usage) == (0, 1, 0.0)
