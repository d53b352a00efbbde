"""Multi-process training: two `jax.distributed` processes equal one process with 4 devices.

docs/training.md gives a multi-host recipe (`jax.distributed.initialize`, then
`agents.train(..., shard=True)`). This test runs it on one machine: two local CPU processes of
two forced devices each form a 4-device global mesh (gloo collectives over the loopback), train
PPO on Routing-v0, stop half-way, checkpoint across both processes and resume. The result must
equal the same training in one process with four devices (`tests/multihost_worker.py` runs
both).

Tolerance: the two runs compute the same program on the same data, sharded the same way over
four devices; only the cross-device reductions (gradient means) are done by different
collectives (in-process vs gloo), which may sum in another order. Float32 reassociation over
4 updates moves parameters by ~1e-7 (measured: 1.4e-7 max abs over all leaves), so `atol=1e-5`
is ~70x that while any real difference (a missed shard, a wrong key, a lost update) moves them
by orders of magnitude more (one PPO update changes leaves by ~1e-4 to 1e-2). Resuming must be
exact within a job (all randomness is in the checkpointed runner state): compared bit for bit.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600  # generous: each process compiles three training programs on a shared 2-core CPU


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(process_id: int, num_processes: int, port: int, local_devices: int, out: Path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    cmd = [sys.executable, "-m", "tests.multihost_worker", str(process_id), str(num_processes),
           str(port), str(local_devices), str(out)]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait(procs) -> None:
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=TIMEOUT_S)
            outputs.append(out)
    finally:
        for p in procs:  # a process whose peer died would wait for it forever
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, f"worker exited {p.returncode}:\n{out[-4000:]}"


def _params(path: Path, prefix: str) -> list[np.ndarray]:
    data = np.load(path / "params.npz")
    return [data[f"{prefix}_{i}"] for i in range(sum(k.startswith(prefix) for k in data))]


@pytest.mark.slow
def test_two_processes_equal_one_process_and_resume_across_them(tmp_path):
    single, multi = tmp_path / "single", tmp_path / "multi"
    single.mkdir()
    multi.mkdir()
    port = _free_port()
    _wait([_launch(0, 2, port, 2, multi), _launch(1, 2, port, 2, multi),
           _launch(0, 1, 0, 4, single)])

    one = _params(single, "whole")
    two = _params(multi, "whole")
    assert len(one) == len(two) > 0
    for a, b in zip(one, two):
        assert a.shape == b.shape
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)
    # The second half of training moved the parameters far more than the tolerance, so the
    # comparison above could tell a lost update.
    moved = max(float(np.max(np.abs(a - h))) for a, h in zip(one, _params(single, "half")))
    assert moved > 1e-3, moved
    for run_dir in (single, multi):  # resume is exact within a job
        for a, b in zip(_params(run_dir, "whole"), _params(run_dir, "resumed")):
            np.testing.assert_array_equal(b, a)
    # Both processes wrote their shards of the one checkpoint, and process 0 the metrics.
    assert (multi / "run" / "checkpoints").is_dir()
    assert (multi / "run" / "metrics.csv").is_file()
