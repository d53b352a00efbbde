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


def test_a_boundary_that_preempted_and_scheduled_nothing_is_followed_by_another():
    """The D deadlock of page section 8, step 3. D: 4 blocks of 8 tokens. Request 0 runs on D
    alone (not disaggregated), prompt 2, output 8 (blocks(10) = 2: fits); request 1 goes
    through P, prompt 24 (3 D blocks), output 2; the link moves 0 bytes (0.25 s).

    * D: 0 -> 0.640625 prefill of request 0 (0.5 + 2/16 + 4/256; C = 2, first token), then
      decodes of 0.8125 s (0.5 + 1/16 + 1/4) from boundaries b0 = 0.640625, ..., b5 = 4.703125,
      b6 = 5.515625; C goes 2 -> 8 by b6, all in 1 block.
    * P: request 1's prefill ends at 4.25 (0.5 + 24/16 + 576/256); it joins D's waiting,
      pending. At b5 (C 7 -> 8: no new block) D allocates its 3 blocks (free 3 - 3 = 0 >= 0)
      and the transfer runs 4.703125 -> 4.953125, inside the iteration: ready by b6.
    * b6 = 5.515625: request 0 needs a 2nd block (C 8 -> 9), free = 4 - 1 - 3 = 0: it is the
      last of `running`, its own victim (C = 0, front of waiting). Preempted, nothing scheduled;
      no arrival or transfer end is left to wake D (the old rule's deadlock: both requests
      never finished). Another boundary at 5.515625: nothing running to preempt; admission
      takes the ready request 1 (n = 1 with C = 23, no new block, free 1), then request 0
      (L = 9: 2 blocks > 1 free) waits. Request 1: first token 5.515625 + (0.5 + 1/16 +
      24/256) = 6.171875; its decode (C 24 -> 25: a 4th block, free 1) ends 6.984375.
    * 6.984375: request 0 recomputes its 9 tokens (0.5 + 9/16 + 81/256 = 1.37890625), which
      samples its 8th and last token: finish 8.36328125. D ran 7 + 2 + 1 = 10 iterations.
    """
    d = prof(kv_blocks=4, block_size=8)
    r = simulate([0.0, 0.0], [2, 24], [8, 2], [prof()], [d], [-1, 0], [0, 0],
                 dict(LINK, kv_bytes_per_token=0.0))
    b6 = 0.640625 + 6 * DECODE_T
    assert b6 == 5.515625
    assert r["prefill_done"][1] == prefill_T(24) == 4.25
    assert (r["transfer_start"][1], r["transfer_end"][1]) == (4.703125, 4.953125)
    assert list(r["first_token"]) == [prefill_T(2), b6 + first_D_T(24)]
    assert r["finish"][1] == b6 + first_D_T(24) + DECODE_T == 6.984375
    assert r["finish"][0] == 6.984375 + prefill_T(9) == 8.36328125
    assert list(r["preemptions"]) == [1, 0] and r["decode_preemptions"][0] == 1
    assert r["decode_iterations"][0] == 10 and not r["dropped"].any()


def test_d_queue_cap_counts_remote_requests():
    """D's queue cap (page section 5) counts every request D holds that has not started
    running: waiting ones never preempted and the remote list's. D has `queue_cap = 1`.
    Request 0 goes through P (prefill 0.5 + 8/16 + 64/256 = 1.25); D allocates it at once
    and its transfer (2 P blocks, 8192 bytes: 1 s + 0.25 s) runs 1.25 -> 2.5. Request 1,
    not disaggregated, reaches D at 2.0: D's waiting queue is empty but request 0 is on
    its remote list (receiving), 1 >= 1: dropped (the router's view counts it in `waiting`
    too). Request 2 reaches D at 3.0, when request 0 runs (its first D iteration,
    2.5 -> 2.5 + 0.59375): D holds nothing not started, so it is queued and completes."""
    seen = []

    def d_rule(i, view):
        seen.append(view["decode"][0])
        return 0

    r = simulate([0.0, 2.0, 3.0], [8, 4, 4], [2, 2, 2], [prof()], [prof(queue_cap=1)],
                 [0, -1, -1], d_rule, LINK)
    assert (r["transfer_start"][0], r["transfer_end"][0]) == (1.25, 2.5)
    assert list(r["dropped"]) == [False, True, False] and not r["never_fit"].any()
    assert r["first_token"][0] == 2.5 + first_D_T(8)
    assert np.isfinite(r["finish"][[0, 2]]).all()
    assert [(v.running, v.waiting) for v in seen] == [(0, 0), (0, 1), (1, 0)]


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
