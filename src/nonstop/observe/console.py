"""What of a rank's output reaches the console: torch's C++ stack traces and the store warnings
that nonstop's own aborts cause stay in the process's log file, so a recovery prints one line per
fact, not dozens of frames."""

from __future__ import annotations

import re

_TRACE_START = re.compile(r"^Exception raised from .* \(most recent call first\):\s*$")
_TRACE_LINE = re.compile(r"^(frame #\d+: |<omitting python frames>\s*$)")
# the store client's warning when its socket is shut: nonstop's abort of a forming group
_STORE_WARNING = re.compile(r"^\[[WE]\d{4} [\d:.]+( \d+)? (TCPStore|socket|Utils)\.(cpp|hpp):\d+\] \[c10d\]")


class ConsoleFilter:
    """One per process: fed every line in order; says which to show."""

    def __init__(self, log_name: str):
        self.log_name = log_name
        self._in_trace = False
        self._quiet_trace = False  # the trace belongs to a hidden warning: say nothing of it

    def show(self, line: str) -> str | None:
        """The line to print (possibly a replacement), or None to keep it to the log only."""
        if self._in_trace:
            if _TRACE_LINE.match(line):
                return None
            self._in_trace = False
            if not line.strip():
                return None
        if _STORE_WARNING.match(line):
            self._quiet_trace = True
            return None
        if _TRACE_START.match(line):
            self._in_trace = True
            quiet, self._quiet_trace = self._quiet_trace, False
            return None if quiet else f"(C++ stack trace in logs/{self.log_name})"
        self._quiet_trace = False
        return line
