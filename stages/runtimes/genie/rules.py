"""What Genie's runtime refuses, worded once for every module that checks it (the layout check before
export, the emulator while it runs the bundle). Stdlib only."""

from __future__ import annotations


def window_overflow(prefix: str, step: int, slots: int, evictable: int) -> str:
    """Why Genie cannot take a step of `step` tokens into a sliding-window cache group of `slots`
    past slots holding `evictable` entries it may evict; the emulator and the layout check say it
    alike."""
    return (
        f"cache group {prefix!r}: a step of {step} tokens overflows its {slots}-slot window by more than "
        f"the {evictable} entries it can evict (Genie's SlidingWindow::processUpdate pops an empty "
        "recency queue): use a prefill AR no larger than the window"
    )
