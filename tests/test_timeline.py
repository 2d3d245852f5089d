"""The picture of a run (timeline.png) and the HTML report, on synthetic run directories: what is
drawn (lanes, steps, faults, recovery phases, new processes, legend) is checked against the data
written, at 4 ranks and at 64 ranks on 8 nodes."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nonstop import cli
from nonstop.observe import report, timeline
from nonstop.observe.incidents import PHASES

T0 = 1_700_000_000.0
POLICY = {"detect": {"hang": {"timeout_s": 30.0}}, "budget": {"rank replacement": 8}}
# two incidents: phases (seconds, in PHASES order) and when each starts
PHASES_1 = dict(zip(PHASES, (0.03, 0.01, 0.1, 0.2, 0.3, 0.4, 0.5)))
PHASES_2 = dict(zip(PHASES, (2.0, 0.0, 0.5, 0.1, 0.2, 0.2, 0.3)))
FAULT_1, FAULT_2, END = 10.0, 20.0, 31.0


class Writer:
    """A synthetic run directory: events, progress samples and summary, times relative to t0."""

    def __init__(self, root: Path, t0: float):
        self.root, self.t0 = root, t0
        root.mkdir(parents=True, exist_ok=True)
        self.events = open(root / "events.jsonl", "a")
        self.progress = open(root / "progress.jsonl", "a")

    def event(self, t: float, type_: str, /, **fields) -> dict:
        rec = {"t": self.t0 + t, "type": type_, **fields}
        self.events.write(json.dumps(rec) + "\n")
        return rec

    def steps(self, wids: dict[int, int], nodes: dict[int, int], gen: int, t_from: float,
              t_to: float, step: int) -> int:
        """Every rank's samples every 0.5 s (5 steps of 0.1 s each) from t_from to t_to."""
        t = t_from
        while t <= t_to + 1e-9:
            step += 5
            for rank, wid in wids.items():
                self.progress.write(json.dumps({
                    "t": self.t0 + t, "wid": wid, "rank": rank, "node": nodes[rank], "gen": gen,
                    "step": step, "busy": 0.0, "stall": 0.0, "step_s": 0.1}) + "\n")
            t += 0.5
        return step

    def close(self) -> None:
        self.events.close()
        self.progress.close()


