"""Tests of jaxserve.traces.loaders on the real public traces and on small synthetic files.

The real files are found with `jaxserve.traces.find` (under JAXSERVE_TRACES_DIR, which
tests/conftest.py points at `../shared/traces` beside the repository when it exists, else in the
user cache); tests that need them are skipped when they are absent. Expected numbers are the
statistics table of the trace mirror's README, compared with a tolerance of half a unit in the
last printed digit.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest

from jaxserve.core.types import Trace
from jaxserve.traces import find as find_trace
from jaxserve.traces import (
    FORMATS,
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

HOW = "set JAXSERVE_TRACES_DIR or run `jaxserve-traces fetch --all`"
CODE = find_trace("azure_llm_2023_code")
CONV = find_trace("azure_llm_2023_conv")
BURST = find_trace("burstgpt_first30")
BURST_AGG = find_trace("burstgpt_aggregates")
FN21 = find_trace("azure_functions_2021_sample")


@pytest.fixture(scope="module")
def traces_dir() -> None:
    """Skips unless every public trace file these tests read is available."""
    if None in (CODE, CONV, BURST, BURST_AGG, FN21):
        pytest.skip(f"public trace files not available ({HOW})")


@pytest.fixture(scope="module")
def code(traces_dir):
    return load_with_report(CODE)


@pytest.fixture(scope="module")
def conv(traces_dir):
    return load_with_report(CONV)


def close_to_printed(value: float, printed: str) -> bool:
    """True when `value` rounds to the README's printed number (half a unit in the last digit)."""
    s = printed.replace(",", "").replace("−", "-")
    decimals = len(s.split(".")[1]) if "." in s else 0
    return abs(value - float(s)) <= 0.5 * 10.0 ** -decimals + 1e-9


def assert_printed(stats: dict, expected: dict) -> None:
    bad = {k: (stats[k], v) for k, v in expected.items() if not close_to_printed(stats[k], v)}
    assert not bad, f"summary differs from README (got, printed): {bad}"


# README statistics table, as printed.
README_ARRIVALS = {
    "code": dict(rows="8819", span_s="3436", mean_rate="2.566", cv_interarrival="13.15",
                 peak_to_mean_1s="26.1", peak_count_1s="67", peak_to_mean_60s="4.16",
                 peak_count_60s="632", iod_1s="13.2", iod_60s="160.5"),
    "conv": dict(rows="19366", span_s="3502", mean_rate="5.530", cv_interarrival="1.09",
                 peak_to_mean_1s="2.89", peak_count_1s="16", peak_to_mean_60s="1.54",
                 peak_count_60s="507", iod_1s="1.39", iod_60s="20.6"),
    "burst": dict(rows="30", span_s="2288", mean_rate="0.0127", cv_interarrival="0.83",
                  peak_to_mean_1s="76.3", peak_to_mean_60s="3.9", iod_1s="0.99",
                  iod_60s="0.83"),
    "fn21": dict(rows="199", span_s="1200", mean_rate="0.165", cv_interarrival="1.86",
                 peak_to_mean_1s="132.8", peak_to_mean_60s="4.43", iod_1s="8.25",
                 iod_60s="10.1"),
}
README_TOKENS = {
    "code": dict(prompt_mean="2048", prompt_p50="1469", prompt_p90="5188", prompt_p99="7436",
                 output_mean="27.9", output_p50="13", output_p90="55", output_p99="251",
                 corr_pearson="0.001", corr_spearman="-0.021", corr_pearson_log1p="-0.004"),
    "conv": dict(prompt_mean="1155", prompt_p50="1020", prompt_p90="2735", prompt_p99="4142",
                 output_mean="211", output_p50="129", output_p90="424", output_p99="601",
                 corr_pearson="-0.112", corr_spearman="0.073", corr_pearson_log1p="0.088"),
    # With failed='keep_as_one' the failed row has tokens (1, 1) instead of the file's (0, 0):
    # means move by 1/30 and log1p-Pearson changes (0.357 vs 0.426), checked separately.
    "burst": dict(prompt_mean="591", prompt_p50="490", prompt_p90="1368", prompt_p99="1561",
                  output_mean="343", output_p50="285", output_p90="508", output_p99="1363",
                  corr_pearson="-0.019", corr_spearman="0.105"),
}


