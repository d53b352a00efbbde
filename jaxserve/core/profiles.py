"""Named GPU profiles fitted to published LLM-inference latency measurements.

Every profile is one serving replica (a tensor-parallel group of GPUs running one model), named
`<gpu>-<model>-tp<gpus per replica>`. Its service-time coefficients are the closed form of
`docs/contract_static.md` fitted by `scripts/fit_profiles.py` (non-negative least squares, times in
seconds) to measured prefill and decode-iteration times published in

    repository Mutinifni/splitwise-sim (SplitwiseSim, Splitwise paper, ISCA 2024),
    path data/perf_model.csv, commit 378088013a54df6f2052c27ff5ae6ea7619c3ecc, MIT license,

of which the rows used are saved in `jaxserve/core/profile_data/splitwise_perf_model_subset.csv`.
`docs/profiles.md` describes the data, the fit and its limits. The constants below are exactly
what `python -m jaxserve.scripts.fit_profiles --python` prints (a test checks this).

Fit quality (each comment): R^2 and max relative error of each phase over the 60 measured rows
per configuration (batch <= 32; "vs medians": against the median of the 5 repeats of a point),
and the max relative error of the whole-batch service time T(S) (prefill + 128 decode
iterations) over the same rows. The prefill phase's large relative errors are at short single
prompts (tens of ms): the source's batched prefill costs about batch_size times a single
prompt's, a per-sequence overhead the closed form's per-batch `c0` cannot express; the error
in T(S) stays within 8%.

Batcher settings are not measured quantities: every profile has `max_batch=16`,
`queue_cap=64`, `timeout=0.0` (greedy); change them with `get_profile(name, **overrides)`.
"""

from __future__ import annotations

from jaxserve.core.types import GPUProfile, validate_profile

DEFAULT_MAX_BATCH = 16
DEFAULT_QUEUE_CAP = 64
DEFAULT_TIMEOUT = 0.0


def _profile(name: str, *, c0: float, alpha: float, alpha2: float, beta: float, gamma: float,
             delta: float) -> GPUProfile:
    return GPUProfile(c0=c0, alpha=alpha, alpha2=alpha2, beta=beta, gamma=gamma, delta=delta,
                      max_batch=DEFAULT_MAX_BATCH, queue_cap=DEFAULT_QUEUE_CAP,
                      timeout=DEFAULT_TIMEOUT, name=name)


