"""Every type of event the event log (``events.jsonl``) holds: the controller's own, and the
ranks' reports it forwards as ``rank_<kind>``. ``EventLog.write`` refuses any other type, so a
renamed event cannot leave a reader (or a test asserting its absence) looking for the old name;
docs/events.md documents each one (tests/test_event_types.py checks both). The ranks' reports
are typed in ``protocol/events.py``: the list of those forwarded is taken from there."""

from __future__ import annotations

from ..protocol import events

CONTROLLER = frozenset({
    # the run
    "run_start", "metrics", "training_complete", "give_up", "interrupted", "run_end",
    # processes and generations
    "spawn", "generation", "replace", "kill", "exit", "spare_lost", "spare_mode", "deadline",
    "event_refused",
    # faults, decisions, incidents
    "fault", "fault_ignored", "abort", "decision", "attempt_interrupted", "incident", "isolate",
    "hook", "inject_unfired",
    # detection
    "hang_timeout", "hang_detected", "slow_step", "straggler", "loss_rule_fired", "log_rule", "health",
    "sdc_divergence", "sdc_attributed",
    # elastic: scale-in and out, drains, preemption, requests
    "scale_in", "scale_out", "scale_out_done", "regroup", "drain_done", "drain_refused",
    "preempted", "request_refused",
    # state: node memory, replication, restores, checkpoints
    "keepers", "keeper_error", "keeper_killed", "keeper_restarted", "node_memory_lost",
    "replication", "replication_behind", "replication_failed", "replica_memory", "restore",
    "checkpoint", "checkpoint_failed", "checkpoint_abandoned", "checkpoint_retention_failed",
    "emergency_checkpoint",
    # across hosts
    "leader", "takeover", "node_joined", "node_lost", "stepped_down", "unheard", "heard",
    "waiting_for_hosts",
})

# what a rank reports that the controller writes to the log, as ``rank_<kind>``
RANK_FORWARDED = tuple(kind for kind, record in events.KINDS.items() if record.logged)

ALL = CONTROLLER | frozenset(f"rank_{kind}" for kind in RANK_FORWARDED)