def make_run(root: Path, ranks: int = 4, per_node: int | None = None, attempt: int = 1,
             t0: float = T0, faults: bool = True) -> dict:
    """Write one attempt: start, a crash of rank 1 at FAULT_1 (a warm spare takes it), then at
    FAULT_2 a hang (one node: rank 2 is killed and replaced cold) or the loss of node 1 (many
    nodes: its ranks replaced cold); the run ends at END. Returns what a test checks against."""
    per_node = per_node or ranks
    nodes = {r: r // per_node for r in range(ranks)}
    multi = ranks > per_node
    w = Writer(root, t0)
    w.event(0.0, "run_start", attempt=attempt, world=ranks, spares=1, managed=True, policy=POLICY)
    wids = {r: r + 1 for r in range(ranks)}
    for r, wid in wids.items():
        w.event(0.1, "spawn", wid=wid, pid=1000 + wid, spare=False, rank=None, node=nodes[r])
    spare = ranks + 1
    w.event(0.1, "spawn", wid=spare, pid=1000 + spare, spare=True, rank=None, node=0)
    w.event(2.0, "generation", gen=0, level="start", ranks={str(r): x for r, x in wids.items()})
    incidents = []
    if not faults:
        w.steps(wids, nodes, 0, 2.5, END - 1, 0)
    else:
        step = w.steps(wids, nodes, 0, 2.5, FAULT_1 - 0.5, 0)
        w.event(FAULT_1 + 0.02, "fault", kind="peer", code="PEER", rank=0, node=None,
                message="peer closed", incident=1, gen=0)
        w.event(FAULT_1 + 0.03, "fault", kind="crash", code="SIGKILL", rank=1, node=None,
                message="", incident=1, gen=0)
        w.event(FAULT_1 + 0.1, "replace", rank=1, wid=spare, node=0, warm=True, cold=False)
        wids[1] = spare
        w.event(FAULT_1 + 0.2, "generation", gen=1, level="rank replacement",
                ranks={str(r): x for r, x in wids.items()})
        w.event(FAULT_1 + 0.9, "restore", gen=1, step=step, sources={})
        incidents.append(w.event(FAULT_1 + 1.6, "incident", id=1, faults=["rank 1 killed"],
                                 levels=["rank replacement"], replaced=[1], t_fault=t0 + FAULT_1,
                                 mttr_s=sum(PHASES_1.values()), phases_s=PHASES_1, steps_lost=0,
                                 outcome="recovered"))
        step = w.steps(wids, nodes, 1, 11.5, FAULT_2, step)
        if multi:
            replaced = [r for r in range(ranks) if nodes[r] == 1]
            w.event(FAULT_2 + 2.0, "fault", kind="node_lost", code="NODE_LOST", rank=None, node=1,
                    message="lease expired", incident=2, gen=1)
            w.event(FAULT_2 + 2.0, "node_lost", node=1, reason="lease expired")
        else:
            replaced = [2]
            w.event(FAULT_2 + 2.0, "hang_detected", timeout_s=2.0, frozen={},
                    last_progress=t0 + FAULT_2)
            w.event(FAULT_2 + 2.0, "fault", kind="hang", code="HANG", rank=None, node=None,
                    message="no step", incident=2, gen=1)
            w.event(FAULT_2 + 2.5, "fault", kind="teardown_timeout", code="TEARDOWN_TIMEOUT",
                    rank=2, node=0, message="still in generation 1", incident=2, gen=1)
        for r in replaced:
            wids[r] = 100 + r
            w.event(FAULT_2 + 2.55, "replace", rank=r, wid=wids[r], node=nodes[r], warm=False,
                    cold=True)
        w.event(FAULT_2 + 2.6, "generation", gen=2, level="rank replacement",
                ranks={str(r): x for r, x in wids.items()})
        if multi:
            w.event(FAULT_2 + 4.0, "node_joined", node=8)
        incidents.append(w.event(FAULT_2 + 3.4, "incident", id=2, faults=["lost"],
                                 levels=["rank replacement"], replaced=replaced,
                                 t_fault=t0 + FAULT_2, mttr_s=sum(PHASES_2.values()),
                                 phases_s=PHASES_2, steps_lost=0, outcome="recovered"))
        w.steps(wids, nodes, 2, 23.1, END - 1, step)
    recovery = {p: PHASES_1[p] * bool(incidents) + PHASES_2[p] * (len(incidents) > 1)
                for p in PHASES}
    time_s = {"startup": 2.5, "productive": 20.0, "recomputed": 0.5, "recovery": recovery,
              "snapshot": 0.3, "checkpoint": 0.5}
    time_s["idle"] = END - 2.5 - 20.0 - 0.5 - 0.3 - 0.5 - sum(recovery.values())
    mttrs = sorted(i["mttr_s"] for i in incidents)
    summary = {"exit_code": 0, "steps": 200, "wall_s": END, "incidents": len(incidents),
               "mttr_s": {"median": sum(mttrs) / len(mttrs), "min": mttrs[0], "max": mttrs[-1],
                          "n": len(mttrs)} if mttrs else None,
               "goodput": 20.0 / END, "attempt": attempt, "time_s": time_s,
               "incident_list": [{k: v for k, v in i.items() if k not in ("t", "type")}
                                 for i in incidents], "steps_lost": 0}
    w.event(END, "run_end", **summary)
    w.close()
    (root / "summary.json").write_text(json.dumps(summary))
    return {"nodes": nodes, "replaced": incidents[-1]["replaced"] if incidents else []}


def _draw(root: Path) -> tuple[dict, np.ndarray]:
    record: dict = {}
    png = timeline.draw(root, record=record)
    assert png == root / "timeline.png"
    import matplotlib.image

    return record, matplotlib.image.imread(png)


def _near(xs, x) -> bool:
    return any(abs(a - x) < 1e-6 for a in xs)


def _check_picture(record: dict, image: np.ndarray) -> None:
    """What every picture must hold: its size, readable labels, legend, colours on the canvas."""
    width, height = record["size_px"]
    assert image.shape[:2] == (height, width)
    assert record["label_overlaps"] == 0 and record["outside"] == []
    rgb = (image[:, :, :3] * 255).round().astype(int)
    fault = np.array([int(timeline.FAULT_COLOUR[i:i + 2], 16) for i in (1, 3, 5)])
    assert (np.abs(rgb - fault).sum(axis=2) < 10).sum() > 20  # fault markers on the canvas
    assert [f"recovery: {p}" for p in PHASES] == [t for t in record["legend"]
                                                  if t.startswith("recovery: ")]


def _check_spans(record: dict) -> None:
    """Each incident's phases: in order, consecutive from its fault, adding up to its MTTR."""
    for start, phases in ((FAULT_1, PHASES_1), (FAULT_2, PHASES_2)):
        spans = [s for s in record["spans"] if start - 1e-6 <= s[1] < start + sum(phases.values())]
        assert [s[0] for s in spans] == [p for p in PHASES if phases[p] > 0]
        t = start
        for phase, x0, x1 in spans:
            assert x0 == pytest.approx(t) and x1 - x0 == pytest.approx(phases[phase])
            t = x1
        assert t == pytest.approx(start + sum(phases.values()))


def test_four_ranks(tmp_path):
    make_run(tmp_path)
    record, image = _draw(tmp_path)
    _check_picture(record, image)
    assert record["lanes"]["labels"] == ["rank 0", "rank 1", "rank 2", "rank 3"]
    assert record["lanes"]["nodes"] == []
    # steps: one bar per process and generation, from its first step's start to its last sample
    assert [g for _a, _b, g in record["segments"][0]] == [0, 1, 2]
    x0, x1, _ = record["segments"][1][0]
    assert x0 == pytest.approx(2.4) and x1 == pytest.approx(FAULT_1 - 0.5)
    # faults where they happened: the crash at its fault time, the hang on the job row, the rest
    # when detected; a symptom kept apart
    faults = {(lane, kind): x for lane, x, kind in record["faults"]}
    assert faults == pytest.approx({(1, "crash"): FAULT_1, (0, "peer (symptom)"): FAULT_1 + 0.02,
                                    ("job", "hang"): FAULT_2,
                                    (2, "teardown_timeout"): FAULT_2 + 2.5})
    _check_spans(record)
    assert record["members"] == [(1, pytest.approx(FAULT_1 + 0.2), "warm spare"),
                                 (2, pytest.approx(FAULT_2 + 2.6), "cold")]
    assert [g for g, _x in record["generations"]] == [0, 1, 2]
    assert record["strip"]["generations"][1] == "g1 @75"
    assert record["strip"]["incidents"] == ["#1 1.54 s", "#2 3.30 s"]
    for entry in ("steps: generation 0, 2, 4...", "steps: generation 1, 3, 5...", "fault",
                  "symptom (a peer's fault)", "new process: warm spare", "new process: cold",
                  "new generation"):
        assert entry in record["legend"]
    assert "2 incident(s) | MTTR median 2.42 s | goodput 64.5% | wall 31.0 s" in record["subtitle"]
    assert record["account"]["parts"]["productive"] == pytest.approx(100 * 20 / END)
    assert sum(record["account"]["parts"].values()) == pytest.approx(100)


def test_sixty_four_ranks_on_eight_nodes(tmp_path):
    expected = make_run(tmp_path, ranks=64, per_node=8)
    record, image = _draw(tmp_path)
    _check_picture(record, image)
    lanes = record["lanes"]
    assert lanes["count"] == 64 and lanes["ranks"] == list(range(64))
    assert lanes["every"] == 4 and lanes["labels"] == [f"rank {r}" for r in range(0, 64, 4)]
    assert lanes["nodes"] == [f"node {n}" for n in range(8)]
    # the lost node's fault on each of its ranks' lanes; each of them gets a cold process
    lost = [(lane, x) for lane, x, kind in record["faults"] if kind == "node_lost"]
    assert sorted(lane for lane, _ in lost) == expected["replaced"] == list(range(8, 16))
    assert all(x == pytest.approx(FAULT_2) for _, x in lost)
    cold = [rank for rank, _x, how in record["members"] if how == "cold"]
    assert cold == list(range(8, 16))
    assert record["strip"]["nodes"] == ["-n1", "+n8"]
    _check_spans(record)
    assert "64 ranks on 8 nodes" in record["subtitle"]
    assert image.shape[0] <= 1500  # fits a screen


def test_without_progress_still_draws(tmp_path):
    make_run(tmp_path)
    (tmp_path / "progress.jsonl").unlink()
    record, image = _draw(tmp_path)
    assert image.shape[:2] == record["size_px"][::-1]
    assert record["lanes"]["count"] == 4
    assert not any(record["segments"].values())
    assert "no progress.jsonl" in record["notes"][0]
    assert len(record["faults"]) == 4 and record["spans"] and record["members"]


def test_last_attempt_drawn(tmp_path):
    make_run(tmp_path)
    make_run(tmp_path, attempt=2, t0=T0 + 100, faults=False)
    record, _ = _draw(tmp_path)
    assert "(attempt 2 of 2)" in record["title"]
    assert record["faults"] == [] and record["spans"] == [] and record["members"] == []
    assert "0 incident(s)" in record["subtitle"]
    assert all(x0 >= 0 for segs in record["segments"].values() for x0, _x1, _g in segs)


def test_report_html_is_self_contained(tmp_path, capsys):
    make_run(tmp_path)
    assert cli.main(["report", str(tmp_path), "--html"]) == 0
    out = capsys.readouterr().out
    assert f"timeline: {tmp_path / 'timeline.png'}" in out
    page = (tmp_path / "report.html").read_text()
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(images) == 1
    assert base64.b64decode(images[0]) == (tmp_path / "timeline.png").read_bytes()
    assert all(ref.startswith("data:") for ref in re.findall(r'(?:src|href)="([^"]*)"', page))
    assert "<link" not in page and "<script" not in page
    rows = re.findall(r'<tr class="incident">(.*?)</tr>', page)
    assert len(rows) == 2 and "rank 1 killed" in rows[0] and "1.540" in rows[0]
    assert "timeout_s: 30.0" in page and "rank replacement: 8" in page  # the policy, as YAML
    assert "productive" in page and "goodput: 64.5%" in page


def test_report_without_picture_and_bad_input(tmp_path, capsys):
    make_run(tmp_path)
    assert cli.main(["report", str(tmp_path), "--no-picture"]) == 0
    assert not (tmp_path / "timeline.png").exists()
    (tmp_path / "events.jsonl").unlink()  # a summary alone: the summary, and why no picture
    assert cli.main(["report", str(tmp_path)]) == 0
    assert "timeline: no picture: no events.jsonl" in capsys.readouterr().out
    with pytest.raises(timeline.NoPicture):
        timeline.draw(tmp_path)
    assert cli.main(["report", str(tmp_path / "nope"), "--html"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no run at" in err
    for bad in ('{"incidents": 1, "incident_list": [1], "wall_s": "x"}', "[1]"):
        (tmp_path / "summary.json").write_text(bad)  # not a summary nonstop wrote
        assert cli.main(["report", str(tmp_path), "--no-picture"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "is not a summary nonstop wrote" in err


def test_malformed_lines_still_draw(tmp_path, capsys):
    """Torn and malformed lines (a launcher killed mid-write, a hand-edited file) are skipped or
    read as nothing: the picture and the page are still made."""
    make_run(tmp_path)
    with open(tmp_path / "events.jsonl", "a") as fh:
        for rec in ({"t": T0 + 5, "type": "generation", "gen": 9, "ranks": [1, 2]},
                    {"t": T0 + 6, "type": "fault", "kind": "crash", "rank": "x", "incident": [1]},
                    {"t": "late", "type": "fault"}, {"t": T0 + 7, "type": "hang_detected",
                                                     "frozen": [3]},
                    {"t": T0 + 8, "type": "incident", "id": 7, "t_fault": T0 + 8,
                     "phases_s": [1, 2], "mttr_s": "?"}):
            fh.write(json.dumps(rec) + "\n")
        fh.write('{"t": 1, "type": "fau')
    with open(tmp_path / "progress.jsonl", "a") as fh:
        sample = {"t": T0 + 9, "rank": 1, "wid": [2], "gen": "g", "step_s": "s"}
        fh.write(json.dumps(sample) + '\n[1, 2]\n{"t')
    assert cli.main(["report", str(tmp_path), "--html"]) == 0
    record, image = _draw(tmp_path)
    assert image.shape[:2] == record["size_px"][::-1] and record["lanes"]["count"] == 4
    summary = json.loads((tmp_path / "summary.json").read_text())
    summary["time_s"]["recovery"]["detect"] = "slow"
    summary["incident_list"].append({"id": 3, "mttr_s": None, "phases_s": "none"})
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    _draw(tmp_path)
    page = report.render_html(str(tmp_path), tmp_path / "timeline.png")
    assert len(re.findall(r'<tr class="incident">', page)) == 3


@pytest.mark.integration
def test_import_stays_light():
    code = ("import sys, nonstop.cli, nonstop.observe.report, nonstop.observe.timeline; "
            "sys.exit('matplotlib' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
