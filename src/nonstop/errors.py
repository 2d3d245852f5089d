"""Errors a user can cause: reported as one line with exit code 2, never a traceback."""

from __future__ import annotations

USAGE_EXIT = 2


class UsageError(Exception):
    """Bad input: a missing script, a bad flag, a malformed policy or fault spec."""


class ScriptSetupError(RuntimeError):
    """Raised in a rank: the script set something up that nonstop cannot keep across a restart
    (a device mesh built on one generation's groups). The job stops with this message: a retry
    would meet the same setup."""


def exception_line(e: BaseException) -> str:
    """An exception as one short line: its type and its text, whitespace folded, at most 300
    characters of it."""
    text = " ".join(str(e).split())[:300]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def one_line(text: object) -> str:
    """``text`` on one line: what a user typed may hold a newline, a carriage return or another
    control character, and an error that quotes it must still be one line (written escaped)."""
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in str(text))
