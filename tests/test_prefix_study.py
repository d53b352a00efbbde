"""Experiment (p)'s study (`agents.experiments.prefix_study`) end to end on tiny windows.

PPO's training program takes over a minute to compile on the 2-core CPU, so the pipeline test
replaces `train_agent` with untrained networks of the registered settings' shape (the learned
lanes, which act through the ranked view as trained policies do, the comparisons and the
tables are exercised; what PPO learns is the study's result, not a test's).
Everything else is the real code: the workload's traces, every router on every window in one
program, the metrics, the selection on the training window and the paired statistics.
"""

import json

import jax
import numpy as np
import pytest

from jaxserve.agents.defaults import make_config
from jaxserve.agents.experiments import prefix_study as P
from jaxserve.agents.experiments.prefix_routing import section_body
from jaxserve.agents.networks import make_network
from jaxserve.agents.policy import LearnedPolicy
from jaxserve.evaluation.serialize import to_jsonable
from jaxserve.traces.prefix import path_nodes, prefix_window
from jaxserve.traces.prefix_synthetic import SharedPrefixConfig, generate_shared_prefix


HEUR = ("llmd_scorers", "most_cached", "jsq_tokens", "round_robin", "sglang_cache_aware",
        "aibrix_prefix_cache")
# llm-d weights fitted in the fixture: two off the default and the default itself.
GRID = ((1.0, 0.0, 0.0), (0.0, 0.0, 1.0), (2.0, 2.0, 3.0))
# most_cached's load guards: a tight one and one that never fires (most_cached itself).
GUARDS = (1.0, 1e6)
# SGLang's (cache, balance abs, balance rel) and AIBrix's (imbalance abs, std factor): a
# tight setting and each default.
SGLANG = ((0.8, 1.0, 1.0001), (0.3, 64.0, 1.5))
AIBRIX = ((1.0, 0.5), (8.0, 1.0))
ALL_HEUR = (*HEUR, P.TUNED_LLMD, P.TUNED_GUARD, P.TUNED_SGLANG, P.TUNED_AIBRIX)


def _untrained(algo, env, params, total_steps, seeds, *, log=None, **overrides):
    assert env.ranked  # the study trains on the environment as registered
    config = make_config(algo, "LLMPrefixRouting-v0", env, None, 0)
    net = make_network(config, env.num_actions)
    obs, _ = env.reset(jax.random.PRNGKey(0), params)
    pols = [LearnedPolicy(net, net.init(jax.random.PRNGKey(s), obs)) for s in seeds]
    return pols, {"compile_s": 0.0, "run_s": 0.0, "final_return": [0.0] * len(seeds)}


@pytest.fixture(scope="module")
def result():
    mp = pytest.MonkeyPatch()
    seen = {}
    real_select = P.select_best

    def spy(per_window, heuristics, metric=P.HEADLINE):
        seen["per_window"] = per_window
        return real_select(per_window, heuristics, metric)

    mp.setattr(P, "train_agent", _untrained)
    mp.setattr(P, "select_best", spy)
    try:
        res = P.run_prefix_study(workload="system_prompts", load=1.0, seeds=(0, 1),
                                 total_steps=1024, eval_windows=2, window_requests=40,
                                 heuristics=HEUR, log=lambda msg: None, llmd_grid=GRID,
                                 guard_grid=GUARDS, sglang_grid=SGLANG,
                                 aibrix_grid=AIBRIX, keep_policies=True)
    finally:
        mp.undo()
    seen["policies"] = res.pop("policies")  # not JSON-able, as the CLI pops it
    return res, seen


def test_every_policy_has_every_metric_per_window(result):
    res, _ = result
    names = {*ALL_HEUR, "ppo_seed0", "ppo_seed1", P.LEARNED}
    for part, windows in (("eval", 2), ("train", 1)):
        pw = res["per_window"][part]
        assert set(pw) == names
        for d in pw.values():
            assert set(d) == set(P.METRICS)
            assert all(len(v) == windows and np.all(np.isfinite(v)) for v in d.values())
    ev = res["per_window"]["eval"]
    assert all(0.0 <= v <= 1.0 for d in ev.values() for v in d["token_hit_rate"])
    # Cache affinity shows even on 40 requests: llm-d hits more than round robin.
    assert np.mean(ev["llmd_scorers"]["token_hit_rate"]) > np.mean(
        ev["round_robin"]["token_hit_rate"])
    assert res["workload"]["windows"] == {"train": [0], "eval": [100, 101]}


