"""scripts/reproduce.py's experiments on a tiny budget: the page is written with its sections,
tables, figures and finite numbers; and the small pieces they rest on.

The smoke test trains for a few hundred steps with one seed, so it checks the plumbing
(training in one program, evaluation, tables, figures), not what the agents learn: the
learning claims are in tests/test_learnable.py and docs/results.md.
"""

import json
import re

import jax
import numpy as np
import pytest

import jaxserve
from jaxserve.agents.experiments import BUDGETS, EXPERIMENTS, Context, run_experiments
from jaxserve.agents.experiments.common import fmt, paired_across_seeds, stack_params, table
from jaxserve.agents.experiments.report import write_results
from jaxserve.agents.experiments.routing import capacity_from_sweep

SMOKE = ["a"]  # the smallest experiment: one training and one evaluation program to compile


def _finite_numbers(x):
    if isinstance(x, dict):
        return all(_finite_numbers(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return all(_finite_numbers(v) for v in x)
    if isinstance(x, (float, np.floating)):
        return bool(np.isfinite(x))
    return True




@pytest.fixture(scope="module")
def page(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    ctx = Context(BUDGETS["tiny"], "pytest tests/test_reproduce.py", progress=False)
    sections = run_experiments(ctx, SMOKE)
    md = write_results(sections, ctx, out / "results.md", out / "figures", 1.0)
    return md, sections


def test_page_has_sections_and_tables(page):
    md, sections = page
    text = md.read_text()
    assert [s.key for s in sections] == SMOKE
    assert text.startswith("# Results")
    assert "## (a) Study-compatible scenario" in text
    assert "*Made by `pytest tests/test_reproduce.py`, experiment (a)" in text
    for row in ("| ppo |", "| round_robin |", "| jsq |", "| random |", "| the study (RL router) |"):
        assert row in text
    assert (md.with_suffix(".json")).exists()


def test_confirmation_protocol_uses_seeds_and_streams_the_pick_was_not_made_on():
    """(y) re-measures a row of (x) with seeds disjoint from (x)'s and on an evaluation key
    index no other experiment uses; the variant is one (x) trains."""
    import inspect

    from jaxserve.agents.experiments import ablation, confirmation
    for budget in ("quick", "full", "tiny"):
        proto = confirmation.protocol(budget)
        assert not set(proto["seeds"]) & set(ablation.SEEDS[budget])
        assert proto["variant"] in [v[0] for v in ablation.VARIANTS]
    salts = set()
    for mod in ("routing", "batching", "generalisation", "routing_win", "llm_routing_study"):
        src = inspect.getsource(__import__(f"jaxserve.agents.experiments.{mod}", fromlist=["x"]))
        salts |= {int(m) for m in __import__("re").findall(r"eval_key\((\d+)", src)}
    assert confirmation.STREAMS_SALT not in salts | set(range(70, 70 + 8))


@pytest.mark.slow
def test_batching_experiment_writes_its_table_and_figure(tmp_path):
    """Experiment (b) on the tiny budget: four more programs to compile (minutes on CPU)."""
    ctx = Context(BUDGETS["tiny"], "pytest b", progress=False)
    sections = run_experiments(ctx, ["b"])
    md = write_results(sections, ctx, tmp_path / "r.md", tmp_path / "figures", 1.0)
    text = md.read_text()
    assert "## (b) One GPU: batching" in text
    for col in ("ppo", "greedy", "size_or_timeout", "tuned_static", "smdp_optimal"):
        assert col in text
    assert (tmp_path / "figures" / "results_batching.png").stat().st_size > 1000
    assert "figures/results_batching.png" in text
    # (mean, CI) pairs: the means are finite; one seed has no CI across seeds (NaN).
    data = sections[0].data
    for name, scen in data.items():
        if name not in ("exact_scan", "training_episodes"):
            for v in scen.values():  # (mean, CI) pairs, scalars, the tuned (B, tau), labels
                assert isinstance(v, str) or _finite_numbers(v[0] if isinstance(v, tuple) else v)
    assert _finite_numbers(data["exact_scan"]) and _finite_numbers(data["training_episodes"])
    assert 0 < data["exact_scan"]["max_gap"] < data["exact_scan"]["max_greedy_gap"]
    # Always waiting drops requests; the time-discounted objective the agents train on
    # prefers greedy (undiscounted returns over a fixed number of decisions need not).
    ep = data["training_episodes"]
    for g, w in zip(ep["greedy"], ep["wait"]):
        assert w["drops"] > g["drops"] and w["discounted_return"] < g["discounted_return"]
    assert not re.search(r"\bnan\b", text)


def test_page_numbers_are_finite(page):
    md, sections = page
    text = md.read_text()
    rows = [ln for ln in text.splitlines() if ln.startswith("| ")]
    assert rows
    for ln in rows:
        assert not re.search(r"\bnan\b|\binf\b", ln), ln
    for s in sections:
        assert _finite_numbers(s.data), s.key
    lat = sections[0].data["latency"]
    assert set(lat) >= {"ppo", "round_robin", "jsq", "random"}
    assert all(v > 0 for v in lat.values())


def test_unknown_experiment_is_an_error():
    ctx = Context(BUDGETS["tiny"], "x", progress=False)
    with pytest.raises(ValueError, match="unknown experiment"):
        run_experiments(ctx, ["zz"])
    assert sorted(e.key for e in EXPERIMENTS) == ["a", "b", "c", "d", "e", "f", "p", "w", "x",
                                                  "y"]


def test_capacity_from_sweep_takes_the_first_failure():
    rows = [{"rate": r, "p99_with_drops": p} for r, p in
            [(1.0, 10.0), (2.0, 50.0), (3.0, 70.0), (4.0, 20.0)]]
    assert capacity_from_sweep(rows, 60.0) == 2.0  # 4.0 meets it again, but 3.0 did not
    assert capacity_from_sweep(rows, 5.0) == 0.0
    assert capacity_from_sweep(rows[:2], 60.0) == 2.0


def test_stack_params_checks_shapes():
    _, p1 = jaxserve.make("Batching-v0", arrival_rate=0.2)
    _, p2 = jaxserve.make("Batching-v0", arrival_rate=0.4)
    st = stack_params([p1, p2])
    np.testing.assert_allclose(np.asarray(st.arrivals.rates)[:, 0], [0.2, 0.4], rtol=1e-6)
    _, p3 = jaxserve.make("Routing-v0")
    with pytest.raises(ValueError):
        stack_params([p1, p3])


def test_paired_across_seeds_and_formatting():
    res = {"h": {"per_env": {"latency_incl_drops": np.array([10.0, 12.0, 14.0])}},
           "ppo-s0": {"per_env": {"latency_incl_drops": np.array([8.0, 10.0, 12.0])}},
           "ppo-s1": {"per_env": {"latency_incl_drops": np.array([9.0, 11.0, 13.0])}}}
    d = paired_across_seeds(res, "ppo", "h")
    assert d["mean"] == pytest.approx(-1.5) and d["seeds"] == 2
    assert d["wins"] == 2 and d["losses"] == 0  # constant differences: zero-width CIs
    assert fmt(float("nan")) == "n/a" and fmt(1.23456, 0.01) == "1.23 ± 0.01"
    assert table(["a", "b"], [[1, 2]]).splitlines()[2] == "| 1 | 2 |"


def test_cli_errors_are_one_line(tmp_path, capsys):
    from jaxserve.scripts.reproduce import main
    assert main(["--budget", "nope"]) == 2
    assert main(["--budget", "tiny", "--only", "zz", "--out", str(tmp_path / "r.md")]) == 2
    err = capsys.readouterr().err
    assert "unknown experiment" in err and "Traceback" not in err
    assert not (tmp_path / "r.md").exists()


def test_budget_skip_leaves_out_the_long_studies_unless_named():
    """quick and tiny skip the LLM study (f), the prefix-routing study (p), the ablation (x)
    and its confirmation (y); full runs every experiment; naming a skipped one runs it."""
    from jaxserve.agents.experiments.registry import select
    keys = [e.key for e in EXPERIMENTS]
    long_ones = {"f", "p", "x", "y"}
    assert long_ones <= set(keys)
    for budget in ("quick", "tiny"):
        assert set(BUDGETS[budget].skip) == long_ones
        chosen = [e.key for e in select(None, BUDGETS[budget].skip)]
        assert chosen == sorted(set(keys) - long_ones)
    assert [e.key for e in select(None, BUDGETS["full"].skip)] == sorted(keys)
    for k in sorted(long_ones):
        assert [e.key for e in select([k], BUDGETS["quick"].skip)] == [k]


def test_partial_run_merges_into_the_page(tmp_path):
    """`--only b` rewrites section (b) and its JSON entry; (a) and (c) keep their text and the
    command and commit that wrote them (an old-style page's run line is carried into them)."""
    from jaxserve.agents.experiments.common import Section
    from jaxserve.agents.experiments.report import split_page
    md = tmp_path / "results.md"
    md.write_text("# Results\n\nThis run: `python scripts/reproduce.py --quick` (budget `quick`"
                  "), at commit `abc1234` (plus ...); wall time **1 min**.\n\n"
                  "## (a) First\n\n*Wall time of this experiment: 5 s.*\n\nold a\n\n"
                  "### sub of a\n\ntable a\n\n## (b) Second\n\nold b\n\n## (c) Third\n\nold c\n")
    md.with_suffix(".json").write_text('{"a": {"x": 1}, "b": {"y": 2}, "c": {"z": 3}}')
    sec = Section("(b) Second", "new b", data={"y": 5.0})
    sec.key, sec.wall_s = "b", 7.0
    ctx = Context(BUDGETS["tiny"], "python scripts/reproduce.py --only b", progress=False)
    write_results([sec], ctx, md, tmp_path / "figures", 1.0, merge=True)
    pre, blocks = split_page(md.read_text())
    assert list(blocks) == ["a", "b", "c"]
    assert "old a" in blocks["a"] and "### sub of a\n\ntable a" in blocks["a"]
    assert "*Written by `python scripts/reproduce.py --quick` at commit `abc1234`.*" \
        in blocks["a"] and "old c" in blocks["c"]
    assert "new b" in blocks["b"] and "old b" not in blocks["b"]
    assert "*Written by `python scripts/reproduce.py --only b` at commit" in blocks["b"]
    assert "kept (a), (c)" in pre
    assert json.loads(md.with_suffix(".json").read_text()) == {
        "a": {"x": 1}, "b": {"y": 5.0}, "c": {"z": 3}}
    # A second partial run keeps (a)'s provenance as it is (no second line).
    write_results([sec], ctx, md, tmp_path / "figures", 1.0, merge=True)
    assert split_page(md.read_text())[1]["a"].count("*Written by") == 1
    # `--only ""`: no experiment runs; every section and the JSON stay as they are and the
    # run line says only the summary was rewritten.
    before_blocks, before_json = split_page(md.read_text())[1], md.with_suffix(".json").read_text()
    write_results([], ctx, md, tmp_path / "figures", 1.0, merge=True)
    pre, blocks = split_page(md.read_text())
    assert blocks == before_blocks and md.with_suffix(".json").read_text() == before_json
    assert "it ran no experiment and rewrote only the summary" in pre
    # Without merge the page holds only what was run.
    write_results([sec], ctx, md, tmp_path / "figures", 1.0)
    assert list(split_page(md.read_text())[1]) == ["b"]


def test_stale_note_flags_routing_sections_written_before_an_information_change():
    """A kept routing section written before `INFORMATION_CHANGES` is named in the preamble; one
    written after, and a section with no router in it, are not. Needs the repository's history
    (a shallow checkout cannot tell ancestry: then the note is empty and the test skips)."""
    from jaxserve.agents.experiments.report import _is_ancestor, stale_note

    before, after = "8a9a35b", "1447f4e"  # (a)'s and (w)'s provenance commits on the page
    if _is_ancestor("f3d97b3", after) is not True or _is_ancestor("f3d97b3", before) is not False:
        pytest.skip("no git history to read ancestry from")
    line = "*Written by `python scripts/reproduce.py --quick` at commit `{}`, budget `quick`.*"
    blocks = {"a": "## (a) x\n\n" + line.format(before) + "\n| jsq | 1 |\n",
              "b": "## (b) batching\n\n" + line.format(before) + "\n| greedy | 1 |\n",
              "w": "## (w) y\n\n" + line.format(after) + "\n| sita | 1 |\n"}
    note = stale_note(blocks)
    # Only (a) is listed, once per change: (b) names no router, (w) is newer than both.
    assert "sections (a) predate commit `f3d97b3`" in note
    assert "sections (a) predate commit `0658cc1`" in note
    assert "sections (a) predate commit `eafe997`" in note
    assert stale_note({"w": blocks["w"]}) == ""


def test_headline_summary_reads_w_and_states_each_verdict(tmp_path):
    """The page's summary table: one row per (w) scenario, the verdict from the paired CI's
    sign, the best clairvoyant reference, the budget curve; nothing without (w). And (w)'s
    figures draw."""
    from jaxserve.agents.experiments.report import headline_summary
    from jaxserve.agents.experiments.routing_win import _plot_budget, _plot_to_fast

    def scen(diff, to_fast):
        return {"latency": {"ppo": 10.0, "sita_tuned": 11.0, "jsq": 20.0,
                            "sita, true lengths": 9.0, "sed, true lengths": 9.5},
                "best_heuristic": "sita_tuned",
                "diff_vs_best": dict(zip(("mean", "low", "high"), diff)),
                "to_fast": {"ppo": to_fast, "sita_tuned": [[0.2, 0.9], [0.1, None]]},
                "budget_curve": [{"env_steps": 1000 * k, "mean": 20.0 - k, "low": 19.0 - k,
                                  "high": 21.0 - k} for k in (1, 2)],
                "best_heuristic_ci": {"mean": 11.0, "low": 10.5, "high": 11.5},
                "clairvoyant": {"name": "sita, true lengths", "mean": 9.0}}
    data = {"w": {"win": scen((-1.0, -1.5, -0.5), [[0.2, 0.9], [0.5, None]]),
                  "loss": scen((2.0, 0.5, 3.0), [[0.2, 0.9], [0.5, 0.4]]),
                  "tie": scen((0.1, -0.2, 0.4), [[0.2, 0.9], [0.5, 0.4]])}}
    text = headline_summary(data)
    rows = {line.split(" | ")[0][2:]: line for line in text.splitlines() if line.startswith("| ")
            and not line.startswith("| scenario")}
    assert set(rows) == {"win", "loss", "tie"}
    assert ("learned better than the registered rule" in rows["win"]
            and "registered rule better" in rows["loss"])
    assert "no difference resolved" in rows["tie"]
    assert all("sita, true lengths 9 | 1k: 19, 2k: 18 |" in r for r in rows.values())
    assert all("| not measured | " in r for r in rows.values())  # no distilled rule in this data
    data["w"]["win"]["diff_vs_distilled"] = {"mean": -0.5, "low": -0.9, "high": -0.1}
    row = next(line for line in headline_summary(data).splitlines() if line.startswith("| win"))
    assert "| -0.5 [-0.9, -0.1] | learned better than the registered rule and its distilled" in row
    del data["w"]["win"]["diff_vs_distilled"]
    assert headline_summary({"a": {}}) == ""
    # (x)'s best PPO variant (lowest mean; clones and least_marginal are not candidates) gets
    # a row against (x)'s heuristic, with a note pointing to the confirmatory runs.
    data["w"]["short_bursts"] = scen((0.1, -0.2, 0.4), [[0.2, 0.9], [0.5, 0.4]])
    diff = {"mean": -1.2, "low": -1.9, "high": -0.6}
    data["x"] = {"ppo": {"mean": 12.0, "diff_vs_heuristic": {"mean": 0.1, "low": -1, "high": 1}},
                 "ppo, no shaping": {"mean": 10.8, "diff_vs_heuristic": diff},
                 "ppo, x: the clone, before PPO": {"mean": 1.0, "diff_vs_heuristic": diff},
                 "sita_tuned": {"mean": 12.0}, "least_marginal": {"mean": 17.0}}
    text = headline_summary(data)
    row = next(line for line in text.splitlines() if "(x)" in line and line.startswith("| "))
    assert row.startswith("| short_bursts, (x): ppo, no shaping | ppo, no shaping 10.8 | "
                          "sita_tuned 12 | -1.2 [-1.9, -0.6] | not measured | learned better "
                          "than the registered rule | sita, true lengths 9 |")
    # With its distilled rule measured, "better" needs a win over that rule too; the distilled
    # row itself is not a candidate for the best variant.
    data["x"]["ppo, no shaping"]["diff_vs_distilled"] = {"mean": 0.1, "low": -0.2, "high": 0.4}
    data["x"]["ppo, no shaping: distilled rule (tree of depth <= 2)"] = {
        "mean": 10.7, "diff_vs_heuristic": diff}
    row = next(line for line in headline_summary(data).splitlines()
               if "(x)" in line and line.startswith("| "))
    assert ("| -1.2 [-1.9, -0.6] | +0.1 [-0.2, +0.4] | learned better than the registered "
            "rule, not than its distilled rule |") in row
    del data["x"]["ppo, no shaping"]["diff_vs_distilled"]
    del data["x"]["ppo, no shaping: distilled rule (tree of depth <= 2)"]
    assert "confirmations.md" in text and "(y) row" not in text
    # (y), the confirmation of that pick on fresh seeds and streams, gets its own row, named
    # by its protocol, whichever way it falls.
    data["y"] = {"ppo, no shaping": {"mean": 11.5, "diff_vs_heuristic":
                                     {"mean": -0.3, "low": -0.9, "high": 0.2}},
                 "sita_tuned": {"mean": 11.8}, "least_marginal": {"mean": 16.0},
                 "protocol": {"variant": "ppo, no shaping", "heuristic": "sita_tuned",
                              "seeds": list(range(8, 24))}}
    text = headline_summary(data)
    row = next(line for line in text.splitlines() if "(y)" in line and line.startswith("| "))
    assert row.startswith("| short_bursts, (y): ppo, no shaping confirmed on 16 seeds (x) did not "
                          "use, fresh streams | ppo, no shaping 11.5 | sita_tuned 11.8 | "
                          "-0.3 [-0.9, +0.2] | not measured | no difference resolved |")
    assert "the (y) row re-measures that pick" in text
    assert "| not measured on these streams |" in row  # (w)'s bound is on other streams
    data["y"]["clairvoyant"] = {"name": "sita, true lengths", "mean": 8.5}
    data["y"]["ppo, no shaping"]["burst_short_to_fast"] = 0.7
    data["y"]["sita_tuned"]["burst_short_to_fast"] = 0.17
    text = headline_summary(data)
    row = next(line for line in text.splitlines() if "(y)" in line and line.startswith("| "))
    assert "| sita, true lengths 8.5 | not measured |" in row
    assert "sends 70% of the short requests to the fast GPUs, `sita_tuned` 17%" in text
    del data["w"]["short_bursts"], data["x"], data["y"]
    for d in data["w"].values():  # JSON turns NaN (no request of the class) into None
        d["to_fast"] = {k: [[np.nan if x is None else x for x in r] for r in v]
                        for k, v in d["to_fast"].items()}
    _plot_to_fast(data["w"], tmp_path / "w.png")
    assert (tmp_path / "w.png").stat().st_size > 1000
    _plot_budget(data["w"], tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 1000


@pytest.mark.slow
def test_train_scenarios_checkpoints_are_the_same_run_cut_into_parts():
    """`train_scenarios(checkpoints=K)` runs the same updates as K=1 (the final networks agree
    to float32 reassociation) and keeps the network after each part; an earlier checkpoint
    differs from the final one, and K must divide the updates."""
    from jaxserve.agents.experiments.common import train_scenarios

    env, params = jaxserve.make("Routing-v0")
    one, _ = train_scenarios("Routing-v0", env, [params], "ppo", (0,), 2048)
    two, curves = train_scenarios("Routing-v0", env, [params], "ppo", (0,), 2048,
                                  checkpoints=2)
    final, first = curves["checkpoint_policies"][0][0][1], curves["checkpoint_policies"][0][0][0]
    assert list(curves["checkpoint_steps"]) == [1024, 2048]
    for a, b, c in zip(jax.tree.leaves(one[0][0].params), jax.tree.leaves(two[0][0].params),
                       jax.tree.leaves(final.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(b), np.asarray(c))
    assert any(not np.allclose(np.asarray(a), np.asarray(b)) for a, b in
               zip(jax.tree.leaves(first.params), jax.tree.leaves(final.params)))
    with pytest.raises(ValueError, match="checkpoints"):
        train_scenarios("Routing-v0", env, [params], "ppo", (0,), 2048, checkpoints=3)


@pytest.mark.slow
def test_ablation_cli_runs_chosen_variants_with_diagnostics(tmp_path, capsys, monkeypatch):
    """(x) through `python -m jaxserve.scripts.ablate` at the tiny budget: two variants that share one
    training program (only a parameter differs) and an imitation warm start (its own
    program, with its clone's row), sita_tuned and least_marginal beside them, the paired
    columns, the agreement diagnostics and (`--distill`) each variant's distilled rule; bad
    input exits 2 without a traceback.

    The warm start runs a shorter imitation than `agents.imitation.DEFAULTS` (the same code
    path; only scan lengths and the demonstration batch shrink): the default 512
    demonstration steps x 300 Adam steps ran 11 s on CPU, for rows whose values are not
    checked here."""
    from jaxserve.agents import imitation
    from jaxserve.scripts.ablate import main
    monkeypatch.setitem(imitation.DEFAULTS, "num_steps", 32)
    monkeypatch.setitem(imitation.DEFAULTS, "epochs", 8)
    out = tmp_path / "x.md"
    assert main(["--budget", "tiny", "--variants",
                 "ppo,uninformative-estimate,imitation-warm-start",
                 "--seeds", "3", "--eval-seed", "5", "--distill", "--out", str(out)]) == 0
    text = out.read_text()
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines()
            if line.startswith("| ")}
    assert {"ppo", "ppo, uninformative estimate", "ppo, imitation warm start",
            "ppo, imitation warm start: the clone, before PPO", "sita_tuned",
            "least_marginal"} <= set(rows)
    assert "seeds 3 (1)" in text and "PRNGKey(5)" in text
    # --distill: each variant's distilled rule is a row, its tree is printed, and the policy
    # is paired against it.
    assert "ppo: distilled rule (tree of depth <= 2)" in rows
    assert re.search(r"- `ppo` seed 3: `.+` \(depth <= \d, .+; reproduces \d+% of \d+ tuning "
                     r"decisions\)", text)
    assert "ppo against its distilled rule: " in text
    # The variant's paired difference against ppo, and agreement shares as percentages.
    assert re.search(r"\| [+-][\d.]+ \[[+-][\d.]+, [+-][\d.]+\] \|",
                     rows["ppo, uninformative estimate"])
    assert re.search(r"\d+% / ", rows["ppo"])
    assert main(["--budget", "tiny", "--variants", "ppo,nope"]) == 2
    assert main(["--budget", "tiny", "--seeds", "4-1"]) == 2
    assert main(["--budget", "tiny", "--heuristic", "sed_oracle"]) == 2
    err = capsys.readouterr().err
    assert "unknown variant" in err and "--seeds" in err and "unknown heuristic" in err
    assert "Traceback" not in err
