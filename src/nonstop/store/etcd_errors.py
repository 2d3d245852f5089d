"""The etcd client's exceptions (importable without the client)."""

from __future__ import annotations

class StoreError(Exception):
    """etcd answered but refused the request (bad argument, permission, too many operations)."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.code = code


class StoreUnavailable(StoreError):
    """No endpoint answered within the deadline; the message names them and the last error."""

    def __init__(self, message: str, last: str = ""):
        super().__init__(message)
        self.last = last  # the last error met, as ``host:port: cause`` ("" when none was)


class Fenced(StoreError):
    """A guarded write found its guard changed: whoever wrote it is no longer the leader."""

    def __init__(self, message: str, guard_key: str, expected: int, found: int):
        super().__init__(message)
        self.guard_key, self.expected, self.found = guard_key, expected, found


class Compacted(StoreError):
    """A watch asked for history etcd has compacted away: read the current state again
    (``get_prefix``) and wait from its revision."""

    def __init__(self, message: str, compact_revision: int):
        super().__init__(message)
        self.compact_revision = compact_revision


class AuthFailed(StoreError):
    """etcd rejected the user name or password (or has no authentication enabled)."""


class _Retry(Exception):
    """This endpoint did not answer usefully; another may."""