def test_cache_use_per_policy(result):
    res, _ = result
    routing = res["routing"]
    assert set(routing) == {*ALL_HEUR, "ppo_seed0", "ppo_seed1"}
    mc = routing["most_cached"]
    assert mc["follows_most_cached"] == 1.0 and mc["load_ratio_left"] is None
    assert mc["decisions"] == 2 * 40  # two evaluation windows of 40 requests
    for u in routing.values():
        assert sum(b["decisions"] for b in u["by_load"]) == u["decisions"]
    # round robin ignores the cache: it leaves the most-cached replica on some decisions
    assert routing["round_robin"]["follows_most_cached"] < 1.0


def test_cache_use_by_hand():
    follows = np.array([[True, False, True, False], [True, True, False, True]])
    ratio = np.array([[0.5, 2.5, 1.2, 1.7], [0.9, 3.0, 0.2, 1.1]])
    u = P.cache_use(follows, ratio)
    assert u["follows_most_cached"] == 5 / 8
    assert u["load_ratio_followed"] == pytest.approx((0.5 + 1.2 + 0.9 + 3.0 + 1.1) / 5)
    assert u["load_ratio_left"] == pytest.approx((2.5 + 1.7 + 0.2) / 3)
    assert [(b["decisions"], b["leave_share"]) for b in u["by_load"]] == [
        (3, pytest.approx(1 / 3)), (2, 0.0), (1, 1.0), (2, 0.5)]
    assert u["by_load"][-1]["high"] is None  # JSON has no inf
    none_left = P.cache_use(np.ones((1, 3), bool), np.array([[0.5, 0.5, 0.5]]))
    assert none_left["load_ratio_left"] is None and none_left["by_load"][1]["leave_share"] is None


def test_best_heuristic_is_chosen_on_the_training_window_only(result):
    res, seen = result
    train, ev = res["per_window"]["train"], res["per_window"]["eval"]
    # select_best saw the training windows' values, never the evaluation windows'.
    for h in ALL_HEUR:
        np.testing.assert_array_equal(seen["per_window"][h][P.HEADLINE], train[h][P.HEADLINE])
    sel = res["selection"]
    assert sel["on"] == "training windows" and sel["metric"] == P.HEADLINE
    assert sel["values"] == {h: pytest.approx(np.mean(train[h][P.HEADLINE]))
                             for h in ALL_HEUR}
    assert sel["best"] == min(sel["values"], key=sel["values"].get)
    assert res["headline"]["best_heuristic"] == sel["best"]
    # The training window is not an evaluation window: different requests, different values.
    assert train["llmd_scorers"][P.HEADLINE] != ev["llmd_scorers"][P.HEADLINE][0]


def test_learned_minus_best_has_finite_intervals(result):
    res, _ = result
    best = res["headline"]["best_heuristic"]
    head = res["headline"][P.LEARNED]
    assert head["baseline"] == best and head["metric"] == P.HEADLINE
    assert np.isfinite([head["mean"], head["low"], head["high"]]).all()
    assert head["low"] <= head["mean"] <= head["high"]
    d = np.subtract(res["per_window"]["eval"][P.LEARNED][P.HEADLINE],
                    res["per_window"]["eval"][best][P.HEADLINE])
    assert head["mean"] == pytest.approx(d.mean())
    assert [r["learned"] for r in res["headline"]["per_seed"]] == ["ppo_seed0", "ppo_seed1"]
    for r in res["headline"]["per_seed"]:
        assert np.isfinite([r["low"], r["high"]]).all()
    # learned minus every heuristic, every metric, per seed and for the seeds together
    assert len(res["paired"]) == 3 * len(ALL_HEUR) * len(P.METRICS)


