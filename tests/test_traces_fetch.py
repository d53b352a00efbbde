"""The public trace registry, `jaxserve.traces.fetch` / `path` and the `jaxserve-traces` CLI.

Downloads go to `file://` URLs in a temporary folder and into a temporary cache (nothing leaves
the machine or touches the user's cache); the registry's own entries are checked against the
trace mirror through JAXSERVE_TRACES_DIR (tests/conftest.py points it at `../shared/traces`
beside the repository when that folder exists).
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import os
import zipfile
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

pytest.importorskip("pooch", reason="trace downloads need pooch (pip install 'pooch>=1.8')")

from jaxserve import traces as T  # noqa: E402
from jaxserve.agents.experiments.llm_routing_study import load_trace  # noqa: E402
from jaxserve.envs import autoscaling_workloads as AW  # noqa: E402
from jaxserve.scripts import traces as cli  # noqa: E402
from jaxserve.traces import registry as R  # noqa: E402
from jaxserve.traces import store as S  # noqa: E402

MIRROR = os.environ.get(S.ENV_VAR)
needs_mirror = pytest.mark.skipif(
    not MIRROR or not Path(MIRROR).is_dir(),
    reason="the trace mirror (../shared/traces beside the repository, or $JAXSERVE_TRACES_DIR) "
           "is absent")
ROWS = b"Timestamp,Model,Request tokens\r\n5,ChatGPT,4\r\n6,GPT-4,7\r\n9,ChatGPT,2\r\n"


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def file_url(p: Path) -> str:
    return p.resolve().as_uri()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty temporary user cache, and no JAXSERVE_TRACES_DIR."""
    c = tmp_path / "cache"
    monkeypatch.setattr(S, "cache_dir", lambda: c)
    monkeypatch.delenv(S.ENV_VAR, raising=False)
    return c


def register(monkeypatch, name="fake_trace", **kw) -> R.TraceFile:
    e = R.TraceFile(name=name, relpath=kw.pop("relpath", f"fake/{name}.csv"),
                    licence="CC0-1.0", citation="none", source="a test file", **kw)
    monkeypatch.setitem(R.REGISTRY, name, e)
    return e


def run_cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = cli.main(list(argv))
    return rc, out.getvalue(), err.getvalue()


# --- the registry itself -------------------------------------------------------------------


def test_registry_entries_are_complete_and_pinned():
    assert set(R.names()) == {"azure_llm_2023_code", "azure_llm_2023_conv", "burstgpt_first30",
                              "burstgpt_aggregates", "azure_functions_2021_sample",
                              "mooncake_conversation", "mooncake_synthetic"}
    for e in R.REGISTRY.values():
        assert len(e.sha256) == 64 and e.size > 0 and e.licence and e.citation, e.name
        # raw GitHub URL pinned at a 40-hex commit
        parts = e.url.split("/")
        assert e.url.startswith("https://raw.githubusercontent.com/"), e.name
        assert len(parts[5]) == 40 and all(c in "0123456789abcdef" for c in parts[5]), e.name
        assert (e.processor is None) == (e.download_sha256 is None), e.name
        assert R.entry_for(e.relpath) is e and R.entry(e.name) is e
    # gzip entries: the decompressed content is the upstream file
    for n in ("mooncake_conversation", "mooncake_synthetic"):
        e = R.REGISTRY[n]
        assert e.content_sha256 == e.download_sha256 and isinstance(e.processor, R.GzipCompress)


def test_unknown_name_lists_the_known_ones(cache):
    for f in (T.path, T.fetch, R.entry):
        with pytest.raises(ValueError, match="unknown trace 'nope'.*azure_llm_2023_conv"):
            f("nope")
    rc, _, err = run_cli("fetch", "nope")
    assert rc == 2 and "unknown trace 'nope'" in err and "mooncake_synthetic" in err


# --- the mirror through JAXSERVE_TRACES_DIR ------------------------------------------------


@needs_mirror
def test_mirror_verifies_every_registry_entry(monkeypatch, tmp_path):
    monkeypatch.setattr(S, "cache_dir", lambda: tmp_path / "empty-cache")
    for name, e in R.REGISTRY.items():
        p = T.path(name)
        assert p == Path(MIRROR) / e.relpath
        assert p.stat().st_size == e.size, name
        assert S.file_sha256(p) == e.sha256, name
        if e.content_sha256 is not None:
            assert sha(gzip.decompress(p.read_bytes())) == e.content_sha256, name
        assert S.locate(name)[0] == "mirror"
    rc, out, _ = run_cli("verify")
    assert rc == 0 and f"{len(R.REGISTRY)} verified, 0 mismatched" in out
    rc, out, _ = run_cli("list")
    status = {ln.split()[0]: ln.split()[4] for ln in out.splitlines()[1:len(R.REGISTRY) + 1]}
    assert rc == 0 and status == dict.fromkeys(R.REGISTRY, "mirror")


