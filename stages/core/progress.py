"""Progress bars for terminals and for logs. Every stage imports `tqdm` from here.

On a terminal these are tqdm's own bars. In a log (CI, `make bundle > log`, a container without a
terminal) tqdm would write a carriage-return update several times a second, which a log keeps as
tens of thousands of lines; here a bar writes one plain line when it starts, then at most one per
LOG_INTERVAL_S, and one when it ends.

Containers never have a terminal (`docker run -i`), so the Makefile tells them what the host's
stderr is: G4V69_PROGRESS=bars or lines (empty: decided from this process's stderr).
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any, TextIO

from tqdm import tqdm as _tqdm

LOG_INTERVAL_S = 30.0
PROGRESS_MODES = ("bars", "lines")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def line_mode(stream: TextIO | None = None) -> bool:
    """Whether bars go to a log (one line per update) rather than to a terminal."""
    mode = os.environ.get("G4V69_PROGRESS", "")
    if mode in PROGRESS_MODES:
        return mode == "lines"
    stream = stream or sys.stderr
    try:
        return not stream.isatty()
    except (AttributeError, ValueError):
        return True


class _Lines:
    """A stream for tqdm that turns its carriage-return redraws into whole lines: the text of each
    redraw, cursor movements and blank clears dropped."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, s: str) -> None:
        for part in _ANSI.sub("", s).replace("\n", "\r").split("\r"):
            text = part.rstrip()
            if text:
                self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


class tqdm(_tqdm):  # noqa: N801 (tqdm's own name, so `from stages.core.progress import tqdm` is the only change)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if line_mode(kwargs.get("file")):
            kwargs["file"] = _Lines(kwargs.get("file") or sys.stderr)
            kwargs["mininterval"] = max(float(kwargs.get("mininterval", 0.1)), LOG_INTERVAL_S)
            kwargs["maxinterval"] = max(float(kwargs.get("maxinterval", 10.0)), LOG_INTERVAL_S)
            kwargs.setdefault("ncols", 100)
            kwargs["dynamic_ncols"] = False
            kwargs["ascii"] = True
            kwargs["leave"] = True  # its last line (100 %, the time taken) is what a log wants
            # a nested bar's position would be cursor movements, meaningless in a log
            kwargs.pop("position", None)
        super().__init__(*args, **kwargs)
