"""Iteration times from measured per-layer kernel profiles, and their fit to the replica form.

A kernel profile (LLMServingSim's profiler output, `profiles/<GPU>/<org>/<model>/bf16/tp<k>/`,
casys-kaist/LLMServingSim, MIT; see `../shared/fidelity/llmservingsim_vllm_bench/README.md`)
holds per-layer GPU latencies of one decoder layer measured in vLLM 0.19.0 on the serving GPU:

* `dense.csv` (`layer, tokens, time_us`): the token-parallel layers (projections, norms,
  activation, rotary embedding, embedding, final norm) at a given token count;
* `attention.csv` (`prefill_chunk, kv_prefill, n_decode, kv_decode, time_us`): one layer's
  attention for a prefill chunk of `prefill_chunk` tokens after `kv_prefill` cached ones,
  together with `n_decode` decodes each reading `kv_decode` tokens of context;
* `per_sequence.csv` (`layer, sequences, time_us`): `lm_head` and `sampler`, per sampled
  sequence;
* `moe.csv` (`tokens, activated_experts, time_us`, MoE models): the expert layer.

`KernelProfile.step_time` composes one iteration (`docs/fidelity.md`, "Step times"):

    T = embedding(N) + final_layernorm(N) + lm_head(S) + sampler(S)
        + layers * [sum of the per-layer dense ops at N (layernorm twice) + attention + moe(N)]

with `N` the tokens computed, `S` the scheduled sequences (vLLM v1 computes logits for the last
token of every scheduled request), attention interpolated between measured points (linear
extrapolation past them) at the decodes' mean context, moved a fitted fraction towards the
longest context's time where the profile measured that skew (`skew_fit`), and several
prefills in one iteration as the largest one (with the decodes, in the mixed grid) plus the
others' prefill-only cost.
`fit_iteration_form` then fits `core.replica`'s form by least squares in relative error over
the batch compositions a replica actually sees, and states the residuals.
"""

from __future__ import annotations

import csv
import gzip
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml
from scipy.optimize import lsq_linear

__all__ = ["KernelProfile", "MODEL_SHAPES", "load_kernel_profile", "composition_features",
           "fit_iteration_form", "FORM_FIELDS", "moe_tokens_of"]

# Decoder layers, KV heads x head dim, parameters (for weight bytes) and MoE experts of the
# models the bench profiles, from each model's Hugging Face `config.json`
# (num_hidden_layers, num_key_value_heads, head_dim or hidden_size / num_attention_heads,
# num_experts, num_experts_per_tok) and its model card (parameter count).
MODEL_SHAPES = {
    "meta-llama/Llama-3.1-8B": dict(layers=32, kv_hidden=8 * 128, params=8.03e9),
    "Qwen/Qwen3-30B-A3B-Instruct-2507": dict(layers=48, kv_hidden=4 * 128, params=30.53e9,
                                             experts=128, experts_per_token=8, hidden=2048),
    "Qwen/Qwen3-32B": dict(layers=64, kv_hidden=8 * 128, params=32.8e9),
    "meta-llama/Llama-3.1-70B": dict(layers=80, kv_hidden=8 * 128, params=70.6e9),
    "meta-llama/Llama-3.1-70B-Instruct": dict(layers=80, kv_hidden=8 * 128, params=70.6e9),
    "meta-llama/Llama-3.1-8B-Instruct": dict(layers=32, kv_hidden=8 * 128, params=8.03e9),
}

# Per-layer ops that run once per step rather than once per decoder layer.
_ONCE_PER_STEP = ("embedding", "final_layernorm")
# Ops that run more than once per decoder layer: input and post-attention RMSNorm.
_PER_LAYER_COUNT = {"layernorm": 2}


def _read_csv(path: Path) -> dict[str, np.ndarray]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    if len(rows) < 2:
        raise ValueError(f"{path} holds no rows")
    head, body = rows[0], rows[1:]
    cols = {}
    for j, name in enumerate(head):
        vals = [r[j] for r in body]
        try:
            cols[name] = np.array([float(v) for v in vals])
        except ValueError:
            cols[name] = np.array(vals)
    return cols


def _find(folder: Path, stem: str) -> Path | None:
    for p in (folder / f"{stem}.csv", folder / f"{stem}.csv.gz"):
        if p.is_file():
            return p
    return None


def _lerp(x: float, xs: np.ndarray, ys: np.ndarray) -> float:
    """Piecewise-linear `ys(xs)` at `x`, extrapolating the end segments linearly."""
    if len(xs) == 1:
        return float(ys[0])
    i = int(np.clip(np.searchsorted(xs, x, side="right") - 1, 0, len(xs) - 2))
    w = (x - xs[i]) / (xs[i + 1] - xs[i])
    return float(ys[i] + w * (ys[i + 1] - ys[i]))


