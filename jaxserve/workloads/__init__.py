"""Workload models built on the serving engine (`jaxserve.core`).

`rollout`: the rollout-serving workload of RL training loops (one iteration submits K
generation requests at once to r inference replicas, then trains); see docs/scaling.md.
"""

from jaxserve.workloads.rollout import (
    RULES,
    RolloutParams,
    default_tokens,
    make_params,
    pareto_front,
    rule_index,
    simulate,
    simulate_iteration,
    sweep,
    sweep_raw,
    tabulate,
    validate_params,
)

__all__ = [
    "RULES",
    "RolloutParams",
    "default_tokens",
    "make_params",
    "pareto_front",
    "rule_index",
    "simulate",
    "simulate_iteration",
    "sweep",
    "sweep_raw",
    "tabulate",
    "validate_params",
]
