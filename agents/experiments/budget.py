"""How much each experiment trains and evaluates: quick (2-core CPU), full (GPU), tiny (tests)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Budget:
    """Training and evaluation sizes shared by the experiments.

    Attributes:
      name: "quick", "full" or "tiny" (recorded in the results).
      seeds: training seeds (all trained in one vmapped program per algorithm and scenario).
      routing_steps, batching_steps: environment steps per training run.
      eval_envs, eval_steps, warmup: evaluation replicates, requests per replicate, and the
        first requests of each excluded from the statistics.
      batching_loads: offered loads (fraction of full-batch capacity) of experiment (b).
      sweep_rates: loads (fraction of full-batch capacity) of the capacity grid (c).
      sweep_envs, sweep_steps: environments and requests per rate of that grid.
      tune_envs, tune_steps: tuned_static's grid search (on tuning keys).
      gen_windows: trace windows (replicates) per workload in (d).
      algos: the learning algorithms (`agents.defaults.ALGOS` keys).
      skip: experiment keys this budget leaves out unless asked for by name (`--only`).
    """

    name: str
    seeds: tuple[int, ...]
    routing_steps: int
    batching_steps: int
    eval_envs: int
    eval_steps: int
    warmup: int
    batching_loads: tuple[float, ...]
    sweep_rates: tuple[float, ...]
    sweep_envs: int
    sweep_steps: int
    tune_envs: int
    tune_steps: int
    gen_windows: int
    algos: tuple[str, ...] = ("ppo", "reinforce")
    skip: tuple[str, ...] = ()


BUDGETS = {
    "quick": Budget("quick", seeds=(0, 1, 2), routing_steps=98_304, batching_steps=49_152,
                    eval_envs=8, eval_steps=384, warmup=32,
                    batching_loads=(0.3, 0.7, 0.95),
                    sweep_rates=(0.3, 0.5, 0.7, 0.85, 1.0, 1.2), sweep_envs=4, sweep_steps=384,
                    tune_envs=4, tune_steps=384, gen_windows=8, skip=("f", "p", "x", "y")),
    "full": Budget("full", seeds=(0, 1, 2, 3, 4), routing_steps=1_048_576,
                   batching_steps=524_288, eval_envs=32, eval_steps=2000, warmup=200,
                   batching_loads=(0.3, 0.5, 0.7, 0.85, 0.95),
                   sweep_rates=(0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.4),
                   sweep_envs=16, sweep_steps=2000, tune_envs=16, tune_steps=2000,
                   gen_windows=16),
    "tiny": Budget("tiny", seeds=(0,), routing_steps=2048, batching_steps=2048, eval_envs=2,
                   eval_steps=48, warmup=4, batching_loads=(0.5,), sweep_rates=(0.3, 0.9),
                   sweep_envs=2, sweep_steps=48, tune_envs=2, tune_steps=48, gen_windows=2,
                   algos=("ppo",), skip=("f", "p", "x", "y")),
}
