"""What the controller asks of the side that runs the job's processes, and what the cluster of
hosts asks of the office that elected it: declared here, each met by two classes.

``Processes``: on one host the agent (``agent/agent.py``) starts, signals and watches the
processes itself; across hosts the cluster (``cluster.py``) asks each host's agent to. The
controller and its collaborators call nothing else on it, and never ask which one it has: where
the two differ (health checks run by each host's agent; hosts that fell silent) each answers in
its own way. ``tests/test_ports.py`` holds both to every member.

``Office``: the cluster, polled by the controller, reports to the office that holds the job
(``elected.Leader``) - a host lost, a line a process wrote, its own work once a poll - and asks
it whether it may still give orders (its lease in etcd), whether the job is ending anyway, and
when etcd last answered. Given when the cluster is made: nothing is wired afterwards.
"""

from __future__ import annotations

from typing import Any, Protocol


class Processes(Protocol):
    """The job's processes as the controller starts and watches them."""

    takes_hosts: bool  # hosts join and leave while it runs (across hosts)
    procs: dict[int, Any]  # wid -> the process (``agent.Proc``, ``cluster.RemoteProc``)
    health: Any  # the nodes' health checks when run elsewhere (each host's agent), else None

    @property
    def next_wid(self) -> int: ...

    def new_wid(self) -> int: ...

    def spawn(self, wid: int, spare: bool, spare_mode: str | None = None, node: int = 0,
              **kw: Any) -> Any: ...

    def spawn_keeper(self, wid: int, node: int, name: str, writer: bool) -> Any: ...

    def keeper_link(self, node: int, name: str, deadline: float) -> Any: ...

    def signal(self, wid: int, sig: int = ...) -> None: ...

    def stopped(self, wid: int) -> bool: ...

    def alive(self) -> list[Any]: ...

    def poll(self, timeout: float) -> list[Any]: ...

    def wake(self) -> None: ...

    def deadlines(self) -> list[Any]: ...

    def preempted(self) -> list[tuple[int, float]]: ...

    def release(self, node: int, why: str) -> None: ...

    def host_up(self, node: int) -> bool: ...

    def host_away(self, node: int) -> bool: ...

    def failure_domain(self, node: int) -> str: ...

    def lost_nodes(self) -> set[int]: ...

    def silent_hosts(self) -> dict[int, float] | None: ...  # node -> silent since; None: one host

    def deaf(self) -> bool: ...

    def end_all(self, grace_s: float, deadline_s: float = 10.0) -> None: ...

    def close(self) -> None: ...


class Office(Protocol):
    """The office that holds the job across hosts, as the cluster reports to it."""

    def in_office(self) -> bool: ...  # provably still the controller (its lease confirmed)

    def completed(self) -> bool: ...  # training complete for every rank: the job only ends now

    def store_heard(self) -> float: ...  # time.monotonic() when etcd's newest answer was asked

    def store_period(self) -> float: ...  # how often etcd is asked (its lease refreshed)

    def node_lost(self, node: int) -> None: ...  # a host gone (its lease expired)

    def output(self, wid: int, line: str) -> None: ...  # a line a process wrote

    def tick(self) -> None: ...  # the office's own work, once a poll

    def notice(self, notice: Any) -> None: ...  # what its own threads found (Cluster.notice)
