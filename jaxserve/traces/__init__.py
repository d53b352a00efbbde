"""Public request traces: loaders for the real trace formats and summary statistics.

See `jaxserve.traces.loaders`, `jaxserve.traces.trace_stats` and docs/traces.md. The trace files themselves are public data
on GitHub, listed with their upstream URL, licence and sha256 in `jaxserve.traces.registry`;
`fetch(name)` (or `jaxserve-traces fetch NAME`) downloads one into the user cache and
`path(name)` finds it (under `$JAXSERVE_TRACES_DIR`, then in the cache), hash-checked.
"""

from jaxserve.traces.loaders import (
    FORMATS,
    LoadReport,
    TraceFormatError,
    detect_format,
    load,
    load_azure_functions_2019,
    load_azure_functions_2021,
    load_azure_llm_2023,
    load_azure_llm_reencoded,
    load_burstgpt,
    load_burstgpt_with_report,
    load_with_report,
)
from jaxserve.traces.trace_stats import summary, summary_table

__all__ = [
    "FORMATS",
    "LoadReport",
    "TraceFormatError",
    "detect_format",
    "load",
    "load_azure_functions_2019",
    "load_azure_functions_2021",
    "load_azure_llm_2023",
    "load_azure_llm_reencoded",
    "load_burstgpt",
    "load_burstgpt_with_report",
    "load_with_report",
    "summary",
    "summary_table",
]

# Shaping traces for RL (load rescaling, windows), workload fitting, synthetic BurstGPT-like
# traces: see docs/traces.md.
from jaxserve.traces.fitting import (  # noqa: E402
    MMPPFit,
    WorkloadFit,
    count_iod,
    fit_mmpp,
    fit_report,
    fit_table,
    fit_tokens,
    fit_workload,
    mmpp_gap_moments,
    mmpp_iod,
    mmpp_stats,
    sample_arrivals_jax,
    sample_mmpp,
    sample_tokens_np,
    sample_workload,
)
from jaxserve.traces.shaping import (  # noqa: E402
    cluster_capacity,
    offered_load,
    rescale_to_load,
    window_trace,
    windows,
)
from jaxserve.traces.synthetic import (  # noqa: E402
    DEFAULT_BURST,
    BurstProfile,
    burstgpt_like,
    burstgpt_profile,
    burstgpt_stats,
    default_traces_dir,
    published_stats,
)

from jaxserve.traces.registry import REGISTRY, TraceFile  # noqa: E402
from jaxserve.traces.store import (  # noqa: E402
    TraceNotFoundError,
    fetch,
    find,
    path,
    resolve,
)

__all__ += [
    "REGISTRY", "TraceFile", "TraceNotFoundError", "fetch", "find", "path", "resolve",
    "MMPPFit", "WorkloadFit", "count_iod", "fit_mmpp", "fit_report", "fit_table", "fit_tokens",
    "fit_workload", "mmpp_gap_moments", "mmpp_iod", "mmpp_stats", "sample_arrivals_jax",
    "sample_mmpp", "sample_tokens_np", "sample_workload",
    "cluster_capacity", "offered_load", "rescale_to_load", "window_trace",
    "windows",
    "DEFAULT_BURST", "BurstProfile", "burstgpt_like", "burstgpt_profile", "burstgpt_stats",
    "default_traces_dir", "published_stats",
]
