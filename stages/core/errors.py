"""The one mark of an error a user can act on: bad input, a missing step, a full disk. Every such error
class of the stages derives from `UserFixable` beside the built-in base that says what kind it is, and
the CLI turns any of them into one line (exit status 2) in one place (stages/cli.py `Main.invoke`),
never a traceback. Stdlib only, so any module, however low, can mark its errors."""

from __future__ import annotations


class UserFixable(Exception):
    """A problem the user can fix; its message says what failed, where, and what to do."""
