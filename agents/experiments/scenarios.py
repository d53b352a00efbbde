"""Every scenario of docs/results.md, fixed here before anything runs, each with its reason.

Loads are fractions of the nominal full-batch capacity `service_capacity(params)` (sum over
GPUs of `B / E[T(full batch)]`, req/s; `jaxserve.evaluation.capacity`). Static batches are
rarely full, so a cluster saturates below load 1.
"""

from __future__ import annotations

import jaxserve
from jaxserve.core import arrivals as A
from jaxserve.core.profiles import get_profile
from jaxserve.core.types import GPUProfile
from jaxserve.evaluation.capacity import service_capacity

# (a) The study's setting: two identical replicas, requests of a fast (short) and a slow
# (long) class, greedy static batching (no waiting to fill a batch: the profile's
# timeout 0), weak baselines. Load 0.9: high enough that routing decides throughput and
# latency, as in the study's comparison.
STUDY_LOAD = 0.9
STUDY_REASON = ("two identical A100x4 Llama-2-70B replicas ('mid'), Routing-v0's short/long "
                "mix (80% 256->32 tokens, 20% 1024->512), greedy batches (timeout 0), load "
                f"{STUDY_LOAD} of full-batch capacity: the study's setting as far as it is "
                "known (identical GPUs, fast/slow request classes, no batch waiting)")


def study():
    """(env, params) of experiment (a)."""
    _, p = jaxserve.make("Routing-v0", gpus=[get_profile("mid")] * 2)
    rate = STUDY_LOAD * service_capacity(p)
    return jaxserve.make("Routing-v0", gpus=[get_profile("mid")] * 2, arrival_rate=rate)


# (c) Heterogeneous clusters, four replicas each (one observation shape, so both train in
# one program). A: the registered Routing-v0 (2 fast H100x4 + 2 slow A100x2) at its 2 req/s.
# B: one fast and three slow replicas at the same fraction of capacity: the fast replica is
# scarce, so the best split of long requests differs from A's.
MIXES = {
    "2fast+2slow": ["fast", "fast", "slow", "slow"],
    "1fast+3slow": ["fast", "slow", "slow", "slow"],
}
MIX_REASON = ("A = the registered Routing-v0 cluster and load (2 req/s); B = one fast and "
              "three slow replicas at the same fraction of full-batch capacity (a scarce fast "
              "replica changes where long requests should go)")
ROUTING_RATE_A = 2.0
CAPACITY_SLO_P99_S = 60.0  # above p99_lower_bound (23.5 s: a long request alone on a slow GPU)


def routing_mix(name: str):
    """(env, params) of mix `name` at the high load of experiment (c)."""
    _, pa = jaxserve.make("Routing-v0")
    frac = ROUTING_RATE_A / service_capacity(pa)
    gpus = [get_profile(t) for t in MIXES[name]]
    _, p = jaxserve.make("Routing-v0", gpus=gpus)
    return jaxserve.make("Routing-v0", gpus=gpus, arrival_rate=frac * service_capacity(p))


# (b) One GPU. "mid" = the registered Batching-v0 (A100x4 Llama-2-70B, B = 16, the short/long
# token mix) at several loads; "affine" = a service time linear in the batch size
# (T_k = 1 + 0.05 k s, fixed 128 -> 1 token requests, B = 16) at 7 req/s (load 0.79), where the
# SMDP optimum waits until 4 requests queue: no static (B, tau) can express that rule.
# Both have B = 16 and a 64-slot queue, so they train in one program; the affine workload is
# written as two identical classes to share the token distribution's shape.
BATCHING_REASON = ("'mid' = registered Batching-v0 (one A100x4 Llama-2-70B replica, B = 16, "
                   "short/long mix) at loads from light to near saturation; 'affine' = "
                   "T_k = 1 + 0.05 k s, fixed-size requests, 7 req/s, where the SMDP optimum "
                   "is a control limit (wait until 4 queue) that no static (B, tau) expresses")
AFFINE_RATE = 7.0


def batching_mid(load: float):
    """(env, params) of the registered Batching-v0 at `load` of full-batch capacity."""
    _, p = jaxserve.make("Batching-v0")
    return jaxserve.make("Batching-v0", arrival_rate=load * service_capacity(p))


def batching_affine():
    """(env, params) of the affine single-GPU scenario."""
    gpu = GPUProfile(c0=1.0, alpha=3.9e-4, beta=0.0, gamma=0.0, max_batch=16, queue_cap=64,
                     name="affine")
    tokens = A.class_mixture([0.5, 0.5], [128, 128], [0.0, 0.0], [1, 1], [0.0, 0.0])
    return jaxserve.make("Batching-v0", gpus=[gpu], arrival_rate=AFFINE_RATE, tokens=tokens)


# (d) Trained on mix A's Poisson arrivals; evaluated unchanged on other arrival processes and
# real traces rescaled to the same offered load (`traces.rescale_to_load`), the heuristics
# fitted on Poisson tuning streams as in (c) (never on the trace they are scored on).
MMPP_BURST = dict(ratio=4.0, high_frac=0.2, mean_high_s=60.0)  # 20% of time at 4x the low rate
GEN_TRACES = {
    "azure_code": "azure_llm_2023/AzureLLMInferenceTrace_code.csv",
    "azure_conv": "azure_llm_2023/AzureLLMInferenceTrace_conv.csv",
    "azure_functions": "azure_functions_2021/Azure2021_200_invitro_sample.csv",
}


def mmpp_same_mean(rate: float, ratio: float, high_frac: float, mean_high_s: float):
    """A two-phase MMPP with mean rate `rate`: a fraction `high_frac` of the time at `ratio`
    times the low phase's rate, high phases lasting `mean_high_s` on average."""
    low = rate / (1.0 - high_frac + high_frac * ratio)
    leave_high = 1.0 / mean_high_s
    leave_low = leave_high * high_frac / (1.0 - high_frac)
    return A.mmpp([low, low * ratio], [[0.0, leave_low], [leave_high, 0.0]])
