"""Registry of the public trace files jaxserve reads: where each comes from and its hash.

One `TraceFile` per file of the trace mirror (the folder `../shared/traces` beside the
repository, whose README gives the provenance of every file; a user gets the same files with
`jaxserve-traces fetch NAME`, see `jaxserve.traces.store`). Each entry names:

  * `relpath`: the file's path inside a folder laid out like the mirror (and inside the cache);
  * `url`: the official upstream file, a raw GitHub URL pinned at a commit;
  * `sha256` / `size`: of the file *as stored in the mirror* (the bytes the loaders read);
  * `licence` and `citation` of the data;
  * where the stored file is not the upstream download byte for byte, `download_sha256` (the
    upstream file's hash, checked by pooch on download) and `processor`, the pooch processor
    that makes the stored file from the download (`GzipCompress`, `FirstLines`, `ZipMember`).

Every URL and hash below was checked against the upstream repository at the pinned commit:
the download hashes are those of the upstream files (git objects at that commit), the stored
hashes those of the mirror's files.

Gzip entries (Mooncake): the mirror's `.gz` was written by the `gzip` tool (with a file name and
time stamp in its header), which `fetch` cannot reproduce byte for byte; what is equal is the
decompressed content, the upstream file itself. So a gzip entry also carries
`content_sha256` (of the decompressed bytes, = `download_sha256`), and a `.gz` file verifies
if either its own hash is `sha256` (the mirror's copy) or its decompressed bytes hash to
`content_sha256` (a fetched copy).
"""

from __future__ import annotations

import dataclasses
import gzip
import os
import shutil
import zipfile
from typing import Any, Callable, Optional

__all__ = ["REGISTRY", "TraceFile", "GzipCompress", "FirstLines", "ZipMember", "entry",
           "entry_for", "names"]


# --- pooch processors: how a stored file is made from its upstream download ---------------
# A pooch processor is called as `processor(fname, action, pooch)` after the download (action
# "download", "update" or "fetch") and returns the path of the file to use. These write the
# stored file beside the download (`fname + suffix`); `store.fetch` moves it into place.


class _Processor:
    suffix = ".processed"

    def __call__(self, fname: str, action: str, pooch: Any = None) -> str:
        out = fname + self.suffix
        if action in ("download", "update") or not os.path.exists(out):
            tmp = out + ".part"
            self.make(fname, tmp)
            os.replace(tmp, out)
        return out

    def make(self, src: str, dst: str) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class GzipCompress(_Processor):
    """The stored file is the download gzip-compressed (level 9, no name, time stamp 0)."""

    level: int = 9

    def make(self, src: str, dst: str) -> None:
        with open(src, "rb") as fi, open(dst, "wb") as raw:
            with gzip.GzipFile(filename="", mode="wb", compresslevel=self.level, fileobj=raw,
                               mtime=0) as fo:
                shutil.copyfileobj(fi, fo)

    def describe(self) -> str:
        return f"gzip -{self.level} of the download"


@dataclasses.dataclass(frozen=True)
class FirstLines(_Processor):
    """The stored file is the download's first `n` lines, bytes and line endings unchanged."""

    n: int

    def make(self, src: str, dst: str) -> None:
        with open(src, "rb") as fi, open(dst, "wb") as fo:
            for i, line in enumerate(fi):
                if i >= self.n:
                    break
                fo.write(line)

    def describe(self) -> str:
        return f"first {self.n} lines of the download"


@dataclasses.dataclass(frozen=True)
class ZipMember(_Processor):
    """The stored file is the member `member` of the downloaded zip archive."""

    member: str

    def make(self, src: str, dst: str) -> None:
        with zipfile.ZipFile(src) as z, z.open(self.member) as fi, open(dst, "wb") as fo:
            shutil.copyfileobj(fi, fo)

    def describe(self) -> str:
        return f"member {self.member!r} of the downloaded zip"


