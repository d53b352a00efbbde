"""A learned router distilled into a rule a person could write: a depth-<= 2 tree of rules.

"The learned policy beats the rules" means little unless it also beats the simplest rule that
does what it does. This module fits that rule: a decision tree of depth at most 2 over the
policy's own observation features (the flat observation it acts on), whose leaves are either
a rule (a registered or fitted router, e.g. `sita_tuned`, `jsq`) or a fixed replica. A plain
classification tree of the policy's actions is the special case whose leaves are all fixed
replicas; a leaf that is a rule lets the tree say "in a burst of short requests, least work
left among the fast GPUs; otherwise SITA", which a replica index cannot.

Fitting (`fit_rule_tree`) reads the learned policy's decisions on *tuning* streams (its own
trajectory, `collect_decisions`): at each decision the observation, the action taken and
what every leaf option would have done in that state. The tree maximises the number of
decisions it reproduces (agreement, optionally by replica group: the same speed tier),
searched exhaustively over every depth-<= 2 tree whose split thresholds are per-feature
quantiles (`bins` of them); ties keep the smaller tree, then the lower feature, threshold and
option index. Agreement alone can pick a tree that fails where the policy rarely went (a
fixed replica for a whole burst), so `distil` fits several candidates (depth 0-2, with and
without fixed-replica leaves) and keeps the one with the lowest latency on the same tuning
streams. The fitted tree is then an ordinary policy (`RuleTree.policy`), evaluated on the
evaluation streams beside the learned policy with paired intervals (the caller's table).

What it reads: the tree reads the observation the learned policy reads; its leaf rules read
what they read as heuristics (estimates, never true output lengths), so the distilled rule is
as realisable as its parts.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.sources import mark_tuning_key
from jaxserve.evaluation.episodes import as_action
from jaxserve.evaluation.evaluate import (_run_policies, asked_along_rollout, make_streams,
                                          summarise, trace_env)

_NO_SPLIT = -1


@dataclasses.dataclass(frozen=True, eq=False)
class RuleTree:
    """A depth-<= 2 tree over flat observation features with a rule or a replica per leaf.

    A decision goes left at a node when `obs[feature] <= threshold` (float32), else right.
    Nodes are the root (0) and its left (1) and right (2) children; a node whose feature is
    -1 does not split (both of its leaves are the same). Leaves, in order: (root left, child
    left), (root left, child right), (root right, child left), (root right, child right).

    Attributes:
      feature: `(3,)` observation feature per node (-1: no split).
      threshold: `(3,)` float32 thresholds (ignored where the node does not split).
      leaf: `(4,)` index into `options` per leaf.
      options: leaf option names: a rule's name, or `"replica k"` for a fixed replica.
      feature_names: a name per observation feature (for `describe`).
      agreement: share of the fitting decisions the tree reproduces, in [0, 1].
      best_single: the best single option's share on the same decisions (a depth-0 tree).
      decisions: how many decisions it was fitted on.
      selection: `((candidate, tuning latency s), ...)` when `distil` chose it by latency.
      chosen: the chosen candidate's label ("" when fitted directly).
    """

    feature: tuple[int, int, int]
    threshold: tuple[float, float, float]
    leaf: tuple[int, int, int, int]
    options: tuple[str, ...]
    feature_names: tuple[str, ...]
    agreement: float
    best_single: float
    decisions: int
    selection: tuple = ()
    chosen: str = ""

    def leaf_of(self, x) -> jax.Array:
        """The leaf (0-3, int32) a flat observation `x` falls in (jittable)."""
        f, t = self.feature, self.threshold

        def right(node):
            if f[node] == _NO_SPLIT:
                return jnp.bool_(False)
            return x[f[node]] > jnp.float32(t[node])

        r0 = right(0)
        return jnp.where(r0, 2 + right(2).astype(jnp.int32),
                         right(1).astype(jnp.int32)).astype(jnp.int32)

    def policy(self, rules: Mapping[str, Callable], name: str = "distilled") -> Callable:
        """The tree as a policy `(key, obs, state, params) -> int32 replica`.

        `rules` maps the rule options' names to policies (the ones it was fitted with); only
        the rules some leaf uses are evaluated. The policy hashes by identity, so it can be a
        static argument of `jax.jit` (as `evaluate_many` uses policies)."""
        used = sorted({self.leaf[i] for i in range(4)})
        acts = []
        for o in used:
            opt = self.options[o]
            if opt.startswith("replica "):
                acts.append(lambda key, obs, state, params, k=int(opt.split()[1]): jnp.int32(k))
            elif opt in rules:
                acts.append(rules[opt])
            else:
                raise ValueError(f"RuleTree.policy: rule {opt!r} is a leaf but not in rules "
                                 f"(given: {sorted(rules)})")
        slot = np.zeros(len(self.options), np.int32)
        slot[used] = np.arange(len(used))
        leaf_slot = jnp.asarray(slot[list(self.leaf)], jnp.int32)

        def distilled(key, obs, state, params):
            x = jnp.asarray(obs, jnp.float32).reshape(-1)
            options = jnp.stack([as_action(a(key, obs, state, params)) for a in acts])
            return options[leaf_slot[self.leaf_of(x)]]

        distilled.__name__ = name
        return distilled

    def describe(self) -> str:
        """The tree as nested if/else text, e.g. for a table's note."""
        names = self.feature_names

        def cond(node):
            return f"{names[self.feature[node]]} <= {self.threshold[node]:.4g}"

        def side(node, leaves):
            a, b = (self.options[self.leaf[i]] for i in leaves)
            if self.feature[node] == _NO_SPLIT:
                return a
            return f"({cond(node)} ? {a} : {b})"

        if self.feature[0] == _NO_SPLIT:
            return self.options[self.leaf[0]]
        return f"{cond(0)} ? {side(1, (0, 1))} : {side(2, (2, 3))}"


