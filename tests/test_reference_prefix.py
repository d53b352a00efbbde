"""The prefix-caching reference (`jaxserve/reference/prefix.py`) against hand-computed cases and
against `jaxserve/reference/continuous.py`.

Hand cases use dyadic coefficients (c0 = 0.5 s, alpha = 1/16 s per token, the rest 0) and
4-token blocks, so every time below is exact in binary floating point: an iteration computing
`n` tokens lasts `0.5 + n / 16` s.
"""

import numpy as np
import pytest

from jaxserve.reference import continuous as rc
from jaxserve.reference.prefix import random_shared_workload, simulate_prefix

B = 4


def hand_profile(kv_blocks=64, **kw):
    p = dict(c0=0.5, alpha=2.0 ** -4, alpha2=0.0, beta=0.0, gamma=0.0, delta=0.0,
             kv_blocks=kv_blocks, block_size=B, max_seqs=4, max_tokens=64,
             chunked_prefill=True, watermark=0.0, queue_cap=16)
    p.update(kw)
    return p


def run(arrival, prompt, output, prefix, caching=True, **kw):
    n = len(arrival)
    return simulate_prefix(np.asarray(arrival, float), np.asarray(prompt), np.asarray(output),
                           np.zeros(n, int), [hand_profile(**kw)], prefix, caching=caching,
                           audit=True)


def test_second_request_skips_prefill_of_cached_blocks():
    # A: 12 tokens at t = 0, one output token: 0.5 + 12/16 = 1.25 s. Its 3 blocks are full, so
    # all are cached; B (same 2-block prefix) at t = 4 hits 2 blocks and computes 4 tokens.
    out = run([0.0, 4.0], [12, 12], [1, 1], [["x", "y"], ["x", "y"]])
    assert out["finish"].tolist() == [1.25, 4.75]
    assert out["cached_tokens"] == [[0], [8]]
    assert out["hit_tokens"].tolist() == [8]
    off = run([0.0, 4.0], [12, 12], [1, 1], [["x", "y"], ["x", "y"]], caching=False)
    assert off["finish"].tolist() == [1.25, 5.25]
    assert off["cached_tokens"] == [[0], [0]]
    # A different first block means a different chain: no hit even if the second id agrees.
    other = run([0.0, 4.0], [12, 12], [1, 1], [["x", "y"], ["z", "y"]])
    assert other["cached_tokens"] == [[0], [0]]


def test_fully_cached_prompt_recomputes_its_last_block():
    # B's 8-token prompt is fully cached (2 blocks) but the hit is capped at floor(7 / 4) = 1
    # block: B computes the whole last block (4 tokens), 0.75 s. Its recomputed block is a
    # second copy of the same identity (vLLM does not de-duplicate): 3 cached blocks remain.
    out = run([0.0, 4.0], [8, 8], [1, 1], [["x", "y"], ["x", "y"]], kv_blocks=16)
    assert out["finish"].tolist() == [1.0, 4.75]
    assert out["cached_tokens"] == [[0], [4]]
    assert out["accounting"][0][-1] == (4.75, 13, 3, 0)
    # One token more than two full blocks: both blocks hit, one token computed (0.5625 s).
    out = run([0.0, 4.0], [9, 9], [1, 1], [["x", "y"], ["x", "y"]])
    assert out["finish"].tolist() == [1.0625, 4.5625]
    assert out["cached_tokens"] == [[0], [8]]


