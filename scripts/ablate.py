"""Runs experiment (x)'s ablations with chosen variants, seeds and evaluation key.

    python -m jaxserve.scripts.ablate --variants ppo,no-shaping --seeds 8-23 --eval-seed 2027 \\
        --out runs/confirm.md

The confirmatory runs of a difference (x) found: fresh training seeds and fresh evaluation
and tuning streams. `scripts/reproduce.py --only x` runs (x) itself into docs/results.md.
"""

from __future__ import annotations

import sys

from jaxserve.agents.experiments.ablation import main

if __name__ == "__main__":
    sys.exit(main())
