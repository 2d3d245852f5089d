"""How a job ends: its exit code and diagnosis, the ranks told that training is complete, an end
that overran its deadline, and giving up (the state saved first, the give-up hook run).

The state machine (``machine.py``) says when; this carries it out and keeps the outcome the
launcher reports."""

from __future__ import annotations

import signal
import time
from typing import Any, Callable

from .. import protocol
from ..decide.ladder import Decision
from .workers import DUMP_GRACE_S, Worker


class Outcome:
    def __init__(self, *, policy: Any, log: Any, display: Any, agent: Any, table: Any,
                 memory: Any, book: Any, run_dir: Any):
        self.policy, self.log, self.display, self.agent = policy, log, display, agent
        self.table, self.memory, self.book, self.run_dir = table, memory, book, run_dir
        self.exit_code: int | None = None
        self.diagnosis: str | None = None
        self.traceback: str | None = None
        self.usage_error = False
        self.t_train_end: float | None = None
        self.completed = False  # training completed for every rank: the job only ends now
        # across hosts: etcd's outages while the controller was in office (its Office.record),
        # for the summary
        self.store: dict[str, Any] | None = None
        self._failing = False  # the job is being given up (its state saved meanwhile)

    def finish(self, gen: int, step: int, ranks: list[Worker], managed: bool,
               unfired: list[str]) -> None:
        """Training completed: the ranks return from their function, the spares leave."""
        self.completed = True
        self.log.write("training_complete", gen=gen, step=step)
        for f in unfired:
            self.log.write("inject_unfired", fault=f, step=step)
            self.display.warning(f"--inject {f} never fired: the run ended at step {step}")
        for w in ranks:
            if not w.dead and managed:
                self.table.send(w, protocol.Complete())
        for w in self.table.spares():
            self.table.send(w, protocol.Exit())

    def overdue(self, alive: list[Worker], final_persist: int | None) -> None:
        """The end overran ``timeouts.finish_s``: why, and the stacks of the ranks still alive."""
        finish_s = self.policy.timeouts.finish_s
        self.diagnosis = self.diagnosis or (
            f"rank(s) {', '.join(str(w.rank) for w in alive)} did not end {finish_s:g} s after "
            "training completed (their stacks are in their logs)" if alive else
            f"the checkpoint of the last step ({final_persist}) was not written "
            f"{finish_s:g} s after training completed")
        for w in alive:
            self.agent.signal(w.wid, signal.SIGUSR1)
        time.sleep(DUMP_GRACE_S)

    def give_up(self, decision: Decision, gen: int, step: int, ranks: list[Worker],
                faulty: set[int], shut_node: Callable[[int], None]) -> int | None:
        """Give the job up: the diagnosis, the state saved, the hook run. Returns the exit code
        to end with (None: already giving up - one diagnosis)."""
        if self._failing:  # a second cause while saving the state for the first
            return None
        self._failing = True
        self.diagnosis = decision.diagnosis or decision.reason
        self.traceback = decision.traceback
        self.usage_error = decision.usage_error
        self.book.give_up()
        self.log.write("give_up", diagnosis=self.diagnosis, usage_error=self.usage_error)
        if self.usage_error:
            return 2
        if self.policy.state.emergency.on_give_up:
            self.emergency("give up", ranks, faulty, shut_node)
        from ..observe.hooks import on_give_up

        on_give_up(self.policy.hooks.on_give_up, self.log, self.display, {
            "diagnosis": self.diagnosis, "exit_code": 1, "run_dir": str(self.run_dir),
            "generation": gen, "step": step,
            "incidents": [i.to_record() for i in self.book.closed], "traceback": self.traceback})
        return 1

    def emergency(self, reason: str, ranks: list[Worker], faulty: set[int],
                  shut_node: Callable[[int], None]) -> None:
        """The memory is about to be lost: persist the newest snapshot, waiting up to the grace.
        The ranks stop first: a step completed after the snapshot would be lost anyway, and the
        node's CPU and memory bandwidth go to the save."""
        for w in ranks:
            self.table.kill(w, f"emergency checkpoint ({reason})")
        self.memory.poll()
        self.memory.emergency(reason, faulty, shut_node,
                              wait_s=self.policy.state.emergency.grace_s,
                              tick=lambda: self.agent.poll(0.02))

    def ended(self, code: int) -> None:
        """Every process ends (gracefully only after a success); the exit code is known."""
        if self.t_train_end is None:
            self.t_train_end = time.time()
        self.agent.end_all(self.policy.timeouts.terminate_grace_s if code == 0 else 0.0)
        self.exit_code = code