# --- the registry ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TraceFile:
    """One public trace file (see the module doc).

    Attributes:
      name: short name (`jaxserve-traces fetch NAME`, `jaxserve.traces.path(NAME)`).
      relpath: path inside a folder laid out like the mirror, e.g. "azure_llm_2023/...csv".
      url: upstream file (raw GitHub URL at a pinned commit), or None when no upstream
        download could be confirmed (then `url_note` says where to get the file by hand).
      sha256: of the stored file (the mirror's bytes).
      size: of the stored file, in bytes.
      licence: SPDX-like licence of the data (with a note where the hosting repo has none).
      citation: what to cite.
      source: repository, path and commit of the upstream file, in words.
      download_sha256: sha256 of the upstream download when it differs from the stored file.
      processor: pooch processor making the stored file from the download (None: identical).
      content_sha256: for gzip-stored files, sha256 of the decompressed bytes.
      url_note: why `url` is None / how to get the file by hand.
    """

    name: str
    relpath: str
    url: Optional[str]
    sha256: str
    size: int
    licence: str
    citation: str
    source: str
    download_sha256: Optional[str] = None
    processor: Optional[Callable[..., str]] = None
    content_sha256: Optional[str] = None
    url_note: str = ""

    @property
    def identical(self) -> bool:
        """Whether the stored file is the upstream download byte for byte."""
        return self.processor is None

    @property
    def known_hash(self) -> str:
        """The hash pooch checks on download (the upstream file's)."""
        return "sha256:" + (self.download_sha256 or self.sha256)

    def describe_processing(self) -> str:
        if self.processor is None:
            return "the upstream file, byte-identical"
        return self.processor.describe()


_RAW = "https://raw.githubusercontent.com"
_AZURE = "Azure/AzurePublicDataset"
_AZURE_COMMIT = "790921015d50dd6aae7f7e47f39ba0e235ad6b08"  # added the LLM 2023 traces
_MOONCAKE = "kvcache-ai/Mooncake"
_MOONCAKE_COMMIT = "3cca71daccf2a7afb8fe3f0295358f70e3a69fdb"  # last change of both traces
_CITE_SPLITWISE = ("P. Patel et al., \"Splitwise: Efficient Generative LLM Inference Using "
                   "Phase Splitting\", ISCA 2024")
_CITE_BURSTGPT = ("Y. Wang et al., \"BurstGPT: A Real-World Workload Dataset to Optimize LLM "
                  "Serving Systems\", KDD 2025 (arXiv:2401.17644)")
_CITE_HARVEST = ("Y. Zhang et al., \"Faster and Cheaper Serverless Computing on Harvested "
                 "Resources\", SOSP 2021 (Azure Functions Invocation Trace 2021)")
_CITE_MOONCAKE = ("R. Qin et al., \"Mooncake: A KVCache-centric Disaggregated Architecture "
                  "for LLM Serving\", FAST 2025")

