"""Fault classification: every signal becomes a fault with a kind, a code, a domain and an
attribution (the user's code or the infrastructure). The table is documented in docs/faults.md."""

from __future__ import annotations

import dataclasses
import enum
import re
import signal as _signal

from ..protocol.events import Exiting


class Attribution(str, enum.Enum):
    USER = "user"
    INFRA = "infrastructure"
    UNKNOWN = "unknown"
    NONSTOP = "nonstop"  # nonstop's own code: a bug to report, never the user's to fix


class Domain(str, enum.Enum):
    RANK = "rank"  # one rank's process
    NODE = "node"  # every rank of a node (a machine; on one machine, an agent's group)
    JOB = "job"  # the job as a whole


#: kind -> (domain, attribution, what it means)
KINDS: dict[str, tuple[Domain, Attribution, str]] = {
    "crash": (Domain.RANK, Attribution.INFRA, "the rank process was killed by a signal"),
    "exit": (Domain.RANK, Attribution.UNKNOWN, "the rank process exited non-zero without a Python error"),
    "exception": (Domain.RANK, Attribution.USER, "the training code raised an exception"),
    "import_error": (Domain.JOB, Attribution.USER, "the script fails at import"),
    "internal": (Domain.RANK, Attribution.NONSTOP, "nonstop's own state code raised an error (a "
                 "bug in nonstop, or a kind of state it does not handle)"),
    "setup": (Domain.JOB, Attribution.USER, "the script's setup cannot be kept across a restart "
              "as written (a device mesh it built itself): it needs a change, not a retry"),
    "peer": (Domain.RANK, Attribution.UNKNOWN, "a collective failed because a peer went away (a symptom)"),
    "hang": (Domain.JOB, Attribution.UNKNOWN, "no rank completed a step within the hang timeout"),
    "teardown_timeout": (Domain.RANK, Attribution.INFRA, "a rank did not leave a failed generation in time"),
    "rendezvous_timeout": (Domain.RANK, Attribution.INFRA, "a rank did not join a new generation in time"),
    "nan": (Domain.JOB, Attribution.USER, "non-finite gradients (data or user until it repeats)"),
    "loss_rule": (Domain.RANK, Attribution.USER, "a loss rule of the policy fired"),
    "straggler": (Domain.RANK, Attribution.INFRA, "a rank's compute stays far slower than the others'"),
    "log_rule": (Domain.RANK, Attribution.UNKNOWN, "a log rule of the policy fired"),
    "node_unhealthy": (Domain.NODE, Attribution.INFRA, "a node health check failed"),
    "node_lost": (Domain.NODE, Attribution.INFRA, "a node's ranks and its memory (its keeper) are gone"),
    "no_state": (Domain.JOB, Attribution.UNKNOWN, "no rank holds a consistent copy of the state"),
    "deadline": (Domain.JOB, Attribution.UNKNOWN, "a recovery level missed its deadline"),
    "takeover": (Domain.JOB, Attribution.INFRA, "a controller took over a generation still forming"),
    "sdc": (Domain.RANK, Attribution.INFRA, "a rank's parameters silently differ from its replicas' "
            "(a bit flip, a faulty device)"),
    # CUDA (decide/cuda.py): the first three leave the process's CUDA context unusable
    "cuda_assert": (Domain.RANK, Attribution.USER, "a device-side assert in the training code's "
                    "kernels (an index out of range...): the process is replaced"),
    "cuda_error": (Domain.RANK, Attribution.UNKNOWN, "a sticky CUDA error (an illegal address, a "
                   "launch failure...): the process is replaced"),
    "gpu_hardware": (Domain.RANK, Attribution.INFRA, "the GPU reported a hardware fault "
                     "(uncorrectable ECC, NVLink, fell off the bus): the process is replaced"),
    "cuda_oom": (Domain.RANK, Attribution.USER, "the GPU ran out of memory: retried in the same "
                 "process once (caches freed), then in a new one"),
    "abort_timeout": (Domain.RANK, Attribution.INFRA, "a rank's communicators did not abort in "
                      "time (NCCL): its process was ended and is replaced"),
}


@dataclasses.dataclass(frozen=True)
class Fault:
    """One signal that something went wrong, attributed to a rank or node where possible."""

    kind: str
    rank: int | None = None
    code: int | None = None  # exit code, or -signal
    message: str = ""
    traceback: str | None = None
    node: int | None = None
    tag: str | None = None  # a code given by a rule (log rule, health check)

    @property
    def domain(self) -> Domain:
        return KINDS.get(self.kind, (Domain.JOB,))[0]

    @property
    def attribution(self) -> Attribution:
        return KINDS.get(self.kind, (Domain.JOB, Attribution.UNKNOWN))[1]

    @property
    def fault_code(self) -> str:
        """A stable code: the same fault on the same rank or node has the same code."""
        if self.tag:
            return self.tag
        if self.kind == "crash" and self.code is not None and self.code < 0:
            return _signal_name(-self.code)
        if self.kind == "exit":
            return f"EXIT_{self.code}"
        if self.kind == "exception":
            m = re.match(r"\s*([A-Za-z_][\w.]*)", self.message)
            return f"PY_{m.group(1).split('.')[-1]}" if m else "PY_EXCEPTION"
        return self.kind.upper()

    def describe(self) -> str:
        where = (f"rank {self.rank}" if self.rank is not None else
                 f"node {self.node}" if self.node is not None else None)
        if where is None:
            return f"{self.kind}: {self.message}" if self.message else self.kind
        if self.kind == "crash" and self.code is not None and self.code < 0:
            return f"{where} killed by {_signal_name(-self.code)}"
        if self.kind == "exit":
            return f"{where} exited with code {self.code}"
        if self.message:
            return f"{where}: {self.kind}: {self.message}"
        return f"{where}: {self.kind}"


def _signal_name(num: int) -> str:
    try:
        return _signal.Signals(num).name
    except ValueError:
        return f"SIG{num}"


def exit_fault(report: Exiting | None, code: int | None, rank: int | None,
               before_any_step: bool) -> Fault:
    """The fault of a rank process that ended, from its exit code and what it reported on its
    way out (``report``: its last words, None if it said nothing). ``before_any_step``: the job
    has not got past the script's start yet, so a failure there is the same on every attempt."""
    if report is not None and report.import_error:
        # It failed before reaching its training function: the script's own error - unless it
        # ran without its rank (a spare taken mid-import), or the job had got past that point
        # before (then something changed: the ladder retries).
        kind = "import_error" if before_any_step and report.assigned else "exception"
        return Fault(kind, rank=rank, code=code, message=report.error, traceback=report.traceback)
    if report is not None and report.abort_hung:
        return Fault("abort_timeout", rank=rank, code=code, message=report.error)
    if report is not None and report.cuda is not None:
        cuda = report.cuda
        return Fault(cuda.kind, rank=rank, code=code, message=cuda.describe(), tag=cuda.name,
                     traceback=report.traceback)
    if report is not None and report.collective:
        return Fault("peer", rank=rank, code=code, message=report.error)
    if report is not None:
        return Fault("exception", rank=rank, code=code, message=report.error,
                     traceback=report.traceback)
    if code is not None and code < 0:
        return Fault("crash", rank=rank, code=code)
    return Fault("exit", rank=rank, code=code)
