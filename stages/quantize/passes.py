"""Where the quantize stage's time goes: each pass over the float chain or the weights, timed with what
it read (`figures.passes` in quantized/report.json; `make bench` and `make bench-calibration` read it).

The calibration recipe (how many tokens each pass takes) is chosen from these figures and the quality
each size gives, so a pass is timed as one unit: its own loading, its chain calls and its arithmetic.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

# The passes that make the 4-bit weights (GPTQ's Hessians, the rounding, the mixed precision's measured
# sensitivity, the scale search), in the order they run.
WEIGHT_PASSES = ("hessians", "rounding", "sensitivity", "scale_search")


@dataclass
class PassTime:
    name: str
    wall_s: float
    tokens: int | None = None  # calibration or held-out tokens the pass read (None: it reads none)
    units: int | None = None  # what it iterates over: chain calls, weights or graphs
    unit: str | None = None


@dataclass
class PassClock:
    passes: list[PassTime] = field(default_factory=list)

    @contextmanager
    def run(
        self, name: str, tokens: int | None = None, units: int | None = None, unit: str | None = None
    ) -> Iterator[PassTime]:
        """Time one pass; the caller may fill in `units` on the yielded record while it runs."""
        record = PassTime(name, 0.0, tokens, units, unit)
        t0 = time.perf_counter()
        try:
            yield record
        finally:
            record.wall_s = round(time.perf_counter() - t0, 2)
            self.passes.append(record)

    def figures(self) -> list[dict]:
        return [{k: v for k, v in asdict(p).items() if v is not None} for p in self.passes]

    def seconds(self, name: str) -> float:
        return sum(p.wall_s for p in self.passes if p.name == name)


def tokens_of(samples: list[list[int]]) -> int:
    return sum(len(s) for s in samples)
