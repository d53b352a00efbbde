"""Moved to `jaxserve.core.stats` (statistics are needed below the evaluation layer too, e.g. by
`workloads.rollout`); this name re-exports it for code written against the old path."""

from jaxserve.core.stats import (paired_difference, percentile_with_drops,  # noqa: F401
                                 percentiles, percentiles_jax, seed_env_bootstrap, t_halfwidth)