def test_format_renders_the_tables(result):
    res, _ = result
    text = P.format_prefix_study(res)
    assert text.startswith("**Learned vs the best heuristic.**")
    assert f"is `{res['headline']['best_heuristic']}`" in text
    for name in (*ALL_HEUR, "ppo_seed0", P.LEARNED):
        assert f"| `{name}`" in text
    assert f"`{P.TUNED_LLMD}` is llm-d's weighted scorers" in text
    assert f"`{P.TUNED_GUARD}` is `most_cached` with the load guard" in text
    assert f"`{P.TUNED_SGLANG}` is SGLang's `cache_aware` with the thresholds" in text
    assert "the default (0.3, 64, 1.5): " in text and "the default (8, 1): " in text
    assert "(0.80, 1.00, 1.0001)" in text  # fmt_weights keeps the digits SGLang's 1.0001 needs
    assert "| heuristic | time in system (s) |" in text
    assert "nan" not in text
    assert "How each policy uses the cache" in text and "| `most_cached` | 1.000 |" in text
    # Experiment (p)'s section, from the result as the results JSON stores it.
    body = section_body({"system_prompts@1": json.loads(json.dumps(to_jsonable(res)))},
                        "pytest")
    assert body.startswith("Command: `pytest`.")
    assert f"| system_prompts | 1 | `{P.LEARNED}` | `{res['headline']['best_heuristic']}` |" in body
    assert "### system_prompts, load 1" in body and text in body


def test_plot_cache_use_and_the_cli_rendering_a_stored_result(result, tmp_path, capsys):
    from jaxserve.scripts.prefix_study import main

    res, _ = result
    stored = tmp_path / "r.json"
    stored.write_text(json.dumps(to_jsonable(res)))  # as --out writes it
    assert main(["--from-json", str(stored), "--plot", str(tmp_path / "p.png")]) == 0
    assert capsys.readouterr().out.startswith(P.format_prefix_study(res))
    assert (tmp_path / "p.png").stat().st_size > 1000
    # Three seeds with equal leave shares: their mean rounds above their max (0.1 * 3 / 3).
    same = json.loads(json.dumps(to_jsonable(res)))
    same["headline"]["per_seed"].append({**same["headline"]["per_seed"][0],
                                         "learned": "ppo_seed2"})
    same["routing"]["ppo_seed2"] = same["routing"]["ppo_seed0"]
    for name in ("ppo_seed0", "ppo_seed1"):
        for b in same["routing"][name]["by_load"]:
            b["leave_share"] = 0.1
    assert P.plot_cache_use(same, tmp_path / "same.png").stat().st_size > 1000
    (tmp_path / "bad.json").write_text("{}")
    assert main(["--from-json", str(tmp_path / "bad.json")]) == 2
    assert "not a prefix study's result" in capsys.readouterr().err
    assert main(["--policies-from", str(tmp_path / "bad.json")]) == 2  # msgpack: an int
    assert "--policies-from" in capsys.readouterr().err
    assert main(["--policies-from", str(tmp_path / "missing.msgpack")]) == 2
    assert "not a saved policies file" in capsys.readouterr().err


def test_tuned_llmd_is_fitted_on_the_training_window(result):
    res, _ = result
    fit = res["config"]["tuned"][P.TUNED_LLMD]
    train, ev = res["per_window"]["train"], res["per_window"]["eval"]
    assert [tuple(w) for w, _ in fit["grid"]] == list(GRID)
    values = [v for _, v in fit["grid"]]
    assert fit["value"] == min(values) and tuple(fit["weights"]) == GRID[int(np.argmin(values))]
    # The default triple's lane is llm-d at its defaults, replayed with the same keys.
    assert values[2] == pytest.approx(np.mean(train["llmd_scorers"][P.HEADLINE]), abs=1e-9)
    # The fitted router, replayed with the study's other routers, scores what the fit saw.
    assert np.mean(train[P.TUNED_LLMD][P.HEADLINE]) == pytest.approx(fit["value"], abs=1e-9)
    assert np.mean(train[P.TUNED_LLMD][P.HEADLINE]) <= np.mean(
        train["llmd_scorers"][P.HEADLINE])
    assert np.isfinite(ev[P.TUNED_LLMD][P.HEADLINE]).all()
    guard = res["config"]["tuned"][P.TUNED_GUARD]
    assert [w for w, _ in guard["grid"]] == [[g] for g in GUARDS]
    g_values = [v for _, v in guard["grid"]]
    # A guard that never fires is most_cached.
    assert g_values[1] == pytest.approx(np.mean(train["most_cached"][P.HEADLINE]), abs=1e-9)
    assert np.mean(train[P.TUNED_GUARD][P.HEADLINE]) == pytest.approx(min(g_values), abs=1e-9)
    # SGLang's and AIBrix's candidates: the default's lane is the router at its defaults (the
    # thresholds reach the rule in its order), and the fitted router scores the grid's best.
    for name, grid, default in ((P.TUNED_SGLANG, SGLANG, "sglang_cache_aware"),
                                (P.TUNED_AIBRIX, AIBRIX, "aibrix_prefix_cache")):
        fit = res["config"]["tuned"][name]
        assert [tuple(w) for w, _ in fit["grid"]] == list(grid)
        values = [v for _, v in fit["grid"]]
        assert values[1] == pytest.approx(np.mean(train[default][P.HEADLINE]), abs=1e-9)
        assert np.mean(train[name][P.HEADLINE]) == pytest.approx(min(values), abs=1e-9)


