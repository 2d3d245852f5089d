"""The recovery policy: timeouts and budgets, from YAML, validated, with defaults.

Unknown keys are errors: a typo must never silently disable a rule.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import UsageError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Timeouts(_Strict):
    hang_s: float = Field(30.0, gt=0, description="no step completed by some rank for this long: a hang")
    first_step_s: float = Field(300.0, gt=0, description="allowance for the first step of a generation")
    teardown_s: float = Field(1.0, gt=0, description="a rank that has not left the old generation by "
                                                    "then is killed and replaced")
    join_s: float = Field(5.0, gt=0, description="a running process (a survivor, a ready spare) "
                                                 "that has not started to join a new generation "
                                                 "by then is killed and replaced")
    rendezvous_s: float = Field(120.0, gt=0, description="a rank that has not joined the new generation "
                                                        "by then is killed and replaced")
    collective_s: float = Field(600.0, gt=0, description="the process group's own timeout")
    terminate_grace_s: float = Field(2.0, ge=0, description="SIGTERM to SIGKILL when ending processes")
    finish_s: float = Field(600.0, gt=0, description="for the script to end after training completed")


class Budgets(_Strict):
    user_error_retries: int = Field(3, ge=0, description="in-process retries of a user exception "
                                                         "with no step completed in between")
    rank_replacements: int = Field(50, ge=0, description="rank replacements per job")
    job_restarts: int = Field(3, ge=0, description="restarts of every rank process per job")
    spare_failures: int = Field(3, ge=0, description="spares dying in a row before the pool stops "
                                                     "refilling")


class Policy(_Strict):
    timeouts: Timeouts = Timeouts()
    budgets: Budgets = Budgets()

    def with_overrides(self, **dotted: Any) -> "Policy":
        """Return a copy with ``section.field`` values replaced (None values are ignored)."""
        data = self.model_dump()
        for key, value in dotted.items():
            if value is None:
                continue
            section, field = key.split(".", 1)
            data[section][field] = value
        return Policy.model_validate(data)


def _describe(err: ValidationError, source: str) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "(top level)"
    if first["type"] == "extra_forbidden":
        return f"{source}: unknown key '{where}'"
    return f"{source}: {where}: {first['msg']}"


def load(path: str | Path | None) -> Policy:
    """Read a policy file (None: the defaults). Raises UsageError with one clear line."""
    if path is None:
        return Policy()
    import yaml

    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise UsageError(f"policy file {path}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        raise UsageError(f"policy file {path}:{line} is not valid YAML") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UsageError(f"policy file {path}: expected a mapping at the top level")
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        raise UsageError(_describe(exc, f"policy file {path}")) from None
