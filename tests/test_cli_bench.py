"""``nonstop bench`` and ``nonstop chaos`` where only the package is installed (``pip install
nonstop``): the benchmarks and soaks live beside it (``bench/``, the ``nonstop_bench``
distribution), and the command says in one line where to get them - exit 2, no traceback."""

from __future__ import annotations

import sys

import pytest

from nonstop import cli


@pytest.mark.parametrize("argv", [["bench", "crash"], ["bench", "control-plane"],
                                  ["chaos", "--faults", "1"], ["chaos", "--hosts", "2"]])
def test_without_the_benchmarks_one_line_says_where_they_are(argv, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "nonstop_bench", None)  # as if not installed
    monkeypatch.setattr(cli, "_terminate_as_exit", lambda: None)  # (this process's SIGTERM kept)
    for name in [m for m in sys.modules if m.startswith("nonstop_bench.")]:
        monkeypatch.delitem(sys.modules, name)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "Traceback" not in err
    assert err.startswith("nonstop: error: the benchmarks and soaks are not installed"), err
    assert "pip install -e bench" in err


def test_the_wheel_holds_the_product_not_its_lab():
    """The package holds no benchmark driver, test host or peer code (they are ``nonstop_bench``),
    and of the examples only the demo's script and its pacing."""
    from pathlib import Path

    import nonstop

    pkg = Path(nonstop.__file__).resolve().parent
    assert not (pkg / "bench").exists()
    assert sorted(p.name for p in (pkg / "examples").glob("*.py")) == ["pace.py", "train_ddp.py"]
    assert not any("nonstop_bench" in p.read_text() for p in pkg.rglob("*.py")
                   if p.name != "cli.py")


def test_an_event_log_is_read_as_it_grows_a_partial_line_waits_for_its_end(tmp_path):
    from nonstop_bench.common import JsonlTail

    path = tmp_path / "events.jsonl"
    tail = JsonlTail(path)
    assert tail.records() == []  # not there yet
    path.write_text('{"a": 1}\n{"b": ')
    assert tail.records() == [{"a": 1}]  # the second line is still being written
    with open(path, "a") as f:
        f.write('2}\nnot json\n{"c": 3}\n')
    assert tail.records() == [{"a": 1}, {"b": 2}, {"c": 3}]  # a malformed line is skipped
    path.write_text('{"d": 4}\n')  # written anew, shorter
    assert tail.records() == [{"d": 4}]
