"""The recovery policy: what is detected, how the ladder recovers, when to give up.

One YAML file validated against this schema, defaults for everything; ``load`` reports any problem
(an unknown key included: a typo must never silently disable a rule) as one UsageError line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import UsageError


class _Strict(BaseModel):
    # No inf/nan: a NaN threshold never fires (a rule silently off) and an infinite timeout
    # overflows the timedelta the process group is given.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# -- detect ---------------------------------------------------------------------------------------
class HangTuning(_Strict):
    """How long a step may take before it is a hang: ``multiplier`` x the slowest recent step,
    clamped to [floor_s, ceiling_s]; ``initial_s`` until enough steps were seen."""

    multiplier: float = Field(5.0, gt=1)
    floor_s: float = Field(1.0, gt=0)
    ceiling_s: float = Field(600.0, gt=0)
    initial_s: float = Field(60.0, gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> "HangTuning":
        if self.floor_s > self.ceiling_s:
            raise ValueError(f"floor_s ({self.floor_s:g}) is above ceiling_s ({self.ceiling_s:g})")
        return self


class Hang(_Strict):
    auto: bool = True  # tune the timeouts from observed step times
    timeout_s: float = Field(30.0, gt=0)  # the steady-state timeout when auto is false
    steady: HangTuning = HangTuning()
    first_step: HangTuning = HangTuning(multiplier=3.0, floor_s=10.0, ceiling_s=1800.0,
                                        initial_s=300.0)
    window: int = Field(50, ge=1, le=100_000)  # recent step times kept per rank
    warmup_steps: int = Field(5, ge=1)  # steps seen before the steady timeout is tuned
    # steps of a generation, its first included, before the steady timeout applies to a rank:
    # until then its step may take as long as the slowest first step seen (a new process is
    # still cold after its first step: the allocator, kernels, other groups' first collectives)
    settle_steps: int = Field(3, ge=1)
    heartbeat_s: float = Field(2.0, gt=0)  # older heartbeat during a hang: the process is frozen


class Nan(_Strict):
    enabled: bool = True
    action: Literal["retry_step", "skip_batch", "fail"] = "retry_step"
    max_consecutive: int = Field(3, ge=1)  # then roll back to the last good snapshot, else fail


class Sdc(_Strict):
    """Silent data corruption: the data-parallel replicas' parameters are compared (a digest
    each) before every snapshot and between; when they differ every rank resumes from the last
    snapshot whose digests agreed, and the replay of the steps since names the faulty rank.
    ``replay_every``: a step run twice in place every this many steps, each rank comparing its
    two passes - the check of a layout whose parameters no twin holds (0: never)."""

    enabled: bool = True
    action: Literal["replace", "report"] = "replace"  # report: an event, training goes on
    max_overhead_pct: float = Field(0.5, gt=0, le=100)  # snapshots spaced out to keep the digest under it
    replay_every: int = Field(0, ge=0)  # steps between replay checks (0: none)


Operator = Literal[">", ">=", "<", "<="]


class LossRule(_Strict):
    name: str = Field(min_length=1)
    operator: Operator = ">"
    threshold: float
    data_points: int = Field(1, ge=1)  # consecutive reported losses that must satisfy it
    action: Literal["report", "restart", "fail"] = "report"


class Straggler(_Strict):
    enabled: bool = True
    factor: float = Field(2.0, gt=1)  # compute time above factor x the median of the others
    window: int = Field(20, ge=3, le=100_000)  # steps it must persist over
    action: Literal["report", "replace", "drain"] = "report"  # drain: to a warm spare, no fault


class LogRule(_Strict):
    name: str = Field(min_length=1)
    pattern: str = Field(min_length=1)  # a Python regular expression, searched in each line
    action: Literal["fault", "hang", "slow", "report"] = "fault"
    code: str | None = None  # the fault code (default: LOG_<NAME>)
    expected_within_s: float | None = Field(None, gt=0)  # must match this soon after each start
    expected_every_s: float | None = Field(None, gt=0)  # and then keep matching this often

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        import re

        try:
            re.compile(pattern)
        # re raises OverflowError for a{99999999999} and RecursionError for deep nesting
        except (re.error, OverflowError, RecursionError) as exc:
            raise ValueError(f"not a valid regular expression: {exc}") from None
        return pattern


class HealthCheck(_Strict):
    name: str = Field(min_length=1)
    command: str = Field(min_length=1)  # run by the shell on each node; non-zero = unhealthy
    every_s: float = Field(30.0, gt=0)
    timeout_s: float = Field(10.0, gt=0)
    # fault: the node's ranks are replaced (a fault); drain: moved to a spare node at a step
    # boundary (no fault) when one is ready, else it is said and the ranks stay
    action: Literal["fault", "drain"] = "fault"


class Detect(_Strict):
    hang: Hang = Hang()
    nan: Nan = Nan()
    sdc: Sdc = Sdc()
    loss_rules: list[LossRule] = []
    straggler: Straggler = Straggler()
    log_rules: list[LogRule] = []
    health_checks: list[HealthCheck] = []
    nvml: Literal["auto", "off"] = "auto"  # GPU checks where NVML exists; skipped elsewhere


# -- recover ----------------------------------------------------------------------------------------
class Level(_Strict):
    """One rung of the ladder: whether it is used, how often per job, how long it may take."""

    enabled: bool = True
    budget: int = Field(50, ge=0)
    deadline_s: float = Field(120.0, gt=0)


class ScaleIn(Level):
    """Training on with fewer data-parallel ranks when a lost place cannot be refilled, and
    growing back once capacity returns (docs/elastic.md)."""

    budget: int = Field(20, ge=0)
    deadline_s: float = Field(300.0, gt=0)
    # no_capacity: only when nothing can take the lost place (a host lost with no spare host, a
    # node given up with no spare node); no_warm_spare: also when no warm spare is ready, instead
    # of stopping the job while a new process starts (it starts meanwhile, to grow back)
    when: Literal["no_capacity", "no_warm_spare"] = "no_capacity"
    min_world: int = Field(1, ge=1)  # the fewest ranks the job trains with; below it, no scale-in
    multiple_of: int = Field(1, ge=1)  # allowed world sizes (the model-parallel group size)
    grow_after_s: float = Field(0.0, ge=0, le=604800.0)  # degraded this long before growing back
    # keep: the global batch stays the same (ctx.share tells each rank its part); scale_lr: each
    # rank keeps its batch, ctx.lr_scale is world / full world for the script's learning rate
    batch: Literal["keep", "scale_lr"] = "keep"


class Levels(_Strict):
    step_retry: Level = Level(budget=20, deadline_s=60.0)
    in_process: Level = Level(budget=50, deadline_s=60.0)
    rank_replacement: Level = Level(budget=50, deadline_s=180.0)
    node_replacement: Level = Level(budget=5, deadline_s=300.0)
    scale_in: ScaleIn = ScaleIn()
    job_restart: Level = Level(budget=3, deadline_s=900.0)


class Timeouts(_Strict):
    teardown_s: float = Field(0.5, gt=0, le=604800.0)  # a rank still in a failed generation is then killed
    # (after a crash, plus twice the slowest recent step: a survivor may be mid-step)
    join_s: float = Field(5.0, gt=0, le=604800.0)  # a running process must start joining a generation by then
    rendezvous_s: float = Field(120.0, gt=0, le=604800.0)  # a new generation must form by then
    collective_s: float = Field(600.0, gt=0, le=604800.0)  # the process group's own timeout
    # NCCL: the abort of a rank's communicators must return by then (else its process is
    # replaced); a generation's teardown allows this much more
    abort_s: float = Field(5.0, gt=0, le=3600.0)
    terminate_grace_s: float = Field(2.0, ge=0)  # SIGTERM to SIGKILL when ending processes
    finish_s: float = Field(600.0, gt=0, le=604800.0)  # for the script to end after training completed


class Recover(_Strict):
    levels: Levels = Levels()
    timeouts: Timeouts = Timeouts()
    # a sharded job (nonstop.Mesh): what a lost rank takes with it - itself (its replacement
    # takes its shard from its twin), or its whole replica group (torchft's model)
    failure_domain: Literal["rank", "replica_group"] = "rank"


# -- rules ------------------------------------------------------------------------------------------
class Isolate(_Strict):
    times: int = Field(3, ge=1)  # the same fault code on one node (same rank, or the node) this often...
    window_s: float = Field(86400.0, gt=0)  # ...within this window: hardware; isolate the node


class Rules(_Strict):
    isolate: Isolate = Isolate()
    user_error_retries: int = Field(3, ge=0)  # user exceptions in a row (no step in between)
    user_code_job_restarts: int = Field(3, ge=1)  # job restarts in a row with no infra fault
    hang_restarts: int = Field(3, ge=1)  # hang recoveries in a row (no step in between)
    quiet_period_s: float = Field(3600.0, gt=0)  # fault-free this long: the counters start over
    spare_failures: int = Field(3, ge=0)  # spares dying in a row before the pool stops refilling


# -- state ------------------------------------------------------------------------------------------
MAX_REPLICAS = 8  # copies of each snapshot on other nodes: more is memory no failure model needs


class Snapshot(_Strict):
    """Memory snapshots: each rank's registered state copied into its node's memory."""

    enabled: bool = True
    every_steps: Union[Literal["auto"], int] = "auto"
    max_overhead_pct: float = Field(1.0, gt=0, le=100)  # auto: snapshots and their digests under this
    # each snapshot also copied to this many other nodes' memory, in failure domains other than
    # its own node's and each other's where the hosts' labels allow (0: none)
    replicas: int = Field(1, ge=0, le=MAX_REPLICAS)

    @model_validator(mode="before")
    @classmethod
    def _replicate_is_replicas(cls, data: Any) -> Any:
        """``replicate: false``, the older spelling of ``replicas: 0``, is still read (and
        ``replicate: true`` is ``replicas`` as it is); it is not written back."""
        if not isinstance(data, dict) or "replicate" not in data:
            return data
        data = dict(data)
        old = data.pop("replicate")
        if type(old) is not bool:
            raise ValueError(f"replicate (the older spelling of replicas) must be true or "
                             f"false, got {old!r}")
        said = data.get("replicas")
        if said is not None and (said == 0) == old:
            raise ValueError(f"replicate: {str(old).lower()} (the older spelling of replicas) "
                             f"contradicts replicas: {said}")
        if not old:
            data["replicas"] = 0
        return data

    @field_validator("every_steps", mode="before")
    @classmethod
    def _auto_or_steps(cls, value: Any) -> Any:
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        raise ValueError("must be 'auto' or a whole number of steps >= 1")


class Checkpoint(_Strict):
    """Disk checkpoints (DCP format), written from the memory snapshots by the node's keeper."""

    dir: Optional[str] = None  # none without it
    every_steps: int = Field(100, ge=1)
    keep: int = Field(3, ge=1)  # complete checkpoints kept; older ones are deleted
    at_end: bool = True  # the last step of a completed run is written too
    # A checkpoint that cannot be written (a full disk, a quota, no permission...):
    retries: int = Field(3, ge=0, le=100)  # written again this often, retry_backoff_s apart...
    retry_backoff_s: float = Field(2.0, gt=0, le=3600)  # ...doubling each time
    on_failure: Literal["warn", "fail"] = "warn"  # once its retries are spent: go on, or give up
    max_consecutive_failures: int = Field(1, ge=1)  # fail: this many checkpoints failed in a row