# Source of every entry: Mutinifni/splitwise-sim, data/perf_model.csv, commit
# 378088013a54df6f2052c27ff5ae6ea7619c3ecc (MIT); fitted by scripts/fit_profiles.py.
PROFILES: dict[str, GPUProfile] = {
    # llama2-70b on h100-80gb, tensor_parallel=2: prefill R^2=0.9999, max rel err 0.459 (0.385
    # vs medians); decode R^2=0.9624, max rel err 0.054 (0.050 vs medians); service time max
    # rel err 0.045.
    "h100-llama2-70b-tp2": _profile(
        "h100-llama2-70b-tp2",
        c0=0.0112395788511425, alpha=0.00014397488039973228, alpha2=2.2196569638913515e-09,
        beta=0.036831956506048286, gamma=0.0004190744990332134, delta=6.682699844177965e-08),
    # llama2-70b on h100-80gb, tensor_parallel=4: prefill R^2=0.9980, max rel err 0.584 (0.580
    # vs medians); decode R^2=0.9619, max rel err 0.045 (0.038 vs medians); service time max
    # rel err 0.037.
    "h100-llama2-70b-tp4": _profile(
        "h100-llama2-70b-tp4",
        c0=0.0072028377608323365, alpha=0.00010456915642024097, alpha2=1.2003759540967635e-09,
        beta=0.029205822557703466, gamma=0.0002218953817941875, delta=3.480993042362376e-08),
    # llama2-70b on h100-80gb, tensor_parallel=8: prefill R^2=0.9939, max rel err 0.802 (0.793
    # vs medians); decode R^2=0.9312, max rel err 0.071 (0.057 vs medians); service time max
    # rel err 0.063.
    "h100-llama2-70b-tp8": _profile(
        "h100-llama2-70b-tp8",
        c0=0.0, alpha=9.380926506953312e-05, alpha2=1.0612050411322038e-09,
        beta=0.029636141802520374, gamma=0.00018465097496102802, delta=2.0992774197910152e-07),
    # llama2-70b on a100-80gb, tensor_parallel=2: prefill R^2=0.9970, max rel err 0.381 (0.379
    # vs medians); decode R^2=0.8858, max rel err 0.059 (0.057 vs medians); service time max
    # rel err 0.057.
    "a100-llama2-70b-tp2": _profile(
        "a100-llama2-70b-tp2",
        c0=0.0, alpha=0.0003935461610248334, alpha2=0.0,
        beta=0.055384675443768176, gamma=0.0005048729192118847, delta=1.218581455062459e-07),
    # llama2-70b on a100-80gb, tensor_parallel=4: prefill R^2=0.9836, max rel err 0.581 (0.577
    # vs medians); decode R^2=0.8770, max rel err 0.044 (0.043 vs medians); service time max
    # rel err 0.059.
    "a100-llama2-70b-tp4": _profile(
        "a100-llama2-70b-tp4",
        c0=0.0, alpha=0.00031057113258863765, alpha2=0.0,
        beta=0.04379239653444732, gamma=0.00010336361083524605, delta=3.3907479970583385e-07),
    # llama2-70b on a100-80gb, tensor_parallel=8: prefill R^2=0.9687, max rel err 0.586 (0.585
    # vs medians); decode R^2=0.9168, max rel err 0.037 (0.030 vs medians); service time max
    # rel err 0.067.
    "a100-llama2-70b-tp8": _profile(
        "a100-llama2-70b-tp8",
        c0=0.0, alpha=0.00021194100805666704, alpha2=0.0,
        beta=0.04415530250132211, gamma=0.00013310364357453473, delta=3.3278031749096934e-07),
    # bloom-176b on h100-80gb, tensor_parallel=8: prefill R^2=0.9971, max rel err 0.606 (0.596
    # vs medians); decode R^2=0.9699, max rel err 0.031 (0.027 vs medians); service time max
    # rel err 0.039.
    "h100-bloom-176b-tp8": _profile(
        "h100-bloom-176b-tp8",
        c0=0.0, alpha=0.00015171978492897872, alpha2=4.239508494254543e-09,
        beta=0.03574408744281694, gamma=0.00023419215430781217, delta=1.7193546205947671e-07),
    # bloom-176b on a100-80gb, tensor_parallel=8: prefill R^2=0.9827, max rel err 0.449 (0.424
    # vs medians); decode R^2=0.9877, max rel err 0.029 (0.020 vs medians); service time max
    # rel err 0.079.
    "a100-bloom-176b-tp8": _profile(
        "a100-bloom-176b-tp8",
        c0=0.0, alpha=0.0003575033542952139, alpha2=8.944638634860495e-09,
        beta=0.0481429583922021, gamma=0.0003718236408437269, delta=3.622871582773554e-07),
}

# Three tiers serving the same model (Llama-2-70B), for heterogeneous clusters. Service time of
# 8 requests with p=512, o=128: fast 4.42 s, mid 7.16 s, slow 9.28 s. The source has no card
# slower than an A100; "slow" is an A100 replica with half the GPUs (tensor_parallel=2).
TIERS: dict[str, str] = {
    "fast": "h100-llama2-70b-tp4",
    "mid": "a100-llama2-70b-tp4",
    "slow": "a100-llama2-70b-tp2",
}


def profile_names() -> list[str]:
    """Names of the published profiles, in definition order."""
    return list(PROFILES)


def get_profile(name: str, **overrides) -> GPUProfile:
    """Returns the named profile, or a tier's ("fast", "mid", "slow") profile.

    Keyword overrides replace fields, e.g. `get_profile("a100-llama2-70b-tp4", max_batch=8)`;
    the result is validated. Raises ValueError, listing the valid names, for an unknown name,
    and for an unknown or invalid override.
    """
    key = TIERS.get(name, name) if isinstance(name, str) else name
    if not isinstance(key, str) or key not in PROFILES:
        valid = ", ".join(list(PROFILES) + list(TIERS))
        raise ValueError(f"unknown GPU profile {name!r}; valid names: {valid}")
    profile = PROFILES[key]
    if overrides:
        unknown = sorted(set(overrides) - set(GPUProfile.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown GPUProfile field(s) {unknown}; valid: "
                             f"{', '.join(GPUProfile.__dataclass_fields__)}")
        profile = profile.replace(**overrides)
        validate_profile(profile, where=f"get_profile({name!r})")
    return profile