# ------------------------------------------------------------------------------------------
# Real files
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["code", "conv"])
def test_azure_llm_2023_matches_readme(name, code, conv):
    trace, report = {"code": code, "conv": conv}[name]
    assert isinstance(trace, Trace)
    assert report.format == "azure_llm_2023"
    assert report.rows_read == report.rows_loaded == len(trace)
    assert report.clipped == {"prompt_tokens": 0, "output_tokens": 0}  # no zeros upstream
    assert trace.arrival_s.dtype == np.float64 and trace.arrival_s[0] == 0.0
    assert np.all(np.diff(trace.arrival_s) >= 0)
    s = summary(trace)
    assert_printed(s, README_ARRIVALS[name])
    assert_printed(s, README_TOKENS[name])


def test_azure_llm_2023_timestamps_exact(code, conv):
    trace, report = conv
    assert report.origin == "2023-11-16 18:15:46.6805900"
    # 18:15:50.9951690 - 18:15:46.6805900 and 18:15:51.2224670 - ...: exact to 1e-7 s.
    assert trace.arrival_s[1] == 4.314579
    assert trace.arrival_s[2] == 4.541877
    # Last row 19:14:08.4025270: 58 min 21.7219370 s after the first.
    assert trace.arrival_s[-1] == 3501.721937
    ctrace, creport = code
    assert creport.origin == "2023-11-16 18:17:03.9799600"
    assert ctrace.arrival_s[1] == 0.052 and ctrace.arrival_s[2] == 0.098189
    assert ctrace.arrival_s[-1] == 3435.948056
    # Every arrival is an exact multiple of 1e-7 s (7 fractional digits kept).
    ticks = ctrace.arrival_s * 1e7
    assert np.max(np.abs(ticks - np.rint(ticks))) < 1e-3


def test_reencoded_round_trip(code, tmp_path):
    """Writes the code trace in vidur's re-encoded form (in tmp) and reads it back."""
    trace, _ = code
    f = tmp_path / "splitwise_code.csv"
    with open(f, "w", newline="") as fh:
        fh.write("arrived_at,num_prefill_tokens,num_decode_tokens\n")
        for a, p, o in zip(trace.arrival_s, trace.prompt_tokens, trace.output_tokens):
            fh.write(f"{float(a)!r},{p},{o}\n")
    assert detect_format(f) == "azure_llm_reencoded"
    back = load(f)
    np.testing.assert_array_equal(back.arrival_s, trace.arrival_s)
    np.testing.assert_array_equal(back.prompt_tokens, trace.prompt_tokens)
    np.testing.assert_array_equal(back.output_tokens, trace.output_tokens)
    assert load_azure_llm_reencoded(f).arrival_s.shape == (8819,)


def test_burstgpt_failed_rows(traces_dir):
    trace, rep = load_burstgpt_with_report(BURST)  # default: failed='drop'
    assert len(trace) == 29 and rep.rows_read == 30 and rep.rows_loaded == 29
    assert rep.excluded == {"model": 0, "log_type": 0, "failed": 1}
    s = summary(trace)
    assert s["prompt_p50"] == 507 and s["output_p50"] == 293  # README: failed row excluded
    assert np.all(trace.output_tokens >= 1) and np.all(trace.prompt_tokens >= 1)

    kept, rep = load_burstgpt_with_report(BURST, failed="keep_as_one")
    assert len(kept) == 30 and rep.excluded["failed"] == 0
    assert "line(s) 22" in rep.notes[0]
    i = np.flatnonzero(kept.arrival_s == 1106 - 5)[0]
    assert kept.prompt_tokens[i] == 1 and kept.output_tokens[i] == 1

    with pytest.raises(TraceFormatError) as e:
        load_burstgpt(BURST, failed="error")
    assert str(BURST) in str(e.value) and "line 22" in str(e.value)
    assert "Response tokens == 0" in str(e.value) and e.value.line == 22
    with pytest.raises(ValueError, match="failed must be"):
        load_burstgpt(BURST, failed="ignore")


