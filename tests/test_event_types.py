"""The event log's types: one registry (observe/event_types.py), every type the code writes in
it, every one documented in docs/events.md, and any other refused by the log."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from nonstop.observe import event_types
from nonstop.observe.events import EventLog

ROOT = Path(__file__).resolve().parent.parent


def _written() -> dict[str, str]:
    """type -> a file that writes it: every ``<x>.write("<type>", ...)`` in the package."""
    out = {}
    for p in (ROOT / "src" / "nonstop").rglob("*.py"):
        for n in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) \
                    and n.func.attr == "write" and n.args and isinstance(n.args[0], ast.Constant) \
                    and isinstance(n.args[0].value, str) and re.fullmatch(r"[a-z_]+", n.args[0].value):
                out[n.args[0].value] = str(p.relative_to(ROOT))
    return out


def test_every_type_written_is_registered():
    written = _written()
    assert len(written) > 40
    assert {t: f for t, f in written.items() if t not in event_types.ALL} == {}


def test_every_type_is_documented():
    doc = (ROOT / "docs" / "events.md").read_text()
    section = doc.split("## Events", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| ((?:`[a-z_]+`(?:, )?)+) \|", section, re.M)
    documented = {name for row in rows for name in re.findall(r"`([a-z_]+)`", row)}
    assert sorted(event_types.CONTROLLER - documented) == []
    assert sorted(documented - event_types.CONTROLLER) == []  # nothing documented that is gone
    prose = section.split("Reported by the rank processes", 1)[1]
    named = set(re.findall(r"`([a-z_]+)`", prose))
    assert sorted(set(event_types.RANK_FORWARDED) - named) == []


def test_an_unknown_type_is_refused_and_nothing_written(tmp_path):
    log = EventLog(tmp_path)
    log.write("run_start", world=2)
    with pytest.raises(ValueError, match="unknown event type 'run_strat'"):
        log.write("run_strat", world=2)
    log.write_record("rank_entered", {"wid": 1, "gen": 0})
    log.close()
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert len(lines) == 2 and "run_strat" not in "".join(lines)