@partial(jax.jit, static_argnames=("env_t", "policy", "rules"))
def _decisions(env_t, policy, rules, params, streams, keys):
    """Per stream and decision: flat observation, action taken, every rule's action."""

    def one(stream, key):
        p = params.replace(trace=stream)

        def ask(kp, obs, state, a):
            others = jnp.stack([as_action(r(kp, obs, state, p)) for r in rules])
            return jnp.asarray(obs, jnp.float32).reshape(-1), a, others

        return asked_along_rollout(env_t, policy, p, key, ask)

    return jax.vmap(one)(streams, keys)


def collect_decisions(env, params, policy: Callable, rules: Mapping[str, Callable], key,
                      num_envs: int = 8, num_steps: int = 1024, warmup: int = 64):
    """The learned policy's decisions on its own trajectories, with every rule's answer.

    Args:
      env (Environment): a routing environment (synthetic arrivals).
      params (ServingParams): its parameters.
      policy (Callable): the policy to distil, `policy(key, obs, state, params)`.
      rules (Mapping[str, Callable]): `{name: policy}` asked at every decision, never acting.
      key (jax.Array): a tuning key (recorded as one: evaluation must not reuse it).
      num_envs (int): streams.
      num_steps (int): requests per stream.
      warmup (int): first decisions of each stream left out.

    Returns:
      (x, action, rule_actions): `(N, F)` float32 flat observations, `(N,)` int32 actions taken, `(N, R)` int32 each rule's action,
        `N = num_envs * (num_steps - warmup)`.
    """
    if not 0 <= warmup < num_steps:
        raise ValueError(f"collect_decisions: need 0 <= warmup < num_steps, got {warmup}, "
                         f"{num_steps}")
    key = mark_tuning_key(key)
    streams, keys = make_streams(key, params, int(num_envs), int(num_steps), None)
    env_t = trace_env(env, streams.gap.shape[1])
    x, a, others = jax.device_get(_decisions(env_t, policy, tuple(rules.values()), params,
                                             streams, keys))
    x = np.asarray(x)[:, warmup:].reshape(-1, np.asarray(x).shape[-1])
    a = np.asarray(a)[:, warmup:].reshape(-1)
    others = np.asarray(others)[:, warmup:].reshape(-1, len(rules))
    return x, a, others


