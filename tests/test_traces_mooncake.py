"""The Mooncake JSONL(.gz) loader: prefix tree, errors with file and line, the README's reuse
statistics on the real files (when present), and KV-block identities fed to the prefix-caching
reference."""

import gzip
import json

import numpy as np
import pytest

from jaxserve.traces import find as find_trace
from jaxserve.traces.loaders import TraceFormatError
from jaxserve.traces.mooncake import (infinite_cache_reuse, kv_prefix, load_mooncake,
                                      path_nodes)

REAL = {n: find_trace(f"mooncake_{n}") for n in ("conversation", "synthetic")}
NO_REAL = ("Mooncake traces not available (set JAXSERVE_TRACES_DIR or run "
           "`jaxserve-traces fetch --all`)")

ROWS = [
    {"timestamp": 1000, "input_length": 1000, "output_length": 5, "hash_ids": [7, 8]},
    {"timestamp": 1000, "input_length": 1100, "output_length": 3, "hash_ids": [7, 9, 10]},
    {"timestamp": 2500, "input_length": 512, "output_length": 1, "hash_ids": [7]},
    # id 8 again, under a different parent: a different node (chained identity)
    {"timestamp": 4000, "input_length": 1024, "output_length": 2, "hash_ids": [11, 8]},
    {"timestamp": 4000, "input_length": 1500, "output_length": 2, "hash_ids": [7, 9, 10]},
]


def write(tmp_path, rows, name="t.jsonl", compress=False, raw=None):
    p = tmp_path / name
    text = raw if raw is not None else "".join(json.dumps(r) + "\n" for r in rows)
    if compress:
        with gzip.open(p, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        p.write_text(text)
    return p


@pytest.mark.parametrize("compress", [False, True])
def test_small_file_tree_and_trace(tmp_path, compress):
    mt = load_mooncake(write(tmp_path, ROWS, "t.jsonl.gz" if compress else "t.jsonl",
                             compress=compress))
    np.testing.assert_array_equal(mt.trace.arrival_s, [0.0, 0.0, 1.5, 3.0, 3.0])
    np.testing.assert_array_equal(mt.trace.prompt_tokens, [1000, 1100, 512, 1024, 1500])
    np.testing.assert_array_equal(mt.trace.output_tokens, [5, 3, 1, 2, 2])
    # nodes in order of first appearance: 7, 7/8, 7/9, 7/9/10, 11, 11/8
    np.testing.assert_array_equal(mt.tree.parent, [-1, 0, 0, 2, -1, 4])
    np.testing.assert_array_equal(mt.tree.depth, [1, 2, 2, 3, 1, 2])
    np.testing.assert_array_equal(mt.tree.hash_id, [7, 8, 9, 10, 11, 8])
    np.testing.assert_array_equal(mt.node, [1, 3, 0, 5, 3])
    np.testing.assert_array_equal(mt.full_blocks, [1, 2, 1, 2, 2])
    assert path_nodes(mt.tree, 3) == [0, 2, 3] and path_nodes(mt.tree, -1) == []
    # reuse: row 1 reuses [7] (1 of 3), row 2 [7] (1 of 1), row 4 all 3; 5 of 11 entries
    assert infinite_cache_reuse(mt) == 5 / 11


def test_unsorted_rows_are_stably_sorted_and_rebased(tmp_path):
    rows = [ROWS[2], ROWS[0], ROWS[1]]
    mt = load_mooncake(write(tmp_path, rows))
    np.testing.assert_array_equal(mt.trace.arrival_s, [0.0, 0.0, 1.5])
    np.testing.assert_array_equal(mt.trace.prompt_tokens, [1000, 1100, 512])
    # the tree is built in arrival order: node 0 is id 7 (first seen in the 1000-token row)
    np.testing.assert_array_equal(mt.tree.hash_id, [7, 8, 9, 10])


@pytest.mark.parametrize("raw, line, match", [
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n{bad\n',
     2, "invalid JSON"),
    ('[1, 2]\n', 1, "JSON object"),
    ('{"timestamp": 0, "input_length": 10, "hash_ids": [1]}\n', 1, "output_length"),
    ('{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n', 1,
     "negative"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}\n', 1,
     "input_length must be >= 1"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 2.5, "hash_ids": [1]}\n', 1,
     "output_length must be an integer"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}\n', 1,
     "needs ceil"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": ["a"]}\n', 1,
     "list of integers"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n\n'
     '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n', 2,
     "blank line"),
    ('\n', 1, "no data rows"),
])
def test_errors_name_file_and_line(tmp_path, raw, line, match):
    p = write(tmp_path, None, raw=raw)
    with pytest.raises(TraceFormatError, match=match) as e:
        load_mooncake(p)
    assert e.value.line == line and e.value.path == str(p)
    assert str(e.value).startswith(f"{p}, line {line}: ")


