"""Where the controller's job is: one phase at a time, the generation's life from forming to the
end of the run."""

from __future__ import annotations

import enum


class Phase(enum.StrEnum):
    STARTING = "starting"  # no generation published yet
    RENDEZVOUS = "rendezvous"  # a generation is published; its ranks form their group
    RUNNING = "running"  # every rank entered the training function
    TEARING_DOWN = "tearing_down"  # a fault: the survivors leave the generation
    # the survivors left, and the healthy hosts cannot hold the ranks: a host must join first
    WAITING_FOR_HOSTS = "waiting_for_hosts"
    FINISHING = "finishing"  # training completed: the ranks end, the last checkpoint settles
    OVER = "over"  # the exit code is known


ACTIVE = frozenset({Phase.RENDEZVOUS, Phase.RUNNING})  # a fault here aborts the generation
ENDING = frozenset({Phase.FINISHING, Phase.OVER})  # a fault here changes nothing
