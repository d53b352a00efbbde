"""The distilled rule (evaluation.distill): a depth-<= 2 tree of rules fitted to a policy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxserve
from jaxserve import policies
from jaxserve.core.sources import is_tuning_key, tuning_key
from jaxserve.evaluation import evaluate_many
from jaxserve.evaluation.distill import distil, fit_rule_tree


def _planted(n=4000, seed=0):
    """Decisions of a known depth-2 rule tree over 3 features with rules "a", "b" (4 replicas):
    x0 <= 0.5 -> rule a; else x2 <= 0.25 -> replica 3, else rule b."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(size=(n, 3)).astype(np.float32)
    rule_a = rng.integers(0, 4, n)
    rule_b = rng.integers(0, 4, n)
    action = np.where(x[:, 0] <= 0.5, rule_a, np.where(x[:, 2] <= 0.25, 3, rule_b))
    return x, action, np.stack([rule_a, rule_b], 1)


def test_a_planted_tree_is_recovered():
    x, action, rules = _planted()
    # 16 quantile bins put an edge within 1/17 of each planted threshold; the agreement lost
    # is the share of rows between the planted threshold and the nearest edge, where the
    # random rule actions agree by chance at most: below 5% at these sizes.
    tree = fit_rule_tree(x, action, rules, ("a", "b"), 4, bins=16,
                         feature_names=("x0", "x1", "x2"))
    assert tree.feature[0] == 0 and tree.feature[2] == 2
    assert abs(tree.threshold[0] - 0.5) < 0.07 and abs(tree.threshold[2] - 0.25) < 0.07
    assert tree.options[tree.leaf[0]] == "a" and tree.options[tree.leaf[1]] == "a"
    assert tree.options[tree.leaf[2]] == "replica 3" and tree.options[tree.leaf[3]] == "b"
    assert tree.agreement > 0.95 and tree.best_single < 0.7
    assert tree.describe().startswith("x0 <= ")
    # Exact thresholds when the data's edges sit on them: agreement 1.
    x2 = x.copy()
    x2[:, 0] = np.where(x[:, 0] <= 0.5, 0.25, 0.75)
    x2[:, 2] = np.where(x[:, 2] <= 0.25, 0.0, 1.0)
    assert fit_rule_tree(x2, action, rules, ("a", "b"), 4).agreement == 1.0


def test_no_split_when_one_rule_explains_everything():
    x, _, rules = _planted(500)
    tree = fit_rule_tree(x, rules[:, 1], rules, ("a", "b"), 4)
    assert tree.feature == (-1, -1, -1) and tree.agreement == 1.0
    assert tree.describe() == "b"


def test_groups_count_a_replica_of_the_same_group_as_agreeing():
    x = np.zeros((10, 1), np.float32)
    action = np.arange(10) % 2  # replicas 0 and 1, one group
    rules = np.full((10, 1), 1)
    assert fit_rule_tree(x, action, rules, ("r",), 2).agreement == 0.5
    tree = fit_rule_tree(x, action, rules, ("r",), 2, groups=[0, 0])
    assert tree.agreement == 1.0


@pytest.mark.parametrize("kw, match", [
    ({"bins": 0}, "bins"),
    ({"groups": [0, 1]}, "groups"),
    ({"feature_names": ("x",)}, "feature names"),
])
def test_bad_arguments_refused(kw, match):
    x, action, rules = _planted(50)
    with pytest.raises(ValueError, match=match):
        fit_rule_tree(x, action, rules, ("a", "b"), 4, **kw)
    with pytest.raises(ValueError, match="rule columns"):
        fit_rule_tree(x, action, rules, ("a",), 4)
    with pytest.raises(ValueError, match="N >= 1"):
        fit_rule_tree(x[:0], action[:0], rules[:0], ("a", "b"), 4)


def test_a_rule_distilled_from_itself_is_itself_on_evaluation_streams():
    """Distilling `jsq` with `jsq` among the leaves gives a tree that reproduces every decision
    and, as a policy, the same latencies on evaluation streams it was not fitted on."""
    env, params = jaxserve.make("Routing-v0")
    rules = {n: policies.get(n, kind="routing") for n in ("least_work_left", "jsq")}
    eval_key = jax.random.PRNGKey(3)
    key = tuning_key(eval_key)
    pol, tree = distil(env, params, rules["jsq"], rules, key, num_envs=2, num_steps=64,
                       warmup=8, feature_names=env.feature_names)
    assert is_tuning_key(key)
    assert tree.agreement == 1.0 and tree.decisions == 2 * 56
    # Chosen by tuning latency among the candidates (every one of them here reproduces jsq).
    assert tree.chosen and len(tree.selection) >= 1
    assert all(np.isfinite(v) for _, v in tree.selection)
    assert "jsq" in {tree.options[i] for i in tree.leaf}
    res = evaluate_many(env, params, {"jsq": rules["jsq"], "distilled": pol}, eval_key,
                        num_envs=2, num_steps=64)
    np.testing.assert_array_equal(res["jsq"]["per_env"]["latency_incl_drops"],
                                  res["distilled"]["per_env"]["latency_incl_drops"])


def test_tree_policy_under_jit_and_vmap_and_missing_rule():
    x, action, rules = _planted(300)
    tree = fit_rule_tree(x, action, rules, ("a", "b"), 4)
    # Rules that read the observation only, so the policy runs on observation batches.
    fake = {"a": lambda k, o, s, p: jnp.int32(0), "b": lambda k, o, s, p: jnp.int32(1)}
    pol = tree.policy(fake)
    obs = jnp.asarray(x[:64])
    out = jax.jit(jax.vmap(lambda o: pol(jax.random.PRNGKey(0), o, None, None)))(obs)
    leaf = np.asarray(jax.vmap(tree.leaf_of)(obs))
    want = np.asarray([{"a": 0, "b": 1}.get(tree.options[tree.leaf[i]],
                                            int(tree.options[tree.leaf[i]].split()[-1])
                                            if tree.options[tree.leaf[i]].startswith("replica")
                                            else -1) for i in leaf])
    np.testing.assert_array_equal(np.asarray(out), want)
    assert {"a", "b"} <= {tree.options[i] for i in tree.leaf}  # the planted tree's leaves
    with pytest.raises(ValueError, match="not in rules"):
        tree.policy({"a": fake["a"]})


def test_depth_and_leaf_options_restrict_the_tree():
    x, action, rules = _planted()
    t0 = fit_rule_tree(x, action, rules, ("a", "b"), 4, max_depth=0)
    assert t0.feature == (-1, -1, -1) and t0.agreement == t0.best_single
    t1 = fit_rule_tree(x, action, rules, ("a", "b"), 4, max_depth=1)
    assert t1.feature[1:] == (-1, -1) and t0.agreement <= t1.agreement
    t2 = fit_rule_tree(x, action, rules, ("a", "b"), 4, fixed_leaves=False)
    assert t2.options == ("a", "b") and t2.agreement <= fit_rule_tree(
        x, action, rules, ("a", "b"), 4).agreement
    with pytest.raises(ValueError, match="max_depth"):
        fit_rule_tree(x, action, rules, ("a", "b"), 4, max_depth=3)
    with pytest.raises(ValueError, match="no leaf options"):
        fit_rule_tree(x, action, rules[:, :0], (), 4, fixed_leaves=False)