class Emergency(_Strict):
    """Saving the newest snapshot to disk when the memory is about to be lost."""

    on_signal: bool = True  # SIGTERM / SIGINT to nonstop run (a scheduler's preemption)
    on_give_up: bool = True
    on_job_restart: bool = True
    grace_s: float = Field(20.0, gt=0, le=3600)  # the most a save may take before nonstop ends


class StateConfig(_Strict):
    snapshot: Snapshot = Snapshot()
    checkpoint: Checkpoint = Checkpoint()
    emergency: Emergency = Emergency()

    @model_validator(mode="after")
    def _checkpoints_need_snapshots(self) -> "StateConfig":
        if self.checkpoint.dir is not None and not self.snapshot.enabled:
            raise ValueError("checkpoint.dir needs snapshot.enabled: checkpoints are written "
                             "from the memory snapshots")
        return self


# -- hooks ------------------------------------------------------------------------------------------
class GiveUpHook(_Strict):
    command: str | None = None  # run by the shell with the diagnosis JSON on stdin
    url: str | None = None  # the diagnosis JSON is POSTed here
    timeout_s: float = Field(10.0, gt=0)

    @field_validator("url")
    @classmethod
    def _url_scheme(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return url


class Hooks(_Strict):
    on_give_up: GiveUpHook = GiveUpHook()


class Hosts(_Strict):
    """Across hosts (``--rdzv-endpoint``): how a host is known to be alive."""

    # a host (and the controller) is alive while its lease in etcd is: a lost host is found this
    # long after it stopped (etcd grants whole seconds)
    lease_ttl_s: int = Field(2, ge=1, le=60)
    # hosts a new job waits for (--nnodes) before it gives up with a clear error
    join_timeout_s: float = Field(300.0, gt=0, le=86400.0)
    # hosts lost faster than new ones join, and the healthy ones cannot hold the ranks (nor a
    # smaller world train: scale-in off, or below its min_world): the job waits this long for a
    # host to join - a scheduler's replacement, a spare started by hand - before it gives up;
    # 0: it gives up at once
    capacity_wait_s: float = Field(300.0, ge=0, le=86400.0)
    # etcd unreachable (no quorum) this long: the job stops with a diagnosis; shorter, it trains on
    store_outage_s: float = Field(60.0, gt=0, le=86400.0)
    # SIGTERM to a host's nonstop run (a scheduler's preemption notice): it stays this long for
    # its ranks to move to a spare host (or the world to shrink without them) at a step boundary,
    # then ends; 0: it ends at once (its ranks lost, the ladder recovers). Kubernetes gives 30 s
    # (terminationGracePeriodSeconds), Slurm KillWait 30 s: keep it below the scheduler's.
    preempt_grace_s: float = Field(20.0, ge=0, le=3600.0)


class Policy(_Strict):
    detect: Detect = Detect()
    recover: Recover = Recover()
    rules: Rules = Rules()
    state: StateConfig = StateConfig()
    hooks: Hooks = Hooks()
    hosts: Hosts = Hosts()

    def with_overrides(self, **dotted: Any) -> "Policy":
        """A copy with ``a.b.c`` values replaced (None values are ignored).

        An unknown path is a KeyError (a bug in the caller); a bad value is a UsageError (it came
        from the user, e.g. a command-line flag)."""
        data = self.model_dump()
        for key, value in dotted.items():
            if value is None:
                continue
            node = data
            *path, last = key.split(".")
            for part in path:
                node = node[part]
            if last not in node:
                raise KeyError(key)
            node[last] = value
        try:
            return Policy.model_validate(data)
        except ValidationError as exc:
            from . import text as policy_yaml

            policy_yaml.fail_without_file("policy override", exc, Policy)

    # shorthands used all over the controller
    @property
    def timeouts(self) -> Timeouts:
        return self.recover.timeouts

    @property
    def levels(self) -> Levels:
        return self.recover.levels


# A policy is a page of YAML; the cap bounds what a wrong path (/dev/zero, a huge log) costs.
_MAX_BYTES = 1 << 20


def load(path: str | Path | None) -> Policy:
    """Read a policy file (None: the defaults). Raises UsageError with one clear line."""
    if path is None:
        return Policy()
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_BYTES + 1)
    except (OSError, ValueError) as exc:  # ValueError: a path with a NUL byte
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise UsageError(f"policy file {path}: {why}") from None
    if len(raw) > _MAX_BYTES:
        raise UsageError(f"policy file {path}: larger than {_MAX_BYTES >> 20} MiB, not a policy")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise UsageError(f"policy file {path} line {line}: not UTF-8 text "
                         f"(byte {raw[exc.start]:#04x})") from None
    return load_text(text, f"policy file {path}")


def load_text(text: str, source: str) -> Policy:
    """A policy from YAML text; ``source`` starts every error message (e.g. "policy file p.yaml").

    Raises UsageError ``"<source> line <n>: <dotted.field>: <problem>"``, one line, for any text."""
    from . import text as policy_yaml

    return policy_yaml.validate(text, source, Policy)


def show_text(policy: Policy, source: str | None = None) -> str:
    """The effective policy as YAML, every field in schema order; ``load_text`` reads it back to
    an equal Policy. ``source`` (the file it came from) goes into the header comment."""
    from . import text as policy_yaml

    origin = f"from {source}, defaults for the rest" if source else "all defaults"
    return policy_yaml.dump(policy.model_dump(), header=f"nonstop policy ({origin})")