def test_llmd_weights_are_checked():
    from jaxserve.policies import prefix_routing as PR

    for bad in ((1.0, 2.0), (0.0, 0.0, 0.0), (-1.0, 1.0, 1.0), (float("nan"), 1.0, 1.0)):
        with pytest.raises(ValueError, match="llm-d weights"):
            PR.llmd_weighted(bad)
    with pytest.raises(ValueError, match="llm-d weights"):
        P.fit_llmd(None, None, [], None, grid=[(0.0, 0.0, 0.0)])
    with pytest.raises(ValueError, match="SGLang thresholds"):
        P.fit_tuned(None, None, [], None, {P.TUNED_SGLANG: [(0.3, 64.0)]})
    with pytest.raises(ValueError, match="unknown fitted families"):
        P.fit_tuned(None, None, [], None, {"sita": [(1.0,)]})
    assert P.fit_tuned(None, None, [], None, {P.TUNED_AIBRIX: ()}) == {}
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="load guard"):
            PR.cache_guarded(bad)


def test_saved_networks_evaluate_again_as_they_did(result, tmp_path):
    """`trained=` (`--policies-from`) evaluates saved networks without training: the same
    decisions and metrics as the run that trained them."""
    from flax import serialization

    res, seen = result
    saved = tmp_path / "p.msgpack"
    saved.write_bytes(serialization.to_bytes(
        jax.device_get({n: p.params for n, p in seen["policies"].items()})))
    trained = serialization.msgpack_restore(saved.read_bytes())
    # The fixture's arguments but `trained=`: the same fits and the same replay program, so
    # that every program is one the fixture compiled (loaded from the compilation cache).
    again = P.run_prefix_study(workload="system_prompts", load=1.0, total_steps=1024,
                               eval_windows=2, window_requests=40, heuristics=HEUR,
                               log=lambda msg: None, llmd_grid=GRID, guard_grid=GUARDS,
                               sglang_grid=SGLANG, aibrix_grid=AIBRIX, trained=trained)
    assert again["config"]["seeds"] == [0, 1] and again["training"]["trained_earlier"]
    for part in ("eval", "train"):
        for name in ("ppo_seed0", "ppo_seed1", *ALL_HEUR):
            for m in P.METRICS:
                np.testing.assert_array_equal(again["per_window"][part][name][m],
                                              res["per_window"][part][name][m])
    with pytest.raises(ValueError, match="ppo_seed<int>"):
        P.trained_seeds({"seed0": {}})
    wrong = {"ppo_seed0": jax.tree.map(lambda x: x[..., :1], trained["ppo_seed0"])}
    with pytest.raises(ValueError, match="does not match"):
        P.run_prefix_study(workload="system_prompts", total_steps=1024, eval_windows=2,
                           window_requests=40, heuristics=HEUR[:1], log=lambda msg: None,
                           trained=wrong)


@pytest.mark.parametrize("kw, match", [
    (dict(workload="sessions"), "workload"),
    (dict(seeds=()), "seeds"),
    (dict(seeds=(1, 1)), "seeds"),
    (dict(total_steps=0), "total_steps"),
    (dict(eval_windows=1), "eval_windows"),
    (dict(heuristics=("llmd_scorers", "oracle")), "heuristic"),
    (dict(algo="a2c"), "algo"),
    (dict(train_windows=0), "train_windows"),
    (dict(train_windows=101), "train_windows"),
    (dict(load=0.0), "load"),
    (dict(load=float("nan")), "load"),
    (dict(window_requests=1), "windows of 1 requests"),
])
def test_bad_arguments_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        P.run_prefix_study(**{"total_steps": 1024, **kw}, log=lambda msg: None)


