"""stages/core/progress.py: bars on a terminal, a few whole lines in a log."""

import io

import pytest

from stages.core.progress import line_mode, tqdm


def test_a_log_gets_a_line_at_the_start_and_one_at_the_end_not_thousands(monkeypatch):
    monkeypatch.setenv("G4V69_PROGRESS", "lines")
    log = io.StringIO()
    for _ in tqdm(range(5000), desc="round weights", unit="weight", file=log, leave=False):
        pass
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and "\x1b" not in log.getvalue()
    assert 2 <= len(lines) <= 3  # quicker than the interval: the start, perhaps one, the end
    assert lines[0].startswith("round weights:   0%") and lines[-1].startswith("round weights: 100%")
    assert "5000/5000" in lines[-1]


def test_a_terminal_keeps_tqdms_redrawn_bar(monkeypatch):
    monkeypatch.setenv("G4V69_PROGRESS", "bars")
    out = io.StringIO()
    with tqdm(total=3, desc="x", file=out, mininterval=0) as bar:
        for _ in range(3):
            bar.update()
    assert "\r" in out.getvalue()


@pytest.mark.parametrize("mode, expected", [("lines", True), ("bars", False)])
def test_the_hosts_choice_wins_over_this_process_stderr(monkeypatch, mode, expected):
    """In a container stderr is never a terminal; the Makefile passes what the host's is."""
    monkeypatch.setenv("G4V69_PROGRESS", mode)
    assert line_mode(io.StringIO()) is expected


def test_without_a_choice_a_stream_that_is_no_terminal_is_a_log(monkeypatch):
    monkeypatch.delenv("G4V69_PROGRESS", raising=False)
    assert line_mode(io.StringIO()) is True