def test_a_damaged_file_under_the_env_folder_is_refused(tmp_path, monkeypatch):
    e = R.REGISTRY["burstgpt_first30"]
    (tmp_path / e.relpath).parent.mkdir(parents=True)
    (tmp_path / e.relpath).write_bytes(ROWS)
    monkeypatch.setenv(S.ENV_VAR, str(tmp_path))
    with pytest.raises(ValueError) as err:
        T.path("burstgpt_first30")
    msg = str(err.value)
    assert str(tmp_path / e.relpath) in msg and e.sha256 in msg and sha(ROWS) in msg
    rc, out, _ = run_cli("verify", "burstgpt_first30")
    assert rc == 1 and "MISMATCH" in out


# --- missing files -------------------------------------------------------------------------


def test_missing_trace_names_the_fetch_command(cache):
    with pytest.raises(T.TraceNotFoundError) as err:
        T.path("azure_llm_2023_conv")
    assert isinstance(err.value, FileNotFoundError) and isinstance(err.value, ValueError)
    assert "jaxserve-traces fetch azure_llm_2023_conv" in str(err.value)
    assert S.ENV_VAR in str(err.value)
    assert T.find("azure_llm_2023_conv") is None
    # the callers say the same
    with pytest.raises(ValueError, match="jaxserve-traces fetch azure_llm_2023_code"):
        AW._load.__wrapped__("azure_code")
    with pytest.raises(FileNotFoundError, match="jaxserve-traces fetch burstgpt_aggregates"):
        T.burstgpt_profile()
    with pytest.raises(ValueError, match="jaxserve-traces fetch azure_llm_2023_conv"):
        load_trace("conv")
    # an explicit traces_dir= folder without the file
    with pytest.raises(FileNotFoundError, match="jaxserve-traces fetch mooncake_conversation"):
        T.resolve("mooncake_conversation", cache.parent / "elsewhere")
    # a loader given a missing file named like a public trace
    with pytest.raises(T.TraceFormatError, match="jaxserve-traces fetch azure_llm_2023_code"):
        T.load(cache.parent / "AzureLLMInferenceTrace_code.csv")
    rc, out, _ = run_cli("list")
    status = {ln.split()[0]: ln.split()[4] for ln in out.splitlines()[1:len(R.REGISTRY) + 1]}
    assert rc == 0 and status == dict.fromkeys(R.REGISTRY, "missing")


def test_entry_without_url_says_where_to_get_it(cache, monkeypatch):
    register(monkeypatch, url=None, sha256=sha(ROWS), size=len(ROWS),
             url_note="upstream not confirmed; ask the authors")
    with pytest.raises(T.TraceNotFoundError, match="ask the authors.*fake/fake_trace.csv"):
        T.fetch("fake_trace")


# --- downloading ---------------------------------------------------------------------------


def test_fetch_file_url_into_the_cache(cache, tmp_path, monkeypatch):
    src = tmp_path / "upstream" / "rows.csv"
    src.parent.mkdir()
    src.write_bytes(ROWS)
    e = register(monkeypatch, url=file_url(src), sha256=sha(ROWS), size=len(ROWS))
    p = T.fetch("fake_trace")
    assert p == cache / e.relpath and p.read_bytes() == ROWS
    assert T.path("fake_trace") == p and S.locate("fake_trace") == ("cached", p)
    src.unlink()  # a verified cached copy is not downloaded again
    assert T.fetch("fake_trace") == p
    # a damaged cached copy: path() refuses it, fetch() downloads again
    p.write_bytes(ROWS + b"1,x,1\r\n")
    with pytest.raises(ValueError, match="does not match"):
        T.path("fake_trace")
    src.write_bytes(ROWS)
    assert T.fetch("fake_trace").read_bytes() == ROWS


