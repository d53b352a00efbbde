"""Named workloads for Autoscaling-v0 built from the public Azure LLM 2023 traces.

`jaxserve.make("Autoscaling-v0", workload=NAME, load=RHO)` accepts:
  - "diurnal" (the default): Poisson arrivals under a compressed-day sine cycle.
  - "azure_conv" / "azure_code": replay of the Azure LLM inference trace 2023 (conversation /
    code), time-stretched (`traces.rescale_to_load`) so that its offered load on the
    `max_replicas` cluster is `load`; one episode is the whole trace.
  - "azure_conv_mmpp" / "azure_code_mmpp": the same trace's statistics, not its requests: a
    2-phase MMPP fitted to the stretched trace (rate, inter-arrival CV, index of dispersion at
    1 s and 60 s; `traces.fit_mmpp`) and its empirical token lengths. Train on these, evaluate
    on the replay: the agent never sees the evaluation requests.
  - "azure_conv_train" / "azure_conv_test" (and "azure_code_..."): the stretched replay cut
    by `core.sources.split_trace` into its first `TRAIN_FRACTION` of requests and the
    disjoint rest (rebased to start at 0): train on the first (e.g. from random offsets,
    `random_offset=1`), evaluate on the second.
Trace files are found with `jaxserve.traces.path` (registry names in `TRACE_FILES`: under
`$JAXSERVE_TRACES_DIR`, else in the user cache that `jaxserve-traces fetch NAME` fills); a
missing file raises a ValueError (`traces.TraceNotFoundError`) naming that command.
"""

from __future__ import annotations

import functools

from jaxserve import traces as T
from jaxserve.core.sources import split_trace

TRACE_FILES = {  # workload -> `jaxserve.traces.registry` name
    "azure_conv": "azure_llm_2023_conv",
    "azure_code": "azure_llm_2023_code",
}
PARTS = ("train", "test")
WORKLOADS = ("diurnal", *TRACE_FILES, *(f"{k}_{s}" for k in TRACE_FILES
                                       for s in ("mmpp", *PARTS)))
DEFAULT_LOAD = 0.2
TRAIN_FRACTION = 0.5  # of the requests; the conversation trace's slow rise is in the first half


@functools.lru_cache(maxsize=4)
def _load(name: str):
    try:
        path = T.path(TRACE_FILES[name])
    except T.TraceNotFoundError as e:
        raise T.TraceNotFoundError(f"workload {name!r} needs a trace file: {e}") from None
    return T.load(path)


def workload_overrides(workload: str, gpus, load: float | None) -> dict:
    """Keyword overrides of `make_autoscaling` for a named workload (see the module doc).

    Returns `{}` for "diurnal"; otherwise `trace=` (replay) or `arrivals=` and `tokens=`
    (fitted), with `diurnal_amplitude=0`.

    Raises:
      ValueError: unknown workload, a missing trace file, or `load` not in (0, 1.5].
    """
    if workload not in WORKLOADS:
        raise ValueError(f"unknown Autoscaling-v0 workload {workload!r}; choose from {WORKLOADS}")
    if workload == "diurnal":
        if load is not None:
            raise ValueError("load= applies to trace workloads; for 'diurnal' set arrival_rate")
        return {}
    load = DEFAULT_LOAD if load is None else float(load)
    if not 0.0 < load <= 1.5:
        raise ValueError(f"load must be in (0, 1.5] (offered load of the whole cluster), got "
                         f"{load}")

    base = next(k for k in TRACE_FILES if workload == k or workload.startswith(k + "_"))
    part = workload[len(base) + 1:] or None  # None (the whole replay), "mmpp" or a part
    trace, _ = T.rescale_to_load(_load(base), list(gpus), load)
    if part in PARTS:
        trace = split_trace(trace, TRAIN_FRACTION)[PARTS.index(part)]
    if part != "mmpp":
        return {"trace": trace, "diurnal_amplitude": 0.0}
    fit = T.fit_mmpp(trace)
    return {"arrivals": fit.arrivals, "tokens": T.fit_tokens(trace, "empirical"),
            "diurnal_amplitude": 0.0}
