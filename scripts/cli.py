"""What the jaxserve command-line tools share: one-line errors and the `main` wrapper."""

from __future__ import annotations

import argparse
import sys
from typing import Callable


class CLIError(Exception):
    """A user error: printed as one line on stderr, exit status 2."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are `CLIError`s (one line, no usage dump)."""

    def error(self, message):
        raise CLIError(message)


def run_cli(prog: str, body: Callable[[], int]) -> int:
    """Runs `body()` and turns user errors (`CLIError`, ValueError, TypeError, OSError) into
    `prog: error: <one line>` on stderr and exit status 2."""
    try:
        return body()
    except (CLIError, ValueError, TypeError, OSError) as e:
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"{prog}: error: {msg}", file=sys.stderr)
        return 2