def _bin_edges(x: np.ndarray, bins: int) -> list[np.ndarray]:
    """Candidate thresholds per feature: its distinct values when few, else quantiles; the
    largest value is dropped (a split there sends everything left)."""
    edges = []
    for col in x.T:
        u = np.unique(col)
        e = u if u.size <= bins else np.unique(
            np.quantile(col, np.arange(1, bins + 1) / (bins + 1), method="lower"))
        edges.append(e[e < u[-1]].astype(np.float32))
    return edges


def _best_split(onehot: np.ndarray, agree: np.ndarray, width: np.ndarray):
    """Best depth-1 split of the rows `agree` `(N, K)` (0/1 per leaf option; a row outside
    the node is all zeros, so every node is one matrix product over all rows).

    `onehot` `(N, F * B)` is each row's bin per feature (bin b: between edges b-1 and b);
    returns `(score, feature, bin, left option, right option)`; `feature = -1` when no split
    beats the best single option."""
    n_f = width.shape[0]
    total = agree.sum(0)
    best = (float(total.max()), _NO_SPLIT, 0, int(total.argmax()), int(total.argmax()))
    hist = (onehot.T @ agree).reshape(n_f, -1, agree.shape[1])  # (F, B, K)
    left = np.cumsum(hist, axis=1)[:, :-1]  # x <= edge b
    right = total[None, None] - left
    score = left.max(-1) + right.max(-1)  # (F, B - 1)
    valid = np.arange(score.shape[1])[None] < width[:, None]
    score = np.where(valid, score, -1.0)
    f, b = np.unravel_index(int(np.argmax(score)), score.shape)
    if score[f, b] > best[0] + 1e-9:
        best = (float(score[f, b]), int(f), int(b), int(left[f, b].argmax()),
                int(right[f, b].argmax()))
    return best