def test_burstgpt_matches_readme(traces_dir):
    trace = load(BURST, failed="keep_as_one")  # README statistics use every row
    assert detect_format(BURST) == "burstgpt"
    s = summary(trace)
    assert_printed(s, README_ARRIVALS["burst"])
    assert_printed(s, README_TOKENS["burst"])
    # README log1p-Pearson 0.426 uses the file's raw (0, 0) for the failed row.
    assert close_to_printed(s["corr_pearson_log1p"], "0.357")


def test_burstgpt_filters(traces_dir):
    chat, rep = load_burstgpt_with_report(BURST, models=("ChatGPT",))
    assert len(chat) == 22 and rep.excluded == {"model": 7, "log_type": 0, "failed": 1}
    chat_all = load_burstgpt(BURST, models=["ChatGPT"], failed="keep_as_one")
    assert len(chat_all) == 23
    gpt4, rep = load_burstgpt_with_report(BURST, models=("GPT-4",))
    assert len(gpt4) == 7 and rep.excluded == {"model": 23, "log_type": 0, "failed": 0}
    assert gpt4.arrival_s[0] == 0.0 and rep.origin == "118"  # rebased to the first kept row
    conv_log = load_burstgpt(BURST, log_types=("Conversation log",))
    assert len(conv_log) == 29
    with pytest.raises(TraceFormatError, match="no rows left after exclusions"):
        load_burstgpt(BURST, log_types=("API log",))
    with pytest.raises(ValueError, match="sequence of names"):
        load_burstgpt(BURST, models="ChatGPT")


def test_azure_functions_2021_matches_readme(traces_dir):
    trace, rep = load_with_report(FN21)
    assert rep.format == "azure_functions_2021" and len(trace) == 199
    assert_printed(summary(trace), README_ARRIVALS["fn21"])
    # Tokens: prompt constant 512, output = max(1, rint(duration * 50)).
    with open(FN21, newline="") as f:
        rows = list(csv.DictReader(f))
    end = np.array([float(r["end_timestamp"]) for r in rows])
    dur = np.array([float(r["duration"]) for r in rows])
    order = np.argsort(end - dur, kind="stable")
    np.testing.assert_allclose(trace.arrival_s, (end - dur)[order] - (end - dur).min(),
                               atol=1e-9)
    np.testing.assert_array_equal(trace.output_tokens,
                                  np.maximum(1, np.rint(dur[order] * 50)).astype(int))
    assert np.all(trace.prompt_tokens == 512)
    # 1000 tokens/s makes output tokens = duration in ms: README duration statistics (s).
    ms = load_azure_functions_2021(FN21, tokens_per_second=1000, prompt_tokens=7)
    assert np.all(ms.prompt_tokens == 7)
    s = {k: v / 1000 for k, v in summary(ms).items() if k.startswith("output_")}
    assert_printed(s, dict(output_mean="53.3", output_p50="1.63", output_p90="202.8",
                           output_p99="358.1"))


def test_detect_format_real_files(traces_dir):
    assert detect_format(CODE) == detect_format(CONV) == "azure_llm_2023"
    assert detect_format(BURST) == "burstgpt"
    assert detect_format(FN21) == "azure_functions_2021"
    with pytest.raises(TraceFormatError) as e:  # JSON aggregates: no known header
        detect_format(BURST_AGG)
    assert "line 1" in str(e.value) and "unrecognized header" in str(e.value)
    # format= overrides detection; a wrong one names the missing columns.
    with pytest.raises(TraceFormatError) as e:
        load(BURST, format="azure_llm_2023")
    assert "line 1" in str(e.value) and "'TIMESTAMP'" in str(e.value)
    with pytest.raises(ValueError, match="unknown trace format"):
        load(BURST, format="sharegpt")
    assert load(CODE, format="azure_llm_2023").arrival_s.shape == (8819,)


def test_summary_table_renders(code):
    table = summary_table([("code", code[0])])
    assert "| code | 8819 | 3435.95 |" in table