_ENTRIES = (
    TraceFile(
        name="azure_llm_2023_code",
        relpath="azure_llm_2023/AzureLLMInferenceTrace_code.csv",
        url=f"{_RAW}/{_AZURE}/{_AZURE_COMMIT}/data/AzureLLMInferenceTrace_code.csv",
        sha256="54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6",
        size=320117,
        licence="CC-BY-4.0",
        citation=_CITE_SPLITWISE,
        source=f"{_AZURE} data/AzureLLMInferenceTrace_code.csv @ {_AZURE_COMMIT}",
    ),
    TraceFile(
        name="azure_llm_2023_conv",
        relpath="azure_llm_2023/AzureLLMInferenceTrace_conv.csv",
        url=f"{_RAW}/{_AZURE}/{_AZURE_COMMIT}/data/AzureLLMInferenceTrace_conv.csv",
        sha256="2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8",
        size=719188,
        licence="CC-BY-4.0",
        citation=_CITE_SPLITWISE,
        source=f"{_AZURE} data/AzureLLMInferenceTrace_conv.csv @ {_AZURE_COMMIT}",
    ),
    TraceFile(
        name="burstgpt_first30",
        relpath="burstgpt/BurstGPT_1_first30rows_verified.csv",
        url=(f"{_RAW}/fnstggl/energy2/31fdd8a087f82f19d455f6344a0cb8be09fcf8ba/"
             "tests/fixtures/burstgpt_sample.csv"),
        sha256="ae1adecd52e0cebee8ecef60128a5fdee6557554c54a7db9ab29e47e28559973",
        size=1297,
        licence="CC-BY-4.0 (BurstGPT data; the hosting repository has no licence file)",
        citation=_CITE_BURSTGPT,
        source=("first 30 rows of HPMLL/BurstGPT data/BurstGPT_1.csv, taken from the fixture "
                "fnstggl/energy2 tests/fixtures/burstgpt_sample.csv @ 31fdd8a0 (its later rows "
                "are hand-made and dropped)"),
        download_sha256="5f846b7a808ea2bbda1ecf73ce23d3cb35b5c9a46a1e282f857790ea53207271",
        processor=FirstLines(31),  # the header and 30 rows
    ),
    TraceFile(
        name="burstgpt_aggregates",
        relpath="burstgpt/BurstGPT_1_derived_aggregates_IsabellaLiu99.json",
        url=(f"{_RAW}/IsabellaLiu99/burstgpt_analysis/"
             "24792c9187895a23c020b9225d36ea9fa2b9fe1e/data%20used.zip"),
        sha256="bcc4ec40ca78c5ba3e0bc9625f37afcccf7a9684bb8950d16cc78fea8ceb4be4",
        size=269024,
        licence="CC-BY-4.0 (derived from BurstGPT data; the hosting repository has no licence "
                "file)",
        citation=_CITE_BURSTGPT + "; aggregates by IsabellaLiu99/burstgpt_analysis",
        source=("aggregates of the full HPMLL/BurstGPT BurstGPT_1.csv: member "
                "burstgpt_analysis.json of IsabellaLiu99/burstgpt_analysis 'data used.zip' "
                "@ 24792c91"),
        download_sha256="0db7ecbbcf840dc70086d91c563bce3afa8cc0ddb8d0099f47b7bf2d0d26a799",
        processor=ZipMember("burstgpt_analysis.json"),
    ),
    TraceFile(
        name="azure_functions_2021_sample",
        relpath="azure_functions_2021/Azure2021_200_invitro_sample.csv",
        url=(f"{_RAW}/vhive-serverless/invitro/4953af354e830a8913b2eef8a4a88ffa81621dae/"
             "data/traces/example/Azure2021/Azure2021_200.csv"),
        sha256="d51e9c9ca79872313d94a26b8c52e82fc55855903c92c1f006cfd1a37700673b",
        size=30791,
        licence="CC-BY-4.0 (Azure's data; the invitro repository's code is MIT)",
        citation=_CITE_HARVEST,
        source=("subsample (31 functions, first 1200 s) of the Azure Functions 2021 trace: "
                "vhive-serverless/invitro data/traces/example/Azure2021/Azure2021_200.csv "
                "@ 4953af35"),
    ),
    TraceFile(
        name="mooncake_conversation",
        relpath="mooncake_2025/conversation_trace.jsonl.gz",
        url=f"{_RAW}/{_MOONCAKE}/{_MOONCAKE_COMMIT}/FAST25-release/traces/conversation_trace.jsonl",
        sha256="17ad75b89da069714c17f182595989f88988fc59eb1a6f693398d2d6cab1cb6f",
        size=788662,
        licence="Apache-2.0",
        citation=_CITE_MOONCAKE,
        source=f"{_MOONCAKE} FAST25-release/traces/conversation_trace.jsonl @ {_MOONCAKE_COMMIT}",
        download_sha256="b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df",
        processor=GzipCompress(9),
        content_sha256="b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df",
    ),
    TraceFile(
        name="mooncake_synthetic",
        relpath="mooncake_2025/synthetic_trace.jsonl.gz",
        url=f"{_RAW}/{_MOONCAKE}/{_MOONCAKE_COMMIT}/FAST25-release/traces/synthetic_trace.jsonl",
        sha256="0ddcdeb04b79633c79a9bdbc542f6779b09d28123261dcb83b573207803dbdfb",
        size=294851,
        licence="Apache-2.0",
        citation=_CITE_MOONCAKE,
        source=f"{_MOONCAKE} FAST25-release/traces/synthetic_trace.jsonl @ {_MOONCAKE_COMMIT}",
        download_sha256="bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131",
        processor=GzipCompress(9),
        content_sha256="bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131",
    ),
)

#: name -> TraceFile, in the order above.
REGISTRY: dict[str, TraceFile] = {e.name: e for e in _ENTRIES}
_BY_RELPATH: dict[str, TraceFile] = {e.relpath: e for e in _ENTRIES}


def names() -> list[str]:
    """The registered names, in registry order."""
    return list(REGISTRY)


def entry(name: str) -> TraceFile:
    """The entry registered as `name`; ValueError listing the names if there is none."""
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown trace {name!r}; known traces: {', '.join(REGISTRY)}") from None


def entry_for(key: str) -> TraceFile:
    """The entry for `key`, a registered name or a relative path as in the mirror (e.g.
    "azure_llm_2023/AzureLLMInferenceTrace_conv.csv"); ValueError listing the names if none."""
    if key in REGISTRY:
        return REGISTRY[key]
    rel = str(key).replace(os.sep, "/")
    if rel in _BY_RELPATH:
        return _BY_RELPATH[rel]
    return entry(key)