def fit_rule_tree(x: np.ndarray, action: np.ndarray, rule_actions: np.ndarray,
                  rule_names: Sequence[str], num_actions: int, *, groups=None, bins: int = 8,
                  feature_names: Sequence[str] | None = None, max_depth: int = 2,
                  fixed_leaves: bool = True) -> RuleTree:
    """The depth-<= `max_depth` tree of rules that reproduces the most of the given decisions.

    Args:
      x: `(N, F)` flat observations; action: `(N,)` the learned policy's actions;
      rule_actions: `(N, R)` each rule's action in the same states; rule_names: the R names.
      num_actions: replicas (fixed-replica leaves `"replica 0"` ... are added).
      groups (array-like | None): optional `(num_actions,)` group per replica: an option agrees with a decision
        when it picks a replica of the same group (e.g. speed tier). Default: the same replica.
      bins: candidate thresholds per feature (quantiles of the fitting data).
      feature_names: a name per feature (default `"obs[i]"`).
      max_depth: 0 (the single best option), 1 or 2.
      fixed_leaves: whether a leaf may be a fixed replica (else only rules).

    Returns:
      the fitted `RuleTree` (searched exhaustively over all trees up to `max_depth` on the
      bins).
    """
    x = np.asarray(x, np.float32)
    action = np.asarray(action, np.int64)
    rule_actions = np.asarray(rule_actions, np.int64)
    if x.ndim != 2 or x.shape[0] == 0 or action.shape != (x.shape[0],):
        raise ValueError(f"fit_rule_tree: need x (N, F) with N >= 1 and action (N,), got "
                         f"{x.shape}, {action.shape}")
    if x.shape[0] >= 2 ** 24:
        raise ValueError(f"fit_rule_tree: {x.shape[0]} decisions; at most 2^24 - 1 (counts "
                         "are float32)")
    if rule_actions.ndim != 2 or rule_actions.shape[0] != x.shape[0] \
            or rule_actions.shape[1] != len(rule_names):
        raise ValueError(f"fit_rule_tree: rule_actions {rule_actions.shape} must be (N, R) "
                         f"with N = {x.shape[0]} rows and R = {len(rule_names)} rule columns")
    if bins < 1:
        raise ValueError(f"fit_rule_tree: bins must be >= 1, got {bins}")
    if max_depth not in (0, 1, 2):
        raise ValueError(f"fit_rule_tree: max_depth must be 0, 1 or 2, got {max_depth}")
    if not fixed_leaves and not len(rule_names):
        raise ValueError("fit_rule_tree: no leaf options (no rules and fixed_leaves=False)")
    g = np.arange(num_actions) if groups is None else np.asarray(groups, np.int64)
    if g.shape != (num_actions,):
        raise ValueError(f"fit_rule_tree: groups must have one entry per replica "
                         f"({num_actions}), got shape {g.shape}")
    fixed = num_actions if fixed_leaves else 0
    options = tuple(rule_names) + tuple(f"replica {k}" for k in range(fixed))
    choices = np.concatenate([rule_actions, np.broadcast_to(np.arange(fixed),
                                                            (x.shape[0], fixed))], 1)
    # float32 counts are exact below 2^24 decisions.
    agree = (g[np.clip(choices, 0, num_actions - 1)] == g[action][:, None]).astype(np.float32)
    edges = _bin_edges(x, bins)
    width = np.asarray([e.size for e in edges])
    n_b = bins + 1
    binned = np.stack([np.searchsorted(e, x[:, f], side="left") for f, e in enumerate(edges)],
                      1)  # bin b <=> edge[b-1] < x <= edge[b]
    onehot = np.zeros((x.shape[0], x.shape[1] * n_b), np.float32)
    onehot[np.arange(x.shape[0])[:, None], np.arange(x.shape[1]) * n_b + binned] = 1.0
    n = float(x.shape[0])
    root_alone = _best_split(onehot, agree, width)
    single = int(agree.sum(0).argmax())
    best = (float(agree.sum(0).max()), (_NO_SPLIT, _NO_SPLIT, _NO_SPLIT), (0.0, 0.0, 0.0),
            (single,) * 4)
    if root_alone[1] != _NO_SPLIT and max_depth >= 1:
        f, b = root_alone[1], root_alone[2]
        best = (root_alone[0], (f, _NO_SPLIT, _NO_SPLIT), (float(edges[f][b]), 0.0, 0.0),
                (root_alone[3], root_alone[3], root_alone[4], root_alone[4]))
    for f in range(x.shape[1] if max_depth == 2 else 0):
        for b in range(width[f]):
            go_left = binned[:, f] <= b
            if go_left.all() or not go_left.any():
                continue
            sides = [_best_split(onehot, agree * m[:, None], width)
                     for m in (go_left, ~go_left)]
            score = sides[0][0] + sides[1][0]
            if score > best[0] + 1e-9:
                (_, fl, bl, l0, l1), (_, fr, br, r0, r1) = sides
                best = (score, (f, fl, fr),
                        (float(edges[f][b]), float(edges[fl][bl]) if fl >= 0 else 0.0,
                         float(edges[fr][br]) if fr >= 0 else 0.0),
                        (l0, l1, r0, r1))
    names = (tuple(feature_names) if feature_names is not None
             else tuple(f"obs[{i}]" for i in range(x.shape[1])))
    if len(names) != x.shape[1]:
        raise ValueError(f"fit_rule_tree: {len(names)} feature names for {x.shape[1]} features")
    score, feat, thr, leaf = best
    return RuleTree(feature=tuple(int(v) for v in feat),
                    threshold=tuple(float(np.float32(v)) for v in thr),
                    leaf=tuple(int(v) for v in leaf), options=options, feature_names=names,
                    agreement=score / n, best_single=float(agree.sum(0).max()) / n,
                    decisions=int(n))


