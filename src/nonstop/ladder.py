"""The recovery ladder as pure decision logic: faults + counters + policy -> one decision.

No processes, no store, no clocks: the controller gathers what happened in one round of an incident
(which ranks died, which left, what they reported) and asks ``decide`` what to do next.
"""

from __future__ import annotations

import dataclasses
import enum
import signal as _signal

from .policy import Policy


class Level(str, enum.Enum):
    IN_PROCESS = "in-process restart"
    REPLACE_RANK = "rank replacement"
    JOB_RESTART = "job restart"
    FAIL = "fail"


class Attribution(str, enum.Enum):
    USER = "user"
    INFRA = "infrastructure"
    UNKNOWN = "unknown"


@dataclasses.dataclass(frozen=True)
class Fault:
    """One signal that something went wrong, already attributed to a rank where possible."""

    kind: str  # crash | exit | exception | hang | teardown_timeout | rendezvous_timeout | no_state | import_error
    rank: int | None = None
    code: int | None = None  # exit code, or -signal
    message: str = ""
    traceback: str | None = None

    @property
    def attribution(self) -> Attribution:
        if self.kind in ("exception", "import_error"):
            return Attribution.USER
        if self.kind in ("crash", "teardown_timeout", "rendezvous_timeout"):
            return Attribution.INFRA
        if self.kind == "exit":  # an exit code without a Python exception: unknown cause
            return Attribution.UNKNOWN
        return Attribution.UNKNOWN

    def describe(self) -> str:
        if self.rank is None:
            return f"{self.kind}: {self.message}" if self.message else self.kind
        where = f"rank {self.rank}"
        if self.kind == "crash" and self.code is not None and self.code < 0:
            try:
                name = _signal.Signals(-self.code).name
            except ValueError:
                name = f"signal {-self.code}"
            return f"{where} killed by {name}"
        if self.kind == "exit":
            return f"{where} exited with code {self.code}"
        if self.message:
            return f"{where}: {self.kind}: {self.message}"
        return f"{where}: {self.kind}"


@dataclasses.dataclass
class Counters:
    """What the job has spent so far; budgets count per job."""

    user_errors_in_a_row: int = 0  # user exceptions with no step completed since
    rank_replacements: int = 0
    job_restarts: int = 0


@dataclasses.dataclass(frozen=True)
class Decision:
    level: Level
    replace: frozenset[int] = frozenset()  # ranks that get a new process
    reason: str = ""
    diagnosis: str | None = None  # for FAIL: what to tell the user
    traceback: str | None = None  # for FAIL on a user error: shown once
    usage_error: bool = False  # FAIL caused by bad input (exit code 2)


def decide(faults: list[Fault], dead: set[int], world: int, managed: bool, policy: Policy,
           counters: Counters) -> Decision:
    """Decide one round of an incident.

    Args:
        faults: what was observed in this round (at least one).
        dead: ranks whose process is gone (died, or killed for missing a deadline).
        world: ranks in the job.
        managed: whether the ranks run inside ``nonstop.wrap`` (else only whole restarts work).
        policy: budgets.
        counters: spent budgets (not modified).
    """
    budgets = policy.budgets
    user = [f for f in faults if f.attribution is Attribution.USER]
    imports = [f for f in faults if f.kind == "import_error"]
    if imports:  # the same code fails the same way on every attempt: retrying cannot help
        f = imports[0]
        return Decision(Level.FAIL, reason="the script fails at import",
                        diagnosis=f"the script failed at import: {f.message}", usage_error=True)
    if user and counters.user_errors_in_a_row >= budgets.user_error_retries:
        f = user[0]
        return Decision(Level.FAIL, reason="user error budget spent",
                        diagnosis=(f"rank {f.rank} raised {f.message} on "
                                   f"{counters.user_errors_in_a_row + 1} attempts in a row; giving up "
                                   f"(budgets.user_error_retries={budgets.user_error_retries})"),
                        traceback=f.traceback)
    no_state = any(f.kind == "no_state" for f in faults)
    if not managed or no_state or len(dead) >= world:
        if counters.job_restarts >= budgets.job_restarts:
            return Decision(Level.FAIL, reason="job restart budget spent",
                            diagnosis=_summary(faults, f"job restart budget spent "
                                               f"(budgets.job_restarts={budgets.job_restarts})"),
                            traceback=user[0].traceback if user else None)
        why = ("the script does not use nonstop.wrap" if not managed else
               "no consistent state in memory" if no_state else "every rank process is gone")
        return Decision(Level.JOB_RESTART, replace=frozenset(range(world)), reason=why)
    if dead:
        if counters.rank_replacements + len(dead) > budgets.rank_replacements:
            if counters.job_restarts >= budgets.job_restarts:
                return Decision(Level.FAIL, reason="replacement and restart budgets spent",
                                diagnosis=_summary(faults, "rank replacement and job restart budgets "
                                                   "are spent"))
            return Decision(Level.JOB_RESTART, replace=frozenset(range(world)),
                            reason=f"rank replacement budget spent "
                                   f"(budgets.rank_replacements={budgets.rank_replacements})")
        return Decision(Level.REPLACE_RANK, replace=frozenset(dead),
                        reason=", ".join(f.describe() for f in faults if f.rank in dead) or "process lost")
    return Decision(Level.IN_PROCESS, reason="; ".join(f.describe() for f in faults))


def _summary(faults: list[Fault], why: str) -> str:
    return f"{why}; last fault: {faults[-1].describe()}" if faults else why


def charge(decision: Decision, faults: list[Fault], counters: Counters) -> Counters:
    """The counters after carrying out ``decision`` (pure)."""
    out = dataclasses.replace(counters)
    if any(f.attribution is Attribution.USER for f in faults):
        out.user_errors_in_a_row += 1
    if decision.level is Level.REPLACE_RANK:
        out.rank_replacements += len(decision.replace)
    elif decision.level is Level.JOB_RESTART:
        out.job_restarts += 1
    return out


def progressed(counters: Counters) -> Counters:
    """Every rank completed a step after recovery: consecutive-failure counters start over."""
    return dataclasses.replace(counters, user_errors_in_a_row=0)