# ------------------------------------------------------------------------------------------
# Synthetic files
# ------------------------------------------------------------------------------------------


def write(tmp_path: Path, name: str, text: str, newline: str = "\n") -> Path:
    p = tmp_path / name
    p.write_bytes(text.replace("\n", newline).encode())
    return p


def test_azure_llm_crlf_offsets_and_fractions(tmp_path):
    f = write(tmp_path, "a.csv",
              "TIMESTAMP,ContextTokens,GeneratedTokens\n"
              "2024-05-10 00:00:00.009930+00:00,10,2\n"
              "2024-05-10T00:00:01Z,11,3\n"
              "2024-05-10 02:00:01.5+02:00,12,4", newline="\r\n")  # no final newline
    trace, rep = load_with_report(f)
    assert rep.format == "azure_llm_2023" and rep.origin == "2024-05-10 00:00:00.009930+00:00"
    np.testing.assert_array_equal(trace.arrival_s, [0.0, 0.99007, 1.49007])
    np.testing.assert_array_equal(trace.prompt_tokens, [10, 11, 12])
    # Across midnight and a month boundary, with 7 fractional digits.
    g = write(tmp_path, "b.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                 "2023-01-31 23:59:59.9999999,1,1\n"
                                 "2023-02-01 00:00:00.0000001,1,1\n")
    assert load(g).arrival_s[1] == 2e-7


def test_zero_tokens_policy(tmp_path):
    f = write(tmp_path, "z.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                 "2023-11-16 18:00:00.0,5,0\n"
                                 "2023-11-16 18:00:01.0,0,7\n"
                                 "2023-11-16 18:00:02.0,3,4\n")
    trace, rep = load_with_report(f)
    assert rep.clipped == {"prompt_tokens": 1, "output_tokens": 1}
    np.testing.assert_array_equal(trace.output_tokens, [1, 7, 4])
    np.testing.assert_array_equal(trace.prompt_tokens, [5, 1, 3])
    trace, rep = load_with_report(f, zero_tokens="drop")
    assert len(trace) == 1 and rep.excluded == {"zero_tokens": 2} and rep.origin.endswith(
        "02.0")
    with pytest.raises(TraceFormatError) as e:
        load_azure_llm_2023(f, zero_tokens="error")
    assert "line 3" in str(e.value) and "ContextTokens is 0" in str(e.value)


def test_unsorted(tmp_path):
    f = write(tmp_path, "u.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                 "2023-11-16 18:00:00.0,5,1\n"
                                 "2023-11-16 18:00:02.0,6,1\n"
                                 "2023-11-16 18:00:01.0,7,1\n")
    with pytest.raises(TraceFormatError) as e:
        load(f)
    msg = str(e.value)
    assert str(f) in msg and "line 4" in msg and "goes backwards" in msg and "line 3" in msg
    trace = load_azure_llm_2023(f, check_sorted=False)
    np.testing.assert_array_equal(trace.arrival_s, [0.0, 1.0, 2.0])
    np.testing.assert_array_equal(trace.prompt_tokens, [5, 7, 6])
    r = write(tmp_path, "r.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n"
                                 "1.0,1,1\n0.5,2,2\n")
    with pytest.raises(TraceFormatError, match=r"line 3: arrived_at goes backwards"):
        load(r)
    assert load(r, check_sorted=False).prompt_tokens.tolist() == [2, 1]
    # Formats that do not promise order are sorted stably (ties keep file order).
    b = write(tmp_path, "b.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,"
                                 "Log Type,Session ID\n"
                                 "9,ChatGPT,1,1,2,API log,s\n"
                                 "3,ChatGPT,2,1,3,API log,s\n"
                                 "9,GPT-4,3,1,4,API log,s\n")
    trace, rep = load_with_report(b)
    assert not rep.was_sorted and rep.origin == "3"
    assert trace.prompt_tokens.tolist() == [2, 1, 3] and trace.arrival_s.tolist() == [0, 6, 6]


