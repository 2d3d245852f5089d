"""What a run directory says of an attempt that ended without its summary: a controller across
hosts that stepped down to a successor is told from one that was killed, and how far the job got
under it comes from the progress log too, not only from the events."""

from __future__ import annotations

import io
import json

from rich.console import Console

from nonstop.observe import events
from nonstop.observe.display import print_history


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_controller_that_stepped_down_is_told_and_its_steps_are_read_from_progress(tmp_path):
    _write(tmp_path / "events.jsonl", [
        {"t": 100.0, "type": "run_start", "attempt": 1, "managed": True},
        {"t": 101.0, "type": "rank_wrapped", "wid": 1},
        {"t": 101.5, "type": "rank_first_step", "gen": 0, "rank": 0, "step": 1},
        {"t": 140.0, "type": "stepped_down", "why": "a newer controller is in office"},
    ])
    _write(tmp_path / "progress.jsonl", [
        {"t": 120.0, "rank": 0, "gen": 0, "step": 57},
        {"t": 139.0, "rank": 1, "gen": 0, "step": 98},
        {"t": 500.0, "rank": 0, "gen": 3, "step": 400},  # another attempt's, long after
    ])
    (a,) = events.attempts(tmp_path / "events.jsonl")
    assert not a["ended"] and a["stepped_down"] == "a newer controller is in office"
    assert a["steps"] == 98
    out = io.StringIO()
    print_history(Console(file=out, width=200), [a])
    text = out.getvalue()
    assert "stepped down (a newer controller is in office)" in text
    assert "at least step 98" in text and "killed" not in text


def test_a_killed_launcher_is_still_said_so(tmp_path):
    _write(tmp_path / "events.jsonl", [
        {"t": 100.0, "type": "run_start", "attempt": 1, "managed": True},
        {"t": 101.0, "type": "rank_first_step", "gen": 0, "rank": 0, "step": 12},
    ])
    (a,) = events.attempts(tmp_path / "events.jsonl")
    out = io.StringIO()
    print_history(Console(file=out, width=200), [a])
    assert "its launcher was killed" in out.getvalue() and "step 12" in out.getvalue()