def test_lru_eviction_fresh_first_then_least_recently_freed_tail_first():
    # 6 blocks. A (8 tokens) finishes at 1.0 and frees [A1, A0] to the queue's tail; B does the
    # same at 3.0 using fresh blocks only. C (16 tokens, 4 blocks) at 4: 2 fresh, then evicts
    # A's tail block, then A's head (A was freed before B). D (9 tokens, private) at 6 evicts
    # B's two blocks and C's tail. E at 8 (C's 4-block prefix, 17 tokens) hits C's 3 surviving
    # blocks: 12 cached tokens, 5 computed.
    arrival = [0.0, 2.0, 4.0, 6.0, 8.0]
    prompt = [8, 8, 16, 9, 17]
    prefix = [["a1", "a2"], ["b1", "b2"], ["c1", "c2", "c3", "c4"], [],
              ["c1", "c2", "c3", "c4"]]
    out = run(arrival, prompt, [1] * 5, prefix, kv_blocks=6)
    assert out["finish"].tolist() == [1.0, 3.0, 5.5, 7.0625, 8.8125]
    assert out["cached_tokens"] == [[0], [0], [0], [0], [12]]
    # C evicts 2, D evicts 3, E evicts D's tail full block after using D's partial (fresh) one.
    assert out["evictions"].tolist() == [6]
    # A second request with A's prefix would now miss, one with B's too.
    again = run(arrival + [10.0, 10.0], prompt + [9, 9], [1] * 7,
                prefix + [["a1", "a2"], ["b1", "b2"]], kv_blocks=6)
    assert again["cached_tokens"][5:] == [[0], [0]]
    # Without pressure nothing is evicted and A's prefix hits.
    roomy = run(arrival + [10.0], prompt + [9], [1] * 6, prefix + [["a1", "a2"]],
                kv_blocks=64)
    assert roomy["evictions"].tolist() == [0]
    assert roomy["cached_tokens"][5] == [8]
    assert roomy["cached_tokens"][4] == [16]


def test_preemption_of_request_holding_shared_blocks():
    # 5 blocks. A and B (9 tokens, same 2-block prefix, 5 output tokens) arrive together: A is
    # admitted first and its 2 full blocks are cached at scheduling, so B hits them in the same
    # pass (8 cached tokens, 1 computed): 0.5 + 10/16 = 1.125 s, held blocks A0 A1 A2 B2.
    # Decodes of 0.625 s at 1.125, 1.75, 2.375 (the last fills both third blocks: cached).
    # At 3.0 both need a 4th block, one is free: A takes it, B is preempted (itself the last):
    # only its private block B2 returns to the queue (cached); the shared two stay held by A.
    # A decodes alone (0.5625 s) and finishes at 3.5625, freeing its blocks. B is readmitted:
    # L = 13, hit capped at 3 blocks = the two shared + its own B2: 12 cached tokens, computes
    # one token (0.5625 s): finishes at 4.125, its first token stays 1.125.
    out = run([0.0, 0.0], [9, 9], [5, 5], [["s1", "s2"], ["s1", "s2"]], kv_blocks=5)
    assert out["first_token"].tolist() == [1.125, 1.125]
    assert out["finish"].tolist() == [3.5625, 4.125]
    assert out["preemptions"].tolist() == [0, 1]
    assert out["cached_tokens"] == [[0], [8, 12]]
    assert out["evictions"].tolist() == [0]
    # The step at 3.0: no fresh block, B2 cached and unreferenced, 4 held (A's).
    assert (3.0, 0, 1, 4) in out["accounting"][0]
    # Without caching the two do not fit together (3 + 3 blocks > 5): B waits for A, which
    # runs alone (prefill 1.0625 s, decodes 0.5625 s) until 3.3125; B then takes 1.0625 s
    # plus 4 decodes: 6.625.
    off = run([0.0, 0.0], [9, 9], [5, 5], [["s1", "s2"], ["s1", "s2"]], kv_blocks=5,
              caching=False)
    assert off["finish"].tolist() == [3.3125, 6.625]
    assert off["first_token"].tolist() == [1.0625, 4.375]
    assert off["preemptions"].tolist() == [0, 0]