AZ = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
FN = "app,func,end_timestamp,duration\n"
BAD_CASES = [
    # (name, content, line, problem fragment)
    ("missing_col", "TIMESTAMP,ContextTokens\n2023-11-16 18:00:00.0,5\n", 1,
     "missing column(s) 'GeneratedTokens'"),
    ("bad_int", AZ + "2023-11-16 18:00:00.0,5,1\n2023-11-16 18:00:01.0,abc,1\n", 3,
     "ContextTokens is not an integer: 'abc'"),
    ("frac_tokens", AZ + "2023-11-16 18:00:00.0,5,1.5\n", 2, "GeneratedTokens is not an integer"),
    ("neg_tokens", AZ + "2023-11-16 18:00:00.0,5,1\n2023-11-16 18:00:01.0,5,-3\n", 3,
     "GeneratedTokens is negative"),
    ("bad_time", AZ + "2023-11-16 18:00:00.0,5,1\n16/11/2023 18:00,5,1\n", 3,
     "TIMESTAMP is not a timestamp"),
    ("bad_date", AZ + "2023-02-30 18:00:00.0,5,1\n", 2, "invalid date"),
    ("header_only", AZ, 2, "no data rows (header only)"),
    ("header_only_crlf", AZ.replace("\n", "\r\n"), 2, "no data rows"),
    ("field_count", AZ + "2023-11-16 18:00:00.0,5,1\n2023-11-16 18:00:01.0,5\n", 3,
     "expected 3 fields"),
    ("blank_inside", AZ + "2023-11-16 18:00:00.0,5,1\n\n2023-11-16 18:00:01.0,5,1\n", 3,
     "blank line"),
    ("unknown_header", "foo,bar\n1,2\n", 1, "unrecognized header"),
    ("fn_neg_duration", FN + "a,f,10.0,1.0\na,f,11.0,-2\n", 3, "duration is negative"),
    ("fn_nan", FN + "a,f,nan,1.0\n", 2, "end_timestamp is not finite"),
    ("fn_dur_gt_end", FN + "a,f,1.0,2.0\n", 2, "exceeds end_timestamp"),
    ("burst_bad_ts", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                     "x,ChatGPT,1,1,2,API log\n", 2, "Timestamp is not a number"),
    ("reenc_neg_time", "arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,1\n-1,1,1\n", 3,
     "arrived_at is negative"),
    ("f2019_bad_minutes", "HashOwner,HashApp,HashFunction,Trigger,1,3\no,a,f,http,1,1\n", 1,
     "column 6 is '3', expected '2'"),
    ("f2019_bad_count", "HashOwner,HashApp,HashFunction,Trigger,1,2\no,a,f,http,1,x\n", 2,
     "minute 2 is not an integer"),
]