def test_fetch_rejects_a_wrong_hash(cache, tmp_path, monkeypatch):
    src = tmp_path / "rows.csv"
    src.write_bytes(ROWS)
    wrong = sha(b"something else")
    register(monkeypatch, url=file_url(src), sha256=wrong, size=len(ROWS))
    with pytest.raises(ValueError) as err:
        T.fetch("fake_trace")
    assert "fake_trace" in str(err.value) and wrong in str(err.value)
    assert sha(ROWS) in str(err.value)
    assert not (cache / "fake" / "fake_trace.csv").exists()
    rc, _, err_text = run_cli("fetch", "fake_trace")
    assert rc == 1 and "fake_trace: failed" in err_text
    # a processed entry whose product does not match is removed too
    register(monkeypatch, name="fake_head", url=file_url(src), sha256=wrong, size=10,
             download_sha256=sha(ROWS), processor=R.FirstLines(2))
    with pytest.raises(ValueError, match=wrong):
        T.fetch("fake_head")
    assert not (cache / "fake" / "fake_head.csv").exists()


def test_fetch_processors_make_the_stored_file(cache, tmp_path, monkeypatch):
    up = tmp_path / "up"
    up.mkdir()
    (up / "sample.csv").write_bytes(ROWS)
    head = b"".join(ROWS.splitlines(keepends=True)[:3])
    register(monkeypatch, name="fake_head", url=file_url(up / "sample.csv"), sha256=sha(head),
             size=len(head), download_sha256=sha(ROWS), processor=R.FirstLines(3))
    member = b'{"daily": [1, 2, 3]}'
    with zipfile.ZipFile(up / "data used.zip", "w") as z:
        z.writestr("other.csv", "a,b\n")
        z.writestr("agg.json", member)
    register(monkeypatch, name="fake_zip", relpath="fake/agg.json",
             url=file_url(up / "data used.zip"), sha256=sha(member), size=len(member),
             download_sha256=sha((up / "data used.zip").read_bytes()),
             processor=R.ZipMember("agg.json"))
    lines = b"".join(b'{"timestamp": %d}\n' % i for i in range(100))
    (up / "t.jsonl").write_bytes(lines)
    stored_gz = gzip.compress(lines, mtime=123)  # a "mirror" gzip other than fetch's
    register(monkeypatch, name="fake_gz", relpath="fake/t.jsonl.gz", url=file_url(up / "t.jsonl"),
             sha256=sha(stored_gz), size=len(stored_gz), download_sha256=sha(lines),
             processor=R.GzipCompress(), content_sha256=sha(lines))
    assert T.fetch("fake_head").read_bytes() == head
    assert T.fetch("fake_zip").read_bytes() == member
    gz = T.fetch("fake_gz")
    assert gz == cache / "fake" / "t.jsonl.gz" and gzip.decompress(gz.read_bytes()) == lines
    assert T.path("fake_gz") == gz  # verified by its decompressed content
    assert not any((cache / "_downloads").iterdir())  # only the stored files stay
    # --force downloads again
    assert T.fetch("fake_head", force=True).read_bytes() == head


@needs_mirror
@pytest.mark.parametrize("name", ["azure_functions_2021_sample", "mooncake_synthetic"])
def test_fetch_real_entries_from_mirror_copies(name, cache, tmp_path, monkeypatch):
    """A registry entry's real hashes, with the upstream file served from a local copy (the
    mirror's file, decompressed for a gzip entry: the upstream bytes exactly)."""
    e = R.REGISTRY[name]
    data = (Path(MIRROR) / e.relpath).read_bytes()
    if e.content_sha256 is not None:
        data = gzip.decompress(data)
    src = tmp_path / "upstream.bin"
    src.write_bytes(data)
    monkeypatch.setitem(R.REGISTRY, name, dataclasses.replace(e, url=file_url(src)))
    p = T.fetch(name)
    assert p == cache / e.relpath and T.path(name) == p
    rc, out, _ = run_cli("verify", name)
    assert rc == 0 and "ok (cached)" in out


def test_cli_fetch_and_usage_errors(cache, tmp_path, monkeypatch):
    src = tmp_path / "rows.csv"
    src.write_bytes(ROWS)
    register(monkeypatch, url=file_url(src), sha256=sha(ROWS), size=len(ROWS))
    rc, out, _ = run_cli("fetch", "fake_trace")
    assert rc == 0 and str(cache / "fake" / "fake_trace.csv") in out
    rc, out, _ = run_cli("list", "-v")
    assert rc == 0 and "cached" in out and "file://" in out
    assert run_cli("fetch")[0] == 2
    assert run_cli("fetch", "fake_trace", "--all")[0] == 2
    assert run_cli("bogus")[0] == 2
    assert run_cli()[0] == 2