class _NestedTable:
    """`time_us` over measured points of several keys, not necessarily a full grid: values of
    the first key each hold a table of the rest, and a query interpolates (linearly,
    extrapolating past the ends) between the two measured values that bracket it at each
    level, so it reads `2^d` one-dimensional curves."""

    def __init__(self, cols: dict, keys: tuple[str, ...], mask: np.ndarray):
        self.keys = keys
        self.root = self._build({k: cols[k][mask] for k in keys + ("time_us",)}, 0)
        if self.root is None:
            raise ValueError(f"no rows for {keys}")

    def _build(self, cols, level):
        if len(cols["time_us"]) == 0:
            return None
        x = cols[self.keys[level]]
        vals = np.unique(x)
        if level == len(self.keys) - 1:
            ys = np.array([cols["time_us"][x == v].mean() for v in vals])
            return vals, ys
        kids = [self._build({k: c[x == v] for k, c in cols.items()}, level + 1) for v in vals]
        return vals, kids

    def __call__(self, *point: float) -> float:
        return self._at(self.root, point, 0)

    def _at(self, node, point, level):
        vals, kids = node
        x = float(point[level])
        if level == len(self.keys) - 1:
            return _lerp(x, vals, kids)
        if len(vals) == 1:
            return self._at(kids[0], point, level + 1)
        i = int(np.clip(np.searchsorted(vals, x, side="right") - 1, 0, len(vals) - 2))
        lo, hi = self._at(kids[i], point, level + 1), self._at(kids[i + 1], point, level + 1)
        return _lerp(x, vals[i:i + 2], np.array([lo, hi]))


