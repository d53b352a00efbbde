"""Evaluation: the CRN harness (`evaluate`, `evaluate_many`), load sweeps and SLO capacity,
trace replay, and plots (`jaxserve.evaluation.plots`, imported on demand: matplotlib)."""

from jaxserve.evaluation.capacity import capacity, sweep_rates
from jaxserve.evaluation.evaluate import evaluate, evaluate_many
from jaxserve.evaluation.replay import replay
from jaxserve.evaluation.tuning import tune_static  # also registers the tuned_static policy

__all__ = ["capacity", "evaluate", "evaluate_many", "replay", "sweep_rates", "tune_static"]