def test_missing_file_and_bad_gzip(tmp_path):
    with pytest.raises(TraceFormatError, match="file not found"):
        load_mooncake(tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(b"\x1f\x8b\x08\x00garbage")
    with pytest.raises(TraceFormatError, match="gzip"):
        load_mooncake(bad)
    with pytest.raises(ValueError, match="block_tokens"):
        load_mooncake(write(tmp_path, ROWS), block_tokens=0)


def test_kv_prefix_at_vllm_block_size(tmp_path):
    mt = load_mooncake(write(tmp_path, ROWS))
    # row 1: 1100 tokens, 16-token blocks: 68 full KV blocks; 32 per hash block
    ids = kv_prefix(mt, 1, 16)
    assert len(ids) == 1100 // 16
    assert ids[0] == (0, 0) and ids[31] == (0, 31) and ids[32] == (2, 0) and ids[64] == (3, 0)
    # rows 1 and 4 share their 3 hash blocks; row 4 is longer: its first 68 ids are row 1's
    assert kv_prefix(mt, 4, 16)[:68] == ids
    # rows 0 and 1 share only hash block 0 (32 KV blocks)
    a, b = kv_prefix(mt, 0, 16), ids
    assert a[:32] == b[:32] and a[32] != b[32]
    with pytest.raises(ValueError, match="divide"):
        kv_prefix(mt, 0, 48)


def test_kv_prefix_drives_the_prefix_reference(tmp_path):
    """Rows 1 and 4 share 3 hash blocks: the later one (arriving after the first finished) hits
    every full 16-token block of the first's prompt that its cap allows."""
    from jaxserve.reference.prefix import simulate_prefix

    mt = load_mooncake(write(tmp_path, ROWS))
    prof = dict(c0=0.5, alpha=2.0 ** -10, alpha2=0.0, beta=0.0, gamma=0.0, delta=0.0,
                kv_blocks=4096, block_size=16, max_seqs=8, max_tokens=4096,
                chunked_prefill=True, watermark=0.0, queue_cap=16)
    n = len(mt)
    arrival = mt.trace.arrival_s * 100  # spread out: each request runs alone
    prefix = [kv_prefix(mt, i, 16) for i in range(n)]
    out = simulate_prefix(arrival, mt.trace.prompt_tokens, mt.trace.output_tokens,
                          np.zeros(n, int), [prof], prefix, audit=True)
    # row 1 (arrives with row 0, admitted after it in the same pass) hits row 0's first hash
    # block (32 KV blocks = 512 tokens); row 2 (512 tokens) is fully cached: 31 blocks hit;
    # row 3 has a new root; row 4 hits row 1's 68 full blocks (1088 tokens).
    assert out["cached_tokens"] == [[0], [512], [496], [0], [1088]]


@pytest.mark.parametrize("name, rows, reuse", [("conversation", 12031, 0.366),
                                               ("synthetic", 3993, 0.640)])
def test_real_files_reproduce_readme_reuse(name, rows, reuse):
    if REAL[name] is None:
        pytest.skip(NO_REAL)
    mt = load_mooncake(REAL[name])
    assert len(mt) == rows
    # README rounds to 0.1%: 36.6% and 64.0%
    assert round(infinite_cache_reuse(mt), 3) == reuse
    assert np.all(mt.tree.parent < np.arange(mt.tree.num_nodes))
    assert np.all(mt.tree.depth[mt.tree.parent >= 0] ==
                  mt.tree.depth[mt.tree.parent[mt.tree.parent >= 0]] + 1)
    assert np.all(mt.full_blocks <= mt.tree.depth[mt.node])


@pytest.mark.skipif(REAL["conversation"] is None, reason=NO_REAL)
def test_real_prefixes_through_the_reference_under_pressure():
    """The first 40 conversation requests (16-token KV blocks from kv_prefix) on one replica of
    1200 blocks: the block pool's invariants hold after every change (audit), with hits,
    evictions and preemptions of requests holding shared blocks all present."""
    from jaxserve.reference.prefix import simulate_prefix

    mt = load_mooncake(REAL["conversation"])
    n = 40
    prof = dict(c0=0.5, alpha=2.0 ** -12, alpha2=0.0, beta=0.0, gamma=0.0, delta=2.0 ** -20,
                kv_blocks=1200, block_size=16, max_seqs=8, max_tokens=4096,
                chunked_prefill=True, watermark=0.0, queue_cap=64)
    arrival = np.ceil(mt.trace.arrival_s[:n] * 4) / 4
    prompt = mt.trace.prompt_tokens[:n]
    output = np.minimum(mt.trace.output_tokens[:n], 64)
    prefix = [kv_prefix(mt, i, 16) for i in range(n)]
    out = simulate_prefix(arrival, prompt, output, np.zeros(n, int), [prof], prefix,
                          audit=True)
    assert out["hit_tokens"][0] > 0 and out["evictions"][0] > 0
    assert out["shared_preemptions"][0] > 0
    for i in np.flatnonzero(~out["dropped"]):
        assert all(c % 16 == 0 and c <= prompt[i] + output[i] - 1
                   for c in out["cached_tokens"][i])