@dataclass(frozen=True)
class KernelProfile:
    """One model on one GPU (at one tensor-parallel degree): per-layer latencies (us) and how
    many decoder layers the model has. Build with `load_kernel_profile`."""

    name: str
    layers: int
    dense: dict = field(repr=False)  # op -> (tokens, time_us)
    per_sequence: dict = field(repr=False)  # op -> (sequences, time_us)
    prefill_attn: _NestedTable = field(repr=False)  # (chunk, kv_prefill)
    decode_attn: _NestedTable = field(repr=False)  # (n_decode, kv_decode)
    mixed_attn: _NestedTable | None = field(repr=False, default=None)  # all four
    moe: dict | None = field(repr=False, default=None)  # tokens -> (activated, time_us)
    experts: tuple | None = None  # (experts, experts per token) of an MoE model
    skew: dict | None = field(repr=False, default=None)  # `_read_skew_fit`
    ep: int = 1  # expert-parallel ranks the experts are spread over
    # Expert-parallel collectives: (link bytes/s, latency s, hidden size), or None (not
    # modelled). See `_ep_comm_us`.
    ep_link: tuple | None = None

    def _ep_comm_us(self, n: float) -> float:
        """One MoE layer's expert-parallel collectives (vLLM's default
        `allgather_reducescatter` all2all backend), as LLMServingSim sizes them
        (`serving/core/trace_generator.py`, `_emit_moe_block`): an all-gather of
        `n / ep` tokens x (hidden + experts) bf16 values and a reduce-scatter of `n` tokens x
        hidden, each one link latency plus bytes / bandwidth (no ring factors)."""
        if self.ep_link is None or self.ep <= 1 or self.experts is None:
            return 0.0
        bw, lat, hidden = self.ep_link
        e, _k = self.experts
        gather = n / self.ep * (hidden + e) * 2.0
        scatter = n * hidden * 2.0
        return 1e6 * (2 * lat + (gather + scatter) / bw)

    def _skew_alpha(self, pc: int, n: int, rate: float, kv_big: float, kp: int) -> float:
        """The profile's fitted weight of the longest decode (`_read_skew_fit`)."""
        sk = self.skew
        ax = sk["axes"]

        def label(bins, labels, v):
            for i in range(len(labels)):
                if v <= bins[i + 1]:
                    return labels[i]
            return labels[-1]

        key = (f"pc={int(pc)}|{label(ax['n_bins'], ax['n_labels'], n)}|"
               f"{label(ax['skew_rate_bins'], ax['skew_rate_labels'], min(max(rate, 0), 1))}|"
               f"{label(ax['kv_big_bins'], ax['kv_big_labels'], kv_big)}|"
               f"{label(ax['kp_bins'], ax['kp_labels'], kp)}")
        return float(sk["table"].get(key, sk["alpha_default"]))

    def _dense_us(self, n: np.ndarray) -> np.ndarray:
        per_layer = np.zeros_like(n, dtype=np.float64)
        once = np.zeros_like(n, dtype=np.float64)
        for op, (x, y) in self.dense.items():
            v = np.interp(n, x, y)  # clamps at the ends: below 1 token nothing runs anyway
            if op in _ONCE_PER_STEP:
                once += v
            else:
                per_layer += _PER_LAYER_COUNT.get(op, 1) * v
        return once, per_layer

    def _moe_us(self, n: np.ndarray) -> np.ndarray:
        """The expert layer for `n` tokens on one expert-parallel rank of `ep`, with
        LLMServingSim's balanced gate (`serving/core/gate_function.py`,
        `GateFunction._balanced_route_ep`): the `n k` token-expert pairs spread evenly, so a
        rank runs `min(n k / ep, e / ep)` experts on the tokens that reach it,
        `n (1 - (1 - 1/ep)^k)`."""
        if self.moe is None or self.experts is None:
            return np.zeros_like(n, dtype=np.float64)
        e, k = self.experts
        ep = max(int(self.ep), 1)
        act = np.minimum(np.round(n * k / ep), e // ep)
        local = np.round(n * (1.0 - ((ep - 1) / ep) ** k))
        toks = np.array(sorted(self.moe))
        at_tok = np.array([[_lerp(a, *self.moe[t]) for t in toks] for a in np.maximum(act, 1)])
        return np.array([_lerp(x, toks, row) for x, row in zip(np.maximum(local, 1), at_tok)])

    def attention_us(self, prefills, decodes) -> float:
        """One layer's attention (us) for prefills `[(n, C), ...]` and decode contexts `[L]`."""
        d = len(decodes)
        lbar = float(np.mean(decodes)) if d else 0.0
        pf = sorted(prefills, key=lambda x: -x[0])
        rest = sum(self.prefill_attn(n, c) for n, c in pf[1:])
        n, c = pf[0] if pf else (0, 0)

        def at(kv):
            if not pf:
                return self.decode_attn(d, kv) if d else 0.0
            if d and self.mixed_attn is not None:
                return self.mixed_attn(n, c, d, kv)
            return self.prefill_attn(n, c) + (self.decode_attn(d, kv) if d else 0.0)

        main = at(lbar)
        if self.skew is not None and d > 1 and max(decodes) > lbar:
            # Decodes of unequal context: the varlen kernel's tail (SM imbalance) costs a
            # fitted fraction `alpha` of the way from the mean context's time to the longest's
            # (LLMServingSim's skew correction, `serving/core/trace_generator.py`).
            hi, lo = float(max(decodes)), float(min(decodes))
            a = self._skew_alpha(n, d, (lbar - lo) / (hi - lo), hi, c)
            t_max = at(hi)
            if a > 0 and t_max > main:
                main += a * (t_max - main)
        return float(main + rest)

    def step_time(self, prefills, decodes) -> float:
        """Seconds of one iteration computing chunk `n` after `C` cached tokens of each prefill
        `(n, C)` and one token of each decode of context `L` (module docstring)."""
        n_tok = sum(int(n) for n, _ in prefills) + len(decodes)
        if n_tok == 0:
            return 0.0
        seqs = len(prefills) + len(decodes)
        once, per_layer = self._dense_us(np.array([float(n_tok)]))
        moe = self._moe_us(np.array([float(n_tok)]))
        us = once[0] + self.layers * (per_layer[0] + moe[0] + self._ep_comm_us(n_tok)
                                      + self.attention_us(prefills, decodes))
        for _op, (x, y) in self.per_sequence.items():
            us += np.interp(seqs, x, y)
        return float(us) * 1e-6


def _meta(folder: Path) -> dict:
    p = folder / "meta.yaml"
    if not p.is_file():
        return {}
    try:
        return yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{p}: not YAML ({e})") from None


def _read_skew_fit(folder: Path, meta: dict, tp: int) -> dict | None:
    """The profile's skew correction (`meta.yaml` `skew_fit`, its bucket table
    `tp<k>/skew_fit.csv`): `alpha` per bucket of (prefill chunk, decodes, skew rate, longest
    context, cached prefill) and a pooled default; None when the profile has none (then no
    correction: LLMServingSim's rule, "apply no correction you have not measured")."""
    fit = meta.get("skew_fit") or {}
    if not fit.get("enabled"):
        return None
    per_tp = fit.get("per_tp") or {}
    entry = per_tp.get(tp) or per_tp.get(str(tp))
    if not entry:
        return None
    table = {}
    csv_path = entry.get("bucket_table")
    path = _find(folder / f"tp{tp}", "skew_fit") if csv_path else None
    if path is not None:
        c = _read_csv(path)
        for i in range(len(c["alpha"])):
            key = (f"pc={int(float(c['pc'][i]))}|{c['n_label'][i]}|{c['skew_rate_label'][i]}|"
                   f"{c['kv_big_label'][i]}|{c['kp_label'][i]}")
            table[key] = float(c["alpha"][i])
    axes = dict(entry.get("bucket_axes") or fit.get("bucket_axes") or {})
    need = ("n_bins", "n_labels", "skew_rate_bins", "skew_rate_labels", "kv_big_bins",
            "kv_big_labels", "kp_bins", "kp_labels")
    if not all(k in axes for k in need):
        raise ValueError(f"{folder}/meta.yaml skew_fit.bucket_axes lacks one of {need}")
    return {"alpha_default": float(entry.get("alpha_default", 0.0)), "table": table,
            "axes": {k: axes[k] for k in need}}


def load_kernel_profile(folder, tp: int = 1, *, layers: int | None = None,
                        model: str | None = None, ep: int = 1,
                        ep_link: tuple[float, float] | None = None) -> KernelProfile:
    """Reads `folder/tp<tp>/` of a kernel-profile directory (`.../<model>/bf16`).

    Args:
      folder: the profile directory holding `meta.yaml` and `tp<k>/` sub-folders.
      tp: tensor-parallel degree.
      layers: decoder layers of the model (default: `MODEL_SHAPES` for the model `meta.yaml`
        names; ValueError when unknown).
      model: the model's name, overriding `meta.yaml`'s.
      ep: expert-parallel ranks an MoE model's experts are spread over (vLLM's
        `enable_expert_parallel`: data x tensor parallel ranks).
      ep_link: `(bytes/s, latency s)` of the link the expert-parallel collectives cross, to
        add them to each MoE layer (`KernelProfile._ep_comm_us`); None leaves them out.

    Raises:
      ValueError: missing files, an attention table that is not a grid, unknown layer count.
    """
    folder = Path(folder)
    sub = folder / f"tp{int(tp)}"
    if not sub.is_dir():
        raise ValueError(f"{folder} has no tp{tp}/ profile")
    meta = _meta(folder)
    model = model or meta.get("model")
    shape = MODEL_SHAPES.get(model or "", {})
    layers = layers or shape.get("layers")
    if not layers:
        raise ValueError(f"decoder layers of model {model!r} unknown: pass layers=")
    paths = {k: _find(sub, k) for k in ("dense", "attention", "per_sequence", "moe")}
    for k in ("dense", "attention", "per_sequence"):
        if paths[k] is None:
            raise ValueError(f"{sub} has no {k}.csv[.gz]")
    dcols = _read_csv(paths["dense"])
    dense = {}
    for op in np.unique(dcols["layer"]):
        m = dcols["layer"] == op
        o = np.argsort(dcols["tokens"][m])
        dense[str(op)] = (dcols["tokens"][m][o], dcols["time_us"][m][o])
    scols = _read_csv(paths["per_sequence"])
    per_seq = {}
    for op in np.unique(scols["layer"]):
        m = scols["layer"] == op
        o = np.argsort(scols["sequences"][m])
        per_seq[str(op)] = (scols["sequences"][m][o], scols["time_us"][m][o])
    a = _read_csv(paths["attention"])
    pfm = (a["prefill_chunk"] > 0) & (a["n_decode"] == 0)
    dcm = (a["prefill_chunk"] == 0) & (a["n_decode"] > 0)
    mxm = (a["prefill_chunk"] > 0) & (a["n_decode"] > 0)
    if not pfm.any() or not dcm.any():
        raise ValueError(f"{paths['attention']}: needs prefill-only and decode-only rows")
    pf = _NestedTable(a, ("prefill_chunk", "kv_prefill"), pfm)
    dc = _NestedTable(a, ("n_decode", "kv_decode"), dcm)
    mx = (_NestedTable(a, ("prefill_chunk", "kv_prefill", "n_decode", "kv_decode"), mxm)
          if mxm.any() else None)
    moe = None
    if paths["moe"] is not None:
        mc = _read_csv(paths["moe"])
        moe = {}
        for t in np.unique(mc["tokens"]):
            m = mc["tokens"] == t
            o = np.argsort(mc["activated_experts"][m])
            moe[float(t)] = (mc["activated_experts"][m][o], mc["time_us"][m][o])
    experts = None
    if "experts" in shape:
        experts = (shape["experts"], shape["experts_per_token"])
    if moe is not None and experts is None:
        raise ValueError(f"{sub} has an moe profile but the experts of model {model!r} are "
                         "unknown")
    return KernelProfile(name=f"{model}@{folder.parent.parent.parent.name}/tp{tp}",
                         layers=int(layers), dense=dense, per_sequence=per_seq,
                         prefill_attn=pf, decode_attn=dc, mixed_attn=mx,
                         moe=moe, experts=experts,
                         skew=_read_skew_fit(folder, meta, int(tp)), ep=int(ep),
                         ep_link=None if ep_link is None or "hidden" not in shape
                         else (float(ep_link[0]), float(ep_link[1]), int(shape["hidden"])))


FORM_FIELDS = ("c0", "alpha", "alpha2", "beta", "gamma", "delta", "moe")


def moe_tokens_of(profile: KernelProfile) -> int:
    """Tokens at which a balanced gate activates every expert of an MoE model (`ceil(E / k)`,
    `core.replica`'s `moe_tokens`); 1 for a dense model."""
    if profile.experts is None:
        return 1
    e, k = profile.experts
    return int(np.ceil(e / k))


def composition_features(prefills, decodes, moe_tokens: int = 1) -> np.ndarray:
    """The iteration form's regressors for one batch (`core.replica.iteration_time`):
    `[1, prefill tokens, sum n (C + n), any decode, decodes, decode context,
    min(tokens, moe_tokens)]`."""
    npf = float(sum(n for n, _ in prefills))
    att = float(sum(n * (c + n) for n, c in prefills))
    d = float(len(decodes))
    return np.array([1.0, npf, att, float(d > 0), d, float(sum(decodes)),
                     min(npf + d, float(moe_tokens))])


def fit_iteration_form(profile: KernelProfile, compositions, weights=None) -> dict:
    """Least squares in relative error of `core.replica`'s iteration form to the profile's
    step times over `compositions` (a list of `(prefills, decodes)` batches, e.g. every
    iteration of a simulated run).

    The form is linear in `[c0, alpha, alpha2, beta, alpha + gamma, delta, moe]`, each
    bounded below by 0 (so `gamma >= -alpha`, as `validate_replica` requires). `moe`'s term,
    `min(tokens, moe_tokens)` with `moe_tokens = moe_tokens_of(profile)`, is fitted for an MoE
    model only (for a dense one it would be the constant 1, `c0`'s column): the expert layer's
    cost, which grows with the step's tokens until every expert is active and is flat beyond.

    Returns:
      dict with the seven coefficients (s, s/token, s/token^2, s, s, s/token, s/token),
      `moe_tokens`, and `residuals`:
      relative errors `(form - profile) / profile` of the batches (`rms`, `mean`, `p50_abs`,
      `p90_abs`, `max_abs`, `n`), weighted as the fit was.
    """
    comps = list(compositions)
    if not comps:
        raise ValueError("compositions is empty: nothing to fit")
    sat = moe_tokens_of(profile)
    x = np.stack([composition_features(p, d, sat) for p, d in comps])
    if profile.experts is None:
        x[:, 6] = 0.0
    y = np.array([profile.step_time(p, d) for p, d in comps])
    if np.any(y <= 0):
        raise ValueError("a composition computes no token (step time 0)")
    w = np.ones(len(y)) if weights is None else np.asarray(weights, float)
    # The form's regressors, with `alpha + gamma` as the decode count's coefficient.
    a = x / y[:, None] * np.sqrt(w)[:, None]
    b = np.sqrt(w)
    scale = np.maximum(np.abs(a).max(axis=0), 1e-30)  # columns differ by ~10 orders
    sol = lsq_linear(a / scale, b, bounds=(0.0, np.inf), method="bvls", tol=1e-12)
    c0, alpha, alpha2, beta, dec, delta, moe = (sol.x / scale).tolist()
    pred = x @ (sol.x / scale)
    rel = (pred - y) / y
    wn = w / w.sum()
    out = dict(c0=c0, alpha=alpha, alpha2=alpha2, beta=beta, gamma=dec - alpha, delta=delta,
               moe=moe, moe_tokens=sat)
    out["residuals"] = dict(
        rms=float(np.sqrt(np.sum(wn * rel ** 2))), mean=float(np.sum(wn * rel)),
        p50_abs=float(np.median(np.abs(rel))), p90_abs=float(np.percentile(np.abs(rel), 90)),
        max_abs=float(np.abs(rel).max()), n=len(y))
    return out
