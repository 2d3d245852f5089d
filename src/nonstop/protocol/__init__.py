"""The contract between the launcher (controller and agent) and the rank processes.

Key names in the coordination store, environment variable names, and message shapes live here so
that both sides agree by construction. Every key a generation writes is under ``g/<gen>/``.
"""

from __future__ import annotations

import json
from typing import Any

# -- environment variables (one prefix) ---------------------------------------------------------
ENV_STORE = "NONSTOP_STORE"  # host:port of the coordination store
ENV_WORKER_ID = "NONSTOP_WORKER_ID"  # the process's worker id (stable for its life)
ENV_LAUNCHER_PID = "NONSTOP_LAUNCHER_PID"  # parent to watch; the worker dies with it
ENV_RUN_DIR = "NONSTOP_RUN_DIR"
ENV_SPARE_MODE = "NONSTOP_SPARE_MODE"  # "script" | "import"
ENV_GENERATION = "NONSTOP_GENERATION"
ENV_ENTRIES = "NONSTOP_ENTRIES"  # times this process has entered the training function
ENV_REPLACEMENTS = "NONSTOP_REPLACEMENTS"  # times this rank has been replaced
ENV_INJECT = "NONSTOP_INJECT"  # JSON list of fault specs, see inject.py
ENV_NODE = "NONSTOP_NODE"  # the node (agent group) the process belongs to
ENV_KEEPER = "NONSTOP_KEEPER"  # the abstract socket name of the node's keeper (its memory)

# -- store keys ---------------------------------------------------------------------------------
JOB_KEY = "job"  # JSON: settings the runtime needs
EVENT_COUNT_KEY = "ev/n"  # workers add 1 to get a slot, then write ev/<slot>


def event_key(slot: int) -> str:
    return f"ev/{slot}"


def mailbox_key(worker_id: int, seq: int) -> str:
    """The seq-th message from the controller to one worker; each key is written once."""
    return f"w/{worker_id}/m/{seq}"


def progress_key(worker_id: int) -> str:
    return f"p/{worker_id}"


def abort_key(gen: int, worker_id: int) -> str:
    """Set by the controller to abort a generation (one key per worker, so each worker can also
    wake its own watcher when it leaves normally)."""
    return f"g/{gen}/abort/{worker_id}"


ABORT = b"abort"
SELF_WAKE = b"self"


def pg_prefix(gen: int) -> str:
    return f"g/{gen}/pg"


def inject_key(index: int) -> str:
    return f"inj/{index}"


# -- messages -----------------------------------------------------------------------------------
# controller -> worker (mailbox): {"type": "assign", "gen", "rank", "world", "replacements", "port"?}
#                                 {"type": "complete"}   training finished on every rank
#                                 {"type": "exit"}       leave now (spares at the end of a job)
#                                 {"type": "retry", "skip"}  redo (or skip) a step, same generation
# worker -> controller (events):  hello, ready, wrapped, entered, first_step, left, done, inject, exit
ASSIGN = "assign"
COMPLETE = "complete"
EXIT = "exit"
RETRY = "retry"  # re-enter the same generation and redo (or skip) the step


def dumps(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def loads(raw: bytes | str) -> dict[str, Any]:
    return json.loads(raw)