# The candidate trees `distil` compares: (max_depth, fixed_leaves). Depth 0 is the single
# option that agrees most; rules-only trees cannot send a burst to one fixed replica, which a
# tree fitted for agreement alone may do in a state it rarely saw.
CANDIDATES = ((2, True), (2, False), (1, True), (1, False), (0, False))


def _tuning_latency(env, params, pols: Sequence[Callable], key, num_envs: int, num_steps: int,
                    warmup: int) -> list[float]:
    """Drop-inclusive mean latency (s) of each policy on the tuning streams of `key` (one
    program, common random numbers, as `evaluate_many` but on tuning streams)."""
    streams, keys = make_streams(key, params, int(num_envs), int(num_steps), None)
    env_t = trace_env(env, streams.gap.shape[1])
    out = jax.device_get(_run_policies(env_t, tuple(pols), params, streams, keys, True))
    return [float(summarise(jax.tree.map(lambda v, i=i: v[i], out), streams, params,
                            warmup)["mean_latency_incl_drops"]) for i in range(len(pols))]


def distil(env, params, policy: Callable, rules: Mapping[str, Callable], key, *,
           num_envs: int = 8, num_steps: int = 1024, warmup: int = 64, groups=None,
           bins: int = 8, feature_names: Sequence[str] | None = None,
           name: str = "distilled", select: str = "latency") -> tuple[Callable, RuleTree]:
    """`collect_decisions`, then the distilled rule: fitted trees, one chosen on tuning data.

    Agreement is the fitting target, but a tree that agrees with 90% of the decisions may
    still send a burst to one fixed replica in a state it rarely saw and lose badly; so with
    `select="latency"` (default) each of `CANDIDATES` (depth 0-2, with and without fixed-replica
    leaves) is fitted for agreement and the one with the lowest drop-inclusive mean latency on
    the *tuning* streams (the same streams, replayed) is kept. `select="agreement"` keeps the
    depth-2 tree with fixed leaves (the most agreeing). `key` is a tuning key (streams the
    evaluation does not use).

    Returns:
      `(policy, tree)`: the policy reads the observation and what its leaf rules read;
      `tree.selection` lists each candidate's tuning latency (s) when chosen by latency.
    """
    if select not in ("latency", "agreement"):
        raise ValueError(f"distil: select must be 'latency' or 'agreement', got {select!r}")
    x, a, others = collect_decisions(env, params, policy, rules, key, num_envs, num_steps,
                                     warmup)
    fit = partial(fit_rule_tree, x, a, others, tuple(rules), env.num_actions, groups=groups,
                  bins=bins, feature_names=feature_names)
    if select == "agreement":
        tree = fit()
        return tree.policy(rules, name), tree
    trees, seen = [], set()
    for depth, fixed in CANDIDATES:
        t = fit(max_depth=depth, fixed_leaves=fixed)
        sig = (t.feature, t.threshold, tuple(t.options[i] for i in t.leaf))
        if sig not in seen:  # the same rule fitted twice is evaluated once
            seen.add(sig)
            trees.append((f"depth <= {depth}, {'fixed replicas allowed' if fixed else 'rules only'}",
                          t))
    pols = [t.policy(rules, name) for _, t in trees]
    lat = _tuning_latency(env, params, pols, key, num_envs, num_steps, warmup)
    i = int(np.argmin(lat))
    tree = dataclasses.replace(trees[i][1], selection=tuple(
        (label, float(v)) for (label, _), v in zip(trees, lat)), chosen=trees[i][0])
    return pols[i], tree
