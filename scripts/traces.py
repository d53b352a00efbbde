"""jaxserve-traces: list, download and check the public trace files jaxserve reads.

Examples::

    jaxserve-traces list                          # name, licence, size, where it is
    jaxserve-traces fetch azure_llm_2023_conv     # download into the user cache, hash-checked
    jaxserve-traces fetch --all
    jaxserve-traces verify                        # sha256 of every file found

The files are public data on GitHub (upstream URL pinned at a commit, licence and citation of
each: `jaxserve-traces list -v`, or `jaxserve.traces.registry`). `fetch` downloads them with
pooch into the user cache (`pooch.os_cache("jaxserve")/traces`); `JAXSERVE_TRACES_DIR`, a
folder laid out like the trace mirror, is looked at first.
Exit status: 0 success, 1 a download failed or a file failed its hash check, 2 bad usage
(unknown name, ...).
"""

from __future__ import annotations

import argparse
import os
import sys

from jaxserve.scripts.cli import CLIError, Parser
from jaxserve.traces import registry as R
from jaxserve.traces import store as S

PROG = "jaxserve-traces"


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", metavar="{list,fetch,verify}")
    sub.required = True
    ls = sub.add_parser("list", help="the registered trace files and where each is")
    ls.add_argument("-v", "--verbose", action="store_true",
                    help="also the upstream URL, source, processing and citation")
    fe = sub.add_parser("fetch", help="download trace files into the user cache")
    fe.add_argument("names", nargs="*", metavar="NAME", help="registered names (see list)")
    fe.add_argument("--all", action="store_true", help="every registered file")
    fe.add_argument("--force", action="store_true", help="download again even if cached")
    ve = sub.add_parser("verify", help="check the sha256 of every file found")
    ve.add_argument("names", nargs="*", metavar="NAME", help="only these (default: all)")
    for p in (ls, fe, ve):  # subparsers are plain ArgumentParsers: make their errors one line
        p.error = ap.error
    return ap


def _names(given: list[str], every: bool) -> list[str]:
    if every and given:
        raise CLIError("give NAME... or --all, not both")
    if every or not given:
        return R.names()
    for n in given:
        try:
            R.entry(n)
        except ValueError as e:
            raise CLIError(str(e)) from None
    return list(dict.fromkeys(given))


def _size(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def cmd_list(args) -> int:
    rows = []
    for name, e in R.REGISTRY.items():
        where, p = S.locate(name)
        rows.append((name, e.licence.split(" ")[0], _size(e.size), where, str(p or "")))
    heads = ("name", "licence", "size", "status", "path")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads)]
    for r in (heads, *rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if args.verbose and r is not heads:
            e = R.REGISTRY[r[0]]
            print(f"    url: {e.url or 'none (' + e.url_note + ')'}")
            print(f"    source: {e.source}")
            print(f"    stored as: {e.describe_processing()}; sha256 {e.sha256}")
            print(f"    licence: {e.licence}")
            print(f"    cite: {e.citation}")
    print(f"\ncache: {S.cache_dir()}; {S.ENV_VAR}: "
          f"{os.environ.get(S.ENV_VAR) or '(not set)'}")
    return 0


def cmd_fetch(args) -> int:
    if not args.names and not args.all:
        raise CLIError("fetch needs NAME... or --all (names: " + ", ".join(R.names()) + ")")
    failed = 0
    for name in _names(args.names, args.all):
        try:
            p = S.fetch(name, force=args.force)
        except (ValueError, OSError) as e:
            print(f"{PROG}: {name}: failed: {' '.join(str(e).split())}", file=sys.stderr)
            failed += 1
            continue
        print(f"{name}: {p}")
    return 1 if failed else 0


def cmd_verify(args) -> int:
    bad = found = 0
    for name in _names(args.names, False):
        where, p = S.locate(name)
        if p is None:
            print(f"{name}: missing (run `{PROG} fetch {name}`)")
            continue
        found += 1
        try:
            S.verify_file(name, p)
        except ValueError as e:
            print(f"{name}: MISMATCH: {' '.join(str(e).split())}")
            bad += 1
            continue
        print(f"{name}: ok ({where}) {p}")
    print(f"{found} file(s) found, {found - bad} verified, {bad} mismatched")
    return 1 if bad else 0


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return {"list": cmd_list, "fetch": cmd_fetch, "verify": cmd_verify}[args.command](args)
    except (CLIError, ImportError) as e:
        print(f"{PROG}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
