"""What a process asks a zygote template for (``agent/zygote.py``), and its answer, typed.

A template has torch imported; it forks, for a process that connects to it, either a zygote (an
agent's: it forks that agent's ranks) or a node's checkpoint writer (a keeper's: it writes DCP
parts). The request says who asks and with what (interpreter, copy of nonstop, code on disk,
environment, directory): the template serves only a process it is the same as where it matters.
Its descriptors (the asker's end of their socketpair, its network and mount namespaces, its log)
travel beside it (SCM_RIGHTS).

Read strictly (``records.Reader``): a field missing, unknown or of the wrong type is refused
(``BadZygoteMessage``), and the template answers with why.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from .records import BadRecord, Reader

ROLES = ("zygote", "writer")


class BadZygoteMessage(BadRecord):
    """A request to a template, or its answer, that is not as it should be."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TemplateRequest:
    """A zygote for an agent, or a checkpoint writer for a keeper."""

    role: Literal["zygote", "writer"]
    pid: int  # the asking process: what is forked leaves if it is gone already
    env: dict[str, str]  # the asker's environment, which the forked process takes
    cwd: str
    python: list[str]  # the interpreter's real path and its prefix (a virtual environment)
    nonstop: str  # the directory of the copy of nonstop it runs
    code: str  # the stamp of the code on disk (``zygote_client.code_stamp``)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TemplateAnswer:
    """The pid of what was forked, or why nothing was."""

    pid: int | None = None
    error: str | None = None


_READ = Reader()


def read(cls: type, raw: Any) -> Any:
    """``raw`` (decoded JSON) as a ``cls``, or BadZygoteMessage saying what is wrong."""
    try:
        return _READ.record(cls, raw, cls.__name__)
    except BadRecord as exc:
        raise BadZygoteMessage(str(exc)) from None


def encode(rec: Any) -> dict[str, Any]:
    return dataclasses.asdict(rec)
