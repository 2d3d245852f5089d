"""What the run has shown of its training, for the summary: whether its steps can be counted,
where it resumed, how long rank 0 spent in steps that count, which injections never fired.

A plain script, or a wrapped function that does not iterate ``ctx.steps``, does not say where it
is: what a failure undid is then unknown, and the summary says so rather than 0.
"""

from __future__ import annotations

from typing import Any, Iterable

from ..observe.incidents import Incident
from ..protocol import events


class TrainingLedger:
    def __init__(self, managed: bool):
        self.managed = managed  # the ranks run inside nonstop.wrap (a rank may say so later)
        self.stepless = False  # the training function runs without ctx.steps (a rank said so)
        self.not_kept = False  # a rank made a nonstop.State that nothing keeps (and it was said)
        self.steps_seen = False  # some rank completed a step of ctx.steps
        self.progress_seen = False  # some rank made progress nonstop can see (steps or marks)
        self.resumed_step: int | None = None  # the step the first generation started from
        self.unfired: list[str] = []  # injected faults keyed to steps the run never reached

    def first_step(self, stepless: bool) -> None:
        """A rank completed the first step (or, without ctx.steps, the first mark) of a generation."""
        self.progress_seen = True
        self.steps_seen = self.steps_seen or not stepless

    def done(self, ev: events.Done) -> None:
        """A rank's training function returned: whether it iterated ctx.steps, and the faults it
        was to fire at steps it never reached."""
        self.steps_seen = self.steps_seen or ev.steps
        self.unfired += [f for f in ev.unfired if f not in self.unfired]

    def no_steps(self, ev: events.NoSteps) -> tuple[str | None, str | None]:
        """A rank runs without ctx.steps (its "no_steps" report): its progress is its marks, what
        a failure loses is unknown, and faults keyed to steps can never fire. Returns what to
        fail the run with (a usage error), and what to warn of (once per run)."""
        faults = ev.faults
        if ev.via == "plain":  # a script without nonstop.wrap: no steps are seen at all
            return (f"--inject {'; '.join(faults)} cannot fire: the script does not use "
                    "nonstop.wrap, so nonstop sees no steps in it, and these faults are keyed to "
                    "steps (wrap the training function and loop with `for step in "
                    "ctx.steps(total)`: docs/usage.md)", None) if faults else (None, None)
        first, self.stepless = not self.stepless, True
        fn = ev.function or "the training function"
        if faults:
            return (f"--inject {'; '.join(faults)} cannot fire: {fn}() does not iterate ctx.steps, "
                    "and these faults are keyed to its steps (loop with `for step in "
                    "ctx.steps(total)`)", None)
        if first and ev.registered:
            return None, (f"{fn}() registers nonstop.State but does not iterate ctx.steps: after a "
                          "failure it starts again from its beginning on top of the trained state, "
                          "and the steps lost are unknown; loop with `for step in "
                          "ctx.steps(total)` (docs/usage.md)")
        return None, None

    def state_not_kept(self, ev: events.StateNotKept) -> str | None:
        """A rank made a nonstop.State the training function was not wrapped with: what to warn
        of (once per run)."""
        if self.not_kept:
            return None
        self.not_kept = True
        fn = ev.function or "the training function"
        return (f"{fn}() makes nonstop.State({', '.join(ev.names)}) without giving it to "
                "nonstop.wrap: nothing keeps that state across a restart, and after a failure the "
                "function starts again from its beginning; pass it to nonstop.wrap(state), or "
                "return it from nonstop.Mesh's build function (docs/usage.md)")

    def steps_known(self) -> bool:
        """Whether the steps a failure undid can be counted: only when the ranks iterate ctx.steps."""
        return self.managed and self.steps_seen and not self.stepless

    def steps_undecided(self) -> bool:
        """Whether the run has not yet shown if its steps can be counted: wrapped ranks that have
        neither completed a step of ctx.steps nor said they run without it (a fault before the
        first step)."""
        return self.managed and not self.steps_seen and not self.stepless

    def steps_reached(self, max_step: int) -> int | None:
        """The newest step any rank completed; None where nonstop sees no steps."""
        return max_step if self.managed and not self.stepless else None

    def productive_s(self, workers: Iterable[Any]) -> float | None:
        """Seconds rank 0 spent in steps that count, over every process that held it, as far as
        they reported (a process killed or interrupted counts what it had reported)."""
        if not self.steps_known():
            return None  # no steps: what was productive, and what was redone, is not known
        return sum(w.busy for w in workers if w.rank == 0)

    def incident_records(self, incidents: list[Incident]) -> list[dict[str, Any]]:
        """The closed incidents for the summary, with what the whole run revealed: an incident
        closed before any step was seen counts its steps once the run shows it iterates
        ctx.steps, and none does once a rank ran without it."""
        known = self.steps_known()
        for inc in incidents:
            inc.steps_known = known
        return [inc.to_record() for inc in incidents]


class SdcBook:
    """The replicas' comparisons (``detect.sdc``) as the ranks reported them: per generation the
    checks that agreed, and each mismatch found - for the summary's certificate."""

    def __init__(self) -> None:
        self.by_gen: dict[int, events.DigestChecks] = {}  # gen -> its checks (the fullest report)
        self.found: list[dict[str, Any]] = []  # mismatches: step, suspects, gen

    def report(self, gen: int, stats: events.DigestChecks | None) -> None:
        """A rank's digests at the end of a generation (left, or done)."""
        had = self.by_gen.get(gen)
        if stats is not None and stats.checks >= (had.checks if had is not None else 0):
            self.by_gen[gen] = stats

    def mismatch(self, gen: int, step: int, suspects: list[int], repaired: bool = True) -> bool:
        """A mismatch reported (each rank reports the same one): whether it is news.
        ``repaired``: rolled back (the policy's ``replace``), not only reported."""
        if any(f["gen"] == gen and f["step"] == step for f in self.found):
            return False
        self.found.append({"gen": gen, "step": step, "suspects": list(suspects),
                           "repaired": repaired})
        return True

    def summary(self) -> dict[str, Any] | None:
        if not self.by_gen and not self.found:
            return None
        gens = sorted(self.by_gen)
        checks = sum(self.by_gen[g].checks for g in gens)
        last = max((self.by_gen[g].last_step or 0 for g in gens), default=None)
        uncompared = next((self.by_gen[g].uncompared for g in gens
                           if self.by_gen[g].uncompared), None)
        replays = sum(self.by_gen[g].replays for g in gens)
        replay_s = sum(self.by_gen[g].replay_s for g in gens)
        stepped_s = sum(self.by_gen[g].stepped_s for g in gens)
        # the replay checks' cost: the seconds they added, as a share of the steps' own
        cost = {"replays": replays, "replay_s": round(replay_s, 6),
                "replay_pct": round(100 * replay_s / stepped_s, 3) if stepped_s else None} \
            if replays else {}
        return {"checks": checks, "mismatches": len(self.found), "found": self.found,
                "last_step": last, "chain": self.by_gen[gens[-1]].chain if gens else None,
                **({"uncompared": uncompared} if uncompared else {}), **cost}
