"""The synthetic shared-prefix generator (`jaxserve/traces/prefix_synthetic.py`): block
structure (system blocks shared, a session's later turns extending its earlier full blocks),
exact reuse on a single-turn case, determinism and validation."""

import dataclasses

import numpy as np
import pytest

from jaxserve.traces.prefix import path_nodes, reused_blocks
from jaxserve.traces.prefix_synthetic import (SharedPrefixConfig, draw_sessions,
                                              generate_shared_prefix, prefix_stats)


def test_single_turn_reuse_is_the_system_blocks():
    # 3 system prompts of 1024 tokens (2 full blocks); one turn per session; every prompt is
    # longer than the system prompt, so each request reuses exactly 2 blocks unless it is the
    # first to use its system prompt.
    cfg = SharedPrefixConfig(num_system=3, system_tokens=1024, turns_mean=1.0,
                             first_user_median=700.0, first_user_sigma=0.3)
    rows = draw_sessions(400, cfg, seed=3)
    pt = generate_shared_prefix(400, cfg, seed=3)
    systems = [r[5] for r in rows]
    firsts = {s: systems.index(s) for s in set(systems)}
    want = np.array([0 if firsts[s] == i else 2 for i, s in enumerate(systems)])
    np.testing.assert_array_equal(reused_blocks(pt), want)
    assert all(r[2] == 0 for r in rows)
    # Zipf(1) popularity over 3: system 0 has 6/11 of the sessions (within 4 standard errors)
    share = np.mean(np.array(systems) == 0)
    assert abs(share - 6 / 11) < 4 * np.sqrt(6 / 11 * 5 / 11 / 400)


def test_later_turns_extend_the_session_prefix():
    cfg = SharedPrefixConfig(system_tokens=0, turns_mean=4.0, think_s=5.0, session_rate=0.5,
                             next_user_median=300.0)
    rows = draw_sessions(300, cfg, seed=1)
    pt = generate_shared_prefix(300, cfg, seed=1)
    reused = reused_blocks(pt)
    T = cfg.block_tokens
    prev = {}
    n_follow = 0
    for i, (_, s, k, prompt, out, _) in enumerate(rows):
        if k == 0 or (s, k - 1) not in prev:
            # no system prompt: a first turn (or one whose previous turn is not in the window)
            # shares nothing
            assert reused[i] == 0
        else:
            j, p_prev, o_prev = prev[(s, k - 1)]
            assert prompt > p_prev + o_prev
            # it reuses exactly the previous turn's full blocks, which its path starts with
            assert reused[i] == p_prev // T
            assert path_nodes(pt.tree, int(pt.node[i]))[:p_prev // T] == \
                path_nodes(pt.tree, int(pt.node[j]))[:p_prev // T]
            n_follow += 1
        prev[(s, k)] = (i, prompt, out)
    assert n_follow > 50
    np.testing.assert_array_equal(pt.full_blocks, pt.trace.prompt_tokens // T)


def test_deterministic_sorted_rebased_and_capped():
    cfg = SharedPrefixConfig(max_prompt=20000)
    a = generate_shared_prefix(500, cfg, seed=7)
    b = generate_shared_prefix(500, cfg, seed=7)
    c = generate_shared_prefix(500, cfg, seed=8)
    np.testing.assert_array_equal(a.trace.arrival_s, b.trace.arrival_s)
    np.testing.assert_array_equal(a.node, b.node)
    assert not np.array_equal(a.trace.prompt_tokens, c.trace.prompt_tokens)
    assert a.trace.arrival_s[0] == 0.0 and np.all(np.diff(a.trace.arrival_s) >= 0)
    assert len(a) == 500 and a.trace.prompt_tokens.max() <= 20000
    assert a.trace.output_tokens.min() >= 1


def test_stats_of_defaults_are_close_to_mooncake_conversation():
    """The defaults were hand-set against Mooncake's conversation trace (README: 3.40 req/s,
    prompt p50 6909, output p50 350, 36.6% reuse); this pins what they give on 4000 requests
    so that a change of the generator shows. Tolerances: the sampling spread of a median over
    4000 lognormal draws of log-sd 1.4 is ~3%, of the reuse share ~2 points."""
    s = prefix_stats(generate_shared_prefix(4000, seed=0))
    assert 3.0 < s["rate"] < 4.0
    assert 5500 < s["prompt_pct"][0] < 8500
    assert 320 < s["output_pct"][0] < 380
    assert 0.33 < s["reuse"] < 0.46
    assert 0.55 < s["reuse_le1"] < 0.68


@pytest.mark.parametrize("field, value", [
    ("session_rate", 0.0), ("turns_mean", 0.5), ("num_system", 0), ("output_sigma", -1.0),
    ("block_tokens", 0), ("system_tokens", 200000),
])
def test_invalid_config_names_the_field(field, value):
    cfg = dataclasses.replace(SharedPrefixConfig(), **{field: value})
    with pytest.raises(ValueError, match=field):
        generate_shared_prefix(10, cfg)
    with pytest.raises(ValueError, match="n_requests"):
        generate_shared_prefix(0)