@pytest.mark.parametrize("name,content,line,problem", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_files(tmp_path, name, content, line, problem):
    f = write(tmp_path, f"{name}.csv", content)
    with pytest.raises(TraceFormatError) as e:
        load(f)
    msg = str(e.value)
    assert isinstance(e.value, ValueError)
    assert str(f) in msg, msg
    assert f"line {line}:" in msg, msg
    assert problem in msg, msg
    assert e.value.line == line and e.value.path == str(f)


def test_empty_and_missing_files(tmp_path):
    empty = write(tmp_path, "empty.csv", "")
    for fn in (load, detect_format, load_azure_llm_2023):
        with pytest.raises(TraceFormatError) as e:
            fn(empty)
        assert str(empty) in str(e.value) and "line 1" in str(e.value)
        assert "empty file (0 bytes)" in str(e.value)
    missing = tmp_path / "nope.csv"
    with pytest.raises(TraceFormatError) as e:
        load(missing)
    assert str(missing) in str(e.value) and "file not found" in str(e.value)
    with pytest.raises(TraceFormatError, match="not a regular file"):
        load(tmp_path)
    z = write(tmp_path, "zeros.csv", "HashOwner,HashApp,HashFunction,Trigger,1,2\no,a,f,t,0,0\n")
    with pytest.raises(TraceFormatError, match="no invocations"):
        load(z)


def test_trailing_blank_lines_and_bom_ok(tmp_path):
    f = write(tmp_path, "t.csv", "\ufeff" + AZ + "2023-11-16 18:00:00.0,5,1\n\n\n")
    trace, rep = load_with_report(f)
    assert len(trace) == 1 and rep.rows_read == 1


def test_azure_functions_2019_synthetic(tmp_path):
    minutes = ",".join(str(m) for m in range(1, 1441))

    def row(owner, app, func, counts):
        c = [0] * 1440
        for m, n in counts.items():
            c[m - 1] = n
        return f"{owner},{app},{func},http," + ",".join(map(str, c)) + "\n"

    f = write(tmp_path, "invocations_per_function_md.anon.d01.csv",
              f"HashOwner,HashApp,HashFunction,Trigger,{minutes}\n"
              + row("o1", "a1", "fA", {2: 2, 4: 1})
              + row("o1", "a1", "fB", {2: 1, 1440: 4})
              + row("o2", "a2", "fC", {}))
    assert detect_format(f) == "azure_functions_2019"
    trace, rep = load_with_report(f)
    assert rep.format == "azure_functions_2019" and rep.rows_read == 3
    # fA minute 2: 60+15, 60+45; minute 4: 180+30. fB minute 2: 60+30; minute 1440:
    # 86340 + 7.5, 22.5, 37.5, 52.5. Rebased to the first (75 s).
    raw = np.array([75, 90, 105, 210, 86347.5, 86362.5, 86377.5, 86392.5])
    np.testing.assert_allclose(trace.arrival_s, raw - 75, atol=1e-9)
    assert rep.origin == "75"
    assert np.all(trace.prompt_tokens == 512) and np.all(trace.output_tokens == 50)  # 1 s
    t2 = load_azure_functions_2019(f, duration_s=0.004, tokens_per_second=100, prompt_tokens=9)
    assert np.all(t2.output_tokens == 1) and np.all(t2.prompt_tokens == 9)  # max(1, rint(.4))
    # Durations from a 2019 durations file (Average in ms); fB missing -> duration_s.
    d = write(tmp_path, "function_durations_percentiles.anon.d01.csv",
              "HashOwner,HashApp,HashFunction,Average,Count,Minimum,Maximum\n"
              "o1,a1,fA,300,3,100,500\n")
    t3, rep3 = load_with_report(f, durations_path=d, duration_s=2.0)
    np.testing.assert_array_equal(t3.output_tokens, [15, 100, 15, 15, 100, 100, 100, 100])
    assert "1 function(s) not in durations_path" in rep3.notes[0]


def test_2019_spread_rule_within_minute(tmp_path):
    f = write(tmp_path, "s.csv", "HashOwner,HashApp,HashFunction,Trigger,1,2,3\n"
                                 "o,a,f,timer,1,0,3\n")
    trace, rep = load_with_report(f, format="azure_functions_2019")
    np.testing.assert_allclose(trace.arrival_s, np.array([30, 130, 150, 170]) - 30.0)


def test_summary_definitions():
    tr = Trace(arrival_s=np.array([10.0, 11.0, 12.0]), prompt_tokens=np.array([1, 2, 3]),
               output_tokens=np.array([3, 2, 1]))
    s = summary(tr)
    assert s["rows"] == 3 and s["span_s"] == 2.0 and s["mean_rate"] == 1.0
    assert s["cv_interarrival"] == 0.0
    # ceil(2/1) = 2 windows [10,11), [11,12]; the arrival at 12 falls in the last one.
    assert s["windows_1s"] == 2 and s["peak_count_1s"] == 2
    assert s["peak_to_mean_1s"] == pytest.approx(2 / 1.5)
    assert s["iod_1s"] == pytest.approx(0.25 / 1.5)
    assert s["windows_60s"] == 1 and s["iod_60s"] == 0.0
    assert s["corr_pearson"] == pytest.approx(-1) and s["corr_spearman"] == pytest.approx(-1)
    one = summary(Trace(arrival_s=np.array([5.0]), prompt_tokens=np.array([4]),
                        output_tokens=np.array([4])))
    assert one["rows"] == 1 and math.isnan(one["mean_rate"]) and one["windows_1s"] == 1
    assert math.isnan(one["corr_pearson"])


def test_formats_listed():
    assert set(FORMATS) == {"azure_llm_2023", "azure_llm_reencoded", "burstgpt",
                            "azure_functions_2021", "azure_functions_2019"}


# ------------------------------------------------------------------------------------------
# Damaged files: every format, every damage -> TraceFormatError with file + line
# ------------------------------------------------------------------------------------------

# One valid two-row file per format; every row's last field ends in "55" (or "API log").
SAMPLES = {
    "azure_llm_2023": AZ + "2023-11-16 18:00:00.0,10,55\n2023-11-16 18:00:01.0,12,55\n",
    "azure_llm_reencoded": "arrived_at,num_prefill_tokens,num_decode_tokens\n"
                           "0.0,10,55\n1.0,12,55\n",
    "burstgpt": "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                "0,ChatGPT,10,55,65,API log\n1,ChatGPT,12,55,67,API log\n",
    "azure_functions_2021": FN + "a,f,10.5,0.55\na,f,11.5,0.55\n",
    "azure_functions_2019": "HashOwner,HashApp,HashFunction,Trigger,1,2\n"
                            "o,a,f,http,1,55\no,a,g,http,2,55\n",
}
# The last row with an out-of-range cell: past int64, past the engine's 2^24 tokens, or
# (Functions 2021, no integer cells) a time or duration whose gap / tokens are out of range.
HUGE = {
    "azure_llm_2023": ["2023-11-16 18:00:01.0,12,30000000000000000000000",
                       "2023-11-16 18:00:01.0,3000000000,5", "9999-11-16 18:00:01.0,12,5"],
    "azure_llm_reencoded": ["1.0,30000000000000000000000,55", "1.0,12,3000000000",
                            "1e300,12,55"],
    "burstgpt": ["1,ChatGPT,30000000000000000000000,55,1,API log",
                 "1,ChatGPT,12,3000000000,1,API log", "1e300,ChatGPT,12,55,67,API log"],
    "azure_functions_2021": ["a,f,1e300,0.55", "a,f,1e8,9e7"],
    "azure_functions_2019": ["o,a,g,http,2,30000000000000000000000",
                             "o,a,g,http,30000000,1"],
}


def _replace_last_row(text: str, row: str) -> str:
    lines = text.rstrip("\n").split("\n")
    return "\n".join(lines[:-1] + [row]) + "\n"


def _assert_located(e, f, line):
    msg = str(e.value)
    assert isinstance(e.value, TraceFormatError) and str(f) in msg, msg
    assert e.value.line == line and f"line {line}:" in msg, msg


@pytest.mark.parametrize("fmt", FORMATS)
def test_damaged_huge_cells(tmp_path, fmt):
    for i, row in enumerate(HUGE[fmt]):
        f = write(tmp_path, f"{fmt}_huge{i}.csv", _replace_last_row(SAMPLES[fmt], row))
        with pytest.raises(TraceFormatError) as e:
            load(f, format=fmt)
        _assert_located(e, f, 3)
        assert "OverflowError" not in repr(e.value.__cause__)


@pytest.mark.parametrize("fmt", FORMATS)
def test_damaged_truncated_last_line(tmp_path, fmt):
    text = SAMPLES[fmt]
    assert load(write(tmp_path, f"{fmt}_ok.csv", text), format=fmt) is not None
    # Cut inside the last row so that its last field is gone: detected (field count).
    cut = text[:text.rstrip("\n").rindex(",")]
    f = write(tmp_path, f"{fmt}_cut_row.csv", cut)
    with pytest.raises(TraceFormatError) as e:
        load(f, format=fmt)
    _assert_located(e, f, 3)
    # Cut inside the last field, leaving a valid shorter value ("55" -> "5"): it cannot be
    # told from a file without a final newline (legal), so the report says so, with the line.
    f = write(tmp_path, f"{fmt}_cut_field.csv", text.rstrip("\n")[:-1])
    _, rep = load_with_report(f, format=fmt)
    assert any(n.startswith("line 3: the file does not end with a newline") for n in rep.notes)
    _, rep = load_with_report(write(tmp_path, f"{fmt}_ok.csv", text), format=fmt)
    assert not any("newline" in n for n in rep.notes)
    # A cut that breaks the field's syntax is a format error with the line.
    if fmt == "azure_functions_2021":  # "1e-3" cut to "1e-"
        f = write(tmp_path, "fn_cut.csv", FN + "a,f,10.5,0.55\na,f,11.5,1e-")
        with pytest.raises(TraceFormatError) as e:
            load(f, format=fmt)
        _assert_located(e, f, 3)


@pytest.mark.parametrize("fmt", FORMATS)
def test_damaged_wrong_header_binary_empty(tmp_path, fmt):
    text = SAMPLES[fmt]
    # A header of the wrong format (here: another format's columns).
    other = next(x for x in FORMATS if x != fmt and not x.startswith(fmt[:9]))
    f = write(tmp_path, f"{fmt}_hdr.csv", SAMPLES[other].split("\n")[0] + "\n"
              + "\n".join(text.split("\n")[1:]))
    with pytest.raises(TraceFormatError) as e:
        load(f, format=fmt)
    _assert_located(e, f, 1)
    # Binary: not UTF-8 from the first byte, and a NUL byte inside a data row.
    f = tmp_path / f"{fmt}_bin.csv"
    f.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe\x00")
    with pytest.raises(TraceFormatError) as e:
        load(f, format=fmt)
    _assert_located(e, f, 1)
    f = tmp_path / f"{fmt}_nul.csv"
    lines = text.split("\n")
    f.write_bytes(("\n".join(lines[:2]) + "\n").encode() + b"\x00\x01\xff\n")
    with pytest.raises(TraceFormatError) as e:
        load(f, format=fmt)
    _assert_located(e, f, 3)
    # Empty.
    f = write(tmp_path, f"{fmt}_empty.csv", "")
    with pytest.raises(TraceFormatError) as e:
        load(f, format=fmt)
    _assert_located(e, f, 1)


def test_damaged_copies_of_shared_traces(traces_dir, tmp_path):
    # (file, format, column damaged, huge value): a token count past int64, or a time.
    for src, fmt, j, huge in ((CODE, "azure_llm_2023", 2, "30000000000000000000000"),
                              (BURST, "burstgpt", 2, "30000000000000000000000"),
                              (FN21, "azure_functions_2021", 2, "1e300")):
        head = src.read_text().splitlines()[:12]
        cells = head[5].split(",")  # file line 6
        cells[j] = huge
        f = write(tmp_path, f"{src.stem}_huge.csv", "\n".join(head[:5] + [",".join(cells)]
                                                              + head[6:]) + "\n")
        with pytest.raises(TraceFormatError) as e:
            load(f, format=fmt)
        _assert_located(e, f, 6)
        # Cut one character from the end (no final newline): refused with the last line when
        # the cut empties the last field, else noted in the report with that line.
        f = write(tmp_path, f"{src.stem}_cut.csv", "\n".join(head)[:-1])
        if len(head[-1].split(",")[-1].strip()) == 1:
            with pytest.raises(TraceFormatError) as e:
                load(f, format=fmt)
            _assert_located(e, f, len(head))
        else:
            _, rep = load_with_report(f, format=fmt)
            assert any(n.startswith(f"line {len(head)}: the file does not end") for n in
                       rep.notes), rep.notes


def test_functions_tokens_per_second_refused_clearly(tmp_path):
    f = write(tmp_path, "fn.csv", SAMPLES["azure_functions_2021"])
    for bad in (1e30, 0.0, math.nan, -1.0):
        with pytest.raises(ValueError, match=r"tokens_per_second must be in \(0, 16777216\]"):
            load_azure_functions_2021(f, tokens_per_second=bad)
    # Within the bound but too many tokens for a long invocation: the row is named.
    f = write(tmp_path, "fn_long.csv", FN + "a,f,10.5,0.55\na,f,400000.0,399990.0\n")
    with pytest.raises(TraceFormatError) as e:
        load_azure_functions_2021(f, tokens_per_second=100.0)
    _assert_located(e, f, 3)
    assert "lower tokens_per_second" in str(e.value)
