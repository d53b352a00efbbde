"""Public request traces: loaders for the real trace formats and summary statistics.

See `jaxserve.traces.loaders` and docs/traces.md.
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
    summary,
    summary_table,
)

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
