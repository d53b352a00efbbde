"""One process of the multi-process training test (`tests/test_multihost.py`); not a test.

    python -m tests.multihost_worker PROCESS_ID NUM_PROCESSES PORT LOCAL_DEVICES OUT_DIR

Forces `LOCAL_DEVICES` CPU devices, joins a `jax.distributed` job of `NUM_PROCESSES` processes
whose coordinator (process 0) listens on 127.0.0.1:PORT (a single process skips
`initialize`), then trains PPO on Routing-v0 with `shard=True` over every device of the job,
twice: uninterrupted for `UPDATES` updates, and stopped after half of them (a callback asks
`train` to stop; it checkpoints to `OUT_DIR/run`), then resumed from that checkpoint to the
end. Process 0 writes the final parameters of the uninterrupted, the stopped and the resumed
run, gathered from all processes, to `OUT_DIR/params.npz`.
"""

from __future__ import annotations

import os
import sys

PROCESS_ID, NUM_PROCESSES, PORT, LOCAL_DEVICES = (int(a) for a in sys.argv[1:5])
OUT_DIR = sys.argv[5]
# Before jax is imported: the device count is read once, at backend start.
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={LOCAL_DEVICES}"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

if NUM_PROCESSES > 1:
    # CPU devices of different processes talk through gloo (TCP on the loopback here).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{PORT}",
                               num_processes=NUM_PROCESSES, process_id=PROCESS_ID,
                               initialization_timeout=120)

from jaxserve import agents  # noqa: E402

NUM_ENVS = 8          # two environments per device of the 4-device mesh
STEPS_PER_UPDATE = NUM_ENVS * 32  # Routing-v0's PPO rollout is 32 steps per environment
UPDATES = 4


def gathered(params) -> list[np.ndarray]:
    """Every leaf of `params` as a host array holding the values of all processes."""
    return [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in
            jax.tree.leaves(params)]


def run(out_dir: str | None = None, resume: bool = False, stop_after: int | None = None):
    stop = None if stop_after is None else (lambda info: info["updates"] >= stop_after)
    return agents.train("Routing-v0", {}, "ppo", UPDATES * STEPS_PER_UPDATE, seed=0,
                        num_envs=NUM_ENVS, shard=True, progress=False, out_dir=out_dir,
                        resume=resume, chunk_updates=1, callback=stop)


def main() -> None:
    assert jax.device_count() == NUM_PROCESSES * LOCAL_DEVICES, jax.devices()
    whole = gathered(run().params)
    ckpt_dir = os.path.join(OUT_DIR, "run")
    half = gathered(run(ckpt_dir, stop_after=UPDATES // 2).params)
    resumed = run(ckpt_dir, resume=True)
    assert resumed.resumed_from == UPDATES // 2, resumed.resumed_from
    again = gathered(resumed.params)
    if PROCESS_ID == 0:
        np.savez(os.path.join(OUT_DIR, "params.npz"),
                 **{f"whole_{i}": x for i, x in enumerate(whole)},
                 **{f"half_{i}": x for i, x in enumerate(half)},
                 **{f"resumed_{i}": x for i, x in enumerate(again)})
    print(f"process {PROCESS_ID}: ok", flush=True)


if __name__ == "__main__":
    main()
