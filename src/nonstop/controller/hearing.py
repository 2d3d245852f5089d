"""Whether the controller can prove it hears the job: across hosts, every other host silent at
once and etcd too means its own host's incoming traffic may be what failed - then a silence is
evidence against nobody. Heard again, the time it could not is not counted against the ranks.
The same for a time the controller's loop did not look at all (held up by a slow call, its
process paused: longer than ``stall_s``). Pure: the controller says whether it is deaf and when
it looks, and acts on the answer."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Unheard:
    """It cannot prove it hears the job now; ``first``: since this look."""
    first: bool


@dataclasses.dataclass(frozen=True)
class HeardAgain:
    """Heard again after ``gap`` seconds: ``why`` is ``deaf`` or ``held up`` (the loop stalled)."""
    gap: float
    why: str


class Hearing:
    def __init__(self, stall_s: float):
        self.stall_s = stall_s
        self.t_heard = 0.0  # when the job was last heard again: no step is awaited from before
        self._since: float | None = None  # deaf since
        self._last = 0.0  # the previous look

    def look(self, now: float, deaf: bool) -> Unheard | HeardAgain | None:
        """What this look finds (None: heard, as before)."""
        last, self._last = self._last, now
        if deaf:
            first = self._since is None
            if first:
                self._since = now
            return Unheard(first)
        if self._since is not None:
            heard = HeardAgain(now - self._since, "deaf")
            self._since = None
        elif last and now - last > self.stall_s:
            heard = HeardAgain(now - last, "held up")
        else:
            return None
        self.t_heard = now
        return heard