def test_shared_blocks_count_once_in_kv_memory():
    # 4 blocks. A (9 tokens, 3 output tokens) holds 3 blocks while it decodes. B (same 2-block
    # prefix, 9 tokens) arrives at 1.0 and is considered at A's first iteration end 1.0625: it
    # hits A's 2 blocks, which A holds (not taken from the free pool), so it needs 1 block and
    # 1 is free. Both run together (0.5 + 2/16 = 0.625 s): B finishes at 1.6875, A at 2.25.
    out = run([0.0, 1.0], [9, 9], [3, 1], [["x", "y"], ["x", "y"]], kv_blocks=4)
    assert out["finish"].tolist() == [2.25, 1.6875]
    assert out["cached_tokens"] == [[0], [8]]
    assert (1.0625, 0, 0, 4) in out["accounting"][0]  # 4 distinct blocks held, 5 references
    # Without caching B needs 3 blocks and waits for A (decoding alone, 0.5625 s per token).
    off = run([0.0, 1.0], [9, 9], [3, 1], [["x", "y"], ["x", "y"]], kv_blocks=4,
              caching=False)
    assert off["finish"].tolist() == [2.1875, 3.25]


def test_arrival_at_an_iteration_end_sees_the_freed_blocks():
    # A finishes at 1.0 and frees its blocks (iteration end before arrivals); B arriving at
    # exactly 1.0 hits both, now cached and unreferenced: need = 1 new + 2 touched.
    out = run([0.0, 1.0], [8, 9], [1, 1], [["x", "y"], ["x", "y"]], kv_blocks=3)
    assert out["finish"].tolist() == [1.0, 1.5625]
    assert out["cached_tokens"] == [[0], [8]]
    assert out["evictions"].tolist() == [0]


def random_profile(rng, chunked, watermark, kv_blocks):
    return dict(
        c0=float(rng.choice([0.25, 0.5])), alpha=2.0 ** -int(rng.integers(5, 8)),
        alpha2=float(rng.choice([0.0, 2.0 ** -10])), beta=float(rng.choice([0.0, 0.125])),
        gamma=float(rng.choice([0.0, 2.0 ** -5, -2.0 ** -8])),
        delta=float(rng.choice([0.0, 2.0 ** -9])), kv_blocks=int(kv_blocks), block_size=B,
        max_seqs=4, max_tokens=int(rng.choice([8, 16, 32])), chunked_prefill=bool(chunked),
        watermark=float(watermark), queue_cap=int(rng.integers(2, 7)))


