"""Turning result pytrees (numpy / jax scalars and arrays) into JSON-ready Python values."""

import numpy as np


def to_jsonable(x):
    """`x` with dicts, sequences and numpy values made JSON-ready; non-finite floats become None."""
    if isinstance(x, dict):
        return {str(k): to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return to_jsonable(x.tolist())
    if isinstance(x, (np.floating, float)):
        return float(x) if np.isfinite(x) else None
    if isinstance(x, (np.integer,)):
        return int(x)
    return x