def test_system_prompts_tuning_traces_are_seeds_from_the_training_trace():
    wl = P.build_workload("system_prompts", 1.5, window_requests=40, eval_windows=2,
                          train_windows=3, log=lambda msg: None)
    assert wl["windows"] == {"train": [0, 1, 2], "eval": [100, 101]}
    assert wl["train_windows"][0] is wl["train_trace"]  # PPO's trace is the first
    one = P.build_workload("system_prompts", 1.5, window_requests=40, eval_windows=2,
                           log=lambda msg: None)
    np.testing.assert_array_equal(one["train_trace"].trace.arrival_s,
                                  wl["train_trace"].trace.arrival_s)
    assert len(one["train_windows"]) == 1
    a, b = (w.trace.prompt_tokens for w in wl["train_windows"][:2])
    assert len(a) == len(b) == 40 and not np.array_equal(a, b)


def test_spread_windows_are_disjoint_and_inside():
    rows = P.spread_windows(3008, 12031, 4, 256)
    assert rows[0][0] == 3008 and rows[-1][1] == 12031
    assert all(b - a == 256 for a, b in rows)
    assert all(rows[i][1] <= rows[i + 1][0] for i in range(3))
    with pytest.raises(ValueError, match="do not fit"):
        P.spread_windows(0, 1000, 4, 256)


def test_prefix_window_keeps_the_windows_prefixes():
    pt = generate_shared_prefix(60, SharedPrefixConfig(session_rate=2.0, turns_mean=3.0,
                                                       think_s=5.0, first_user_median=900.0),
                                seed=3)
    w = prefix_window(pt, 10, 50, time_scale=2.0)
    assert len(w) == 40 and w.trace.arrival_s[0] == 0.0
    np.testing.assert_allclose(w.trace.arrival_s,
                               2.0 * (pt.trace.arrival_s[10:50] - pt.trace.arrival_s[10]))
    np.testing.assert_array_equal(w.trace.prompt_tokens, pt.trace.prompt_tokens[10:50])
    # Same hash-id path per request; the tree holds only the window's nodes.
    for i in range(40):
        old = [pt.tree.hash_id[k] for k in path_nodes(pt.tree, int(pt.node[10 + i]))]
        new = [w.tree.hash_id[k] for k in path_nodes(w.tree, int(w.node[i]))]
        assert old == new
    assert w.tree.num_nodes < pt.tree.num_nodes
    with pytest.raises(ValueError, match="window"):
        prefix_window(pt, 50, 50)
    with pytest.raises(ValueError, match="time_scale"):
        prefix_window(pt, 0, 10, time_scale=0.0)


def test_cli_refuses_unwritable_outputs_before_any_work(tmp_path, capsys):
    """`jaxserve-prefix-study` checks --out and --save-policies before training (a full
    study runs for an hour): a folder, or a path under a file, exits 2 with one line."""
    from jaxserve.scripts.prefix_study import main

    assert main(["--out", str(tmp_path)]) == 2
    assert "--out" in capsys.readouterr().err
    (tmp_path / "f").write_text("")
    assert main(["--save-policies", str(tmp_path / "f" / "p.msgpack")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxserve-prefix-study: error: --save-policies") and "\n" == err[-1]
    assert err.count("\n") == 1


def test_rule_check_cli_errors(tmp_path, capsys):
    """`scripts/prefix_rule_check.py` refuses a missing file and an unknown network with one
    line and status 2 (its replay is the study's `replay_windows`, tested above)."""
    from flax import serialization

    from jaxserve.scripts.prefix_rule_check import main

    assert main(["--policies", str(tmp_path / "none.msgpack")]) == 2
    assert "not a saved policies file" in capsys.readouterr().err
    f = tmp_path / "p.msgpack"
    f.write_bytes(serialization.to_bytes({"ppo_seed0": {"w": np.zeros(2, np.float32)}}))
    assert main(["--policies", str(f), "--network", "ppo_seed7"]) == 2
    assert "ppo_seed7" in capsys.readouterr().err