def random_case(seed, kv=(14, 24), n=80):
    rng = np.random.default_rng(seed)
    arrival, prompt, output, prefix = random_shared_workload(rng, n, b=B, rate=1.5)
    profiles = [random_profile(rng, seed % 2 == 0, (0.0, 0.125)[seed % 4 // 2],
                               rng.integers(*kv)) for _ in range(2)]
    replica = rng.integers(0, 2, n)
    return arrival, prompt, output, replica, profiles, prefix


@pytest.mark.parametrize("seed", range(8))
def test_conservation_every_step_on_shared_prefix_workloads(seed):
    arrival, prompt, output, replica, profiles, prefix = random_case(seed)
    counts = []

    def check(t, arrived, completed, waiting, running, dropped):
        counts.append(arrived - completed - waiting - running - dropped)

    out = simulate_prefix(arrival, prompt, output, replica, profiles, prefix, audit=True,
                          check=check)
    assert counts and all(c == 0 for c in counts)
    assert any(out["accounting"])
    for k, acc in enumerate(out["accounting"]):
        assert all(f + u + h == profiles[k]["kv_blocks"] for _, f, u, h in acc)
        assert all(min(f, u, h) >= 0 for _, f, u, h in acc)
    done = ~out["dropped"]
    assert np.all(np.isfinite(out["finish"][done])) and np.all(out["finish"][done] >= arrival[done])
    for i in np.flatnonzero(done):
        assert len(out["cached_tokens"][i]) == out["preemptions"][i] + 1
        assert all(c % B == 0 and c < prompt[i] + output[i] for c in out["cached_tokens"][i])


def test_random_workloads_exercise_hits_evictions_and_shared_preemption():
    """Guards the test above against vacuity: over its seeds there are prefix hits, evictions,
    preemptions of requests holding a block another running request holds, and readmissions
    that hit the cache."""
    hits = evictions = shared_victims = rehits = 0
    for seed in range(8):
        arrival, prompt, output, replica, profiles, prefix = random_case(seed)
        out = simulate_prefix(arrival, prompt, output, replica, profiles, prefix)
        hits += int(out["hit_tokens"].sum())
        evictions += int(out["evictions"].sum())
        shared_victims += int(out["shared_preemptions"].sum())
        rehits += sum(any(c > 0 for c in cs[1:]) for cs in out["cached_tokens"])
    assert hits > 0 and evictions > 0 and shared_victims > 0 and rehits > 0


@pytest.mark.parametrize("seed", range(4))
def test_hits_without_pressure_equal_an_independent_count(seed):
    """Requests far apart (each finishes before the next arrives) on ample memory: nothing is
    evicted, so request i's hit is the longest prefix of its id list seen in earlier requests'
    lists, capped at floor((p - 1) / b) blocks - counted here without any block pool."""
    rng = np.random.default_rng(50 + seed)
    n = 60
    _, prompt, output, prefix = random_shared_workload(rng, n, b=B, tail=(0, 6))
    arrival = 1000.0 * np.arange(n)
    out = simulate_prefix(arrival, prompt, output, np.zeros(n, int),
                          [hand_profile(kv_blocks=4096)], prefix)
    seen = set()
    want = []
    for i in range(n):
        k = 0
        while k < min(len(prefix[i]), (int(prompt[i]) - 1) // B) and \
                tuple(prefix[i][:k + 1]) in seen:
            k += 1
        want.append([k * B])
        seen.update(tuple(prefix[i][:j + 1]) for j in range(len(prefix[i])))
    assert out["cached_tokens"] == want
    assert out["evictions"].tolist() == [0] and sum(c[0] > 0 for c in want) > n // 2
    # some prompts are exactly their shared blocks: their last block is never a hit, and for
    # some of them every other block is (the cap binds)
    exact = [i for i in range(n) if prompt[i] == len(prefix[i]) * B]
    assert all(want[i][0] <= prompt[i] - B for i in exact)
    assert any(want[i][0] == prompt[i] - B > 0 for i in exact)


@pytest.mark.parametrize("seed", range(6))
def test_caching_off_equals_reference_continuous(seed):
    arrival, prompt, output, replica, profiles, prefix = random_case(seed)
    want = rc.simulate(arrival, prompt, output, replica, profiles)
    got = simulate_prefix(arrival, prompt, output, replica, profiles, prefix, caching=False,
                          audit=True)
    assert want["preemptions"].sum() > 0 or seed not in (0, 4)
    for k in ("first_token", "finish", "dropped", "preemptions", "iterations", "busy",
              "kv_block_s", "kv_peak", "replica_preemptions"):
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert got["hit_tokens"].sum() == 0 and got["evictions"].sum() == 0


@pytest.mark.parametrize("seed", range(6))
def test_no_sharing_no_preemption_equals_reference_continuous(seed):
    """Caching on, every request's prefix private and memory ample: no hit is possible, so the
    two references agree per request (a preempted request could rehit its own blocks, which
    MODEL_CONTINUOUS.md does not model, hence the ample memory)."""
    arrival, prompt, output, replica, profiles, _ = random_case(seed, kv=(200, 201))
    private = [[("own", i, j) for j in range(int(prompt[i]) // B)] for i in range(len(prompt))]
    want = rc.simulate(arrival, prompt, output, replica, profiles)
    assert want["preemptions"].sum() == 0
    got = simulate_prefix(arrival, prompt, output, replica, profiles, private, audit=True)
    for k in ("first_token", "finish", "dropped", "preemptions", "iterations", "busy",
              "kv_block_s", "kv_peak"):
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert got["hit_tokens"].sum() == 0


def test_prefix_longer_than_prompt_is_refused():
    with pytest.raises(ValueError, match="prefix\\[0\\]"):
        run([0.0], [7], [1], [["x", "y"]])
