"""Errors a user can cause: reported as one line with exit code 2, never a traceback."""

from __future__ import annotations

USAGE_EXIT = 2


class UsageError(Exception):
    """Bad input: a missing script, a bad flag, a malformed policy or fault spec."""
