"""The give-up hook against a real shell and a real local HTTP server: it delivers the diagnosis,
reports every failure as a record, kills a command that overruns, and never raises."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nonstop.observe.hooks import run_give_up_hook
from nonstop.policy import GiveUpHook

DIAG = {"diagnosis": "rank 1 raised ValueError", "exit_code": 1, "step": 42,
        "incidents": [{"fault": "crash", "rank": 1}], "traceback": "line 1\nline 2 \u2014 'quoted'"}


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    # urllib honours *_proxy variables; a proxy in the test environment must not see loopback.
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.setenv(name, "*")


class Server:
    """A real HTTP server on a loopback port the OS picks; records each POST, answers `status`."""

    def __init__(self, status: int) -> None:
        self.requests: list[tuple[dict[str, str], bytes]] = []
        requests, answer = self.requests, status

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server API
                body = self.rfile.read(int(self.headers["Content-Length"]))
                requests.append((dict(self.headers), body))
                self.send_response(answer)
                self.send_header("Content-Length", "5")
                self.end_headers()
                self.wfile.write(b"noted")

            def log_message(self, *args: object) -> None:
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_port}/hook"
        self.thread = threading.Thread(target=self.http.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.thread.join(5)


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    s = Server(getattr(request, "param", 200))
    yield s
    s.close()


def gone_or_zombie(pid: int, timeout: float = 2.0) -> bool:
    # A killed orphan is re-parented and reaped by whoever is pid 1, maybe late: a zombie is dead.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.02)
    return False


@pytest.mark.integration
def test_command_gets_the_diagnosis_on_stdin_and_in_the_environment(tmp_path: Path) -> None:
    stdin, env = tmp_path / "stdin.json", tmp_path / "env.json"
    hook = GiveUpHook(command=f'cat > {stdin}; printf "%s" "$NONSTOP_DIAGNOSIS" > {env}; echo done')
    (rec,) = run_give_up_hook(hook, DIAG)
    assert json.loads(stdin.read_text()) == DIAG
    assert json.loads(env.read_text()) == DIAG
    assert rec["action"] == "command" and rec["target"] == hook.command
    assert rec["ok"] is True and "0" in rec["detail"] and rec["output"] == "done\n"
    assert set(rec) == {"action", "target", "ok", "detail", "output", "seconds"}
    assert isinstance(rec["seconds"], float) and 0 <= rec["seconds"] < 5


@pytest.mark.integration
def test_a_failing_command_is_a_record_with_its_exit_code_and_output() -> None:
    (rec,) = run_give_up_hook(GiveUpHook(command="echo nope >&2; exit 3"), DIAG)
    assert rec["ok"] is False and "3" in rec["detail"] and "nope" in rec["output"]
    assert "\n" not in rec["detail"]


@pytest.mark.integration
def test_a_missing_command_is_a_record() -> None:
    (rec,) = run_give_up_hook(GiveUpHook(command="/definitely/not/here --page"), DIAG)
    assert rec["ok"] is False and "127" in rec["detail"] and "not" in rec["output"]


@pytest.mark.integration
def test_the_output_kept_is_the_tail() -> None:
    (rec,) = run_give_up_hook(GiveUpHook(command="seq 1 5000; echo LAST"), DIAG)
    assert rec["ok"] and rec["output"].endswith("LAST\n") and len(rec["output"]) <= 2000


@pytest.mark.integration
def test_a_command_that_overruns_is_killed_with_its_children(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    hook = GiveUpHook(command=f"sleep 30 & echo $$ $! > {pids}; wait", timeout_s=0.5)
    t0 = time.monotonic()
    (rec,) = run_give_up_hook(hook, DIAG)
    assert time.monotonic() - t0 < 2.0
    assert rec["ok"] is False and "timeout" in rec["detail"] and rec["seconds"] < 2.0
    shell, sleep = (int(p) for p in pids.read_text().split())
    assert gone_or_zombie(shell) and gone_or_zombie(sleep)


def test_url_gets_the_diagnosis_as_json(server: Server) -> None:
    (rec,) = run_give_up_hook(GiveUpHook(url=server.url), DIAG)
    assert rec == {**rec, "action": "url", "target": server.url, "ok": True, "output": "noted"}
    assert "200" in rec["detail"]
    ((headers, body),) = server.requests
    assert json.loads(body) == DIAG
    assert headers["Content-Type"] == "application/json" and "nonstop" in headers["User-Agent"]


@pytest.mark.parametrize("server", [500], indirect=True)
def test_a_server_error_is_a_record(server: Server) -> None:
    (rec,) = run_give_up_hook(GiveUpHook(url=server.url), DIAG)
    assert rec["ok"] is False and "500" in rec["detail"] and rec["output"] == "noted"
    assert len(server.requests) == 1


def test_a_closed_port_is_a_quick_record() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    (rec,) = run_give_up_hook(GiveUpHook(url=f"http://127.0.0.1:{port}/", timeout_s=5), DIAG)
    assert rec["ok"] is False and rec["detail"] and time.monotonic() - t0 < 2.0


@pytest.mark.integration
def test_both_run_command_first(server: Server, tmp_path: Path) -> None:
    order = tmp_path / "order"
    hook = GiveUpHook(command=f"cat > /dev/null; echo command > {order}", url=server.url)
    recs = run_give_up_hook(hook, DIAG)
    assert [r["action"] for r in recs] == ["command", "url"] and all(r["ok"] for r in recs)
    assert order.read_text() == "command\n" and len(server.requests) == 1


def test_neither_does_nothing() -> None:
    assert run_give_up_hook(GiveUpHook(), DIAG) == []


class Opaque:
    def __str__(self) -> str:
        return "<opaque thing>"


@pytest.mark.integration
def test_values_json_cannot_hold_are_sent_as_their_str(server: Server, tmp_path: Path) -> None:
    stdin = tmp_path / "stdin.json"
    diag = {**DIAG, "ranks": {3}, "thing": Opaque(), "where": tmp_path}
    recs = run_give_up_hook(GiveUpHook(command=f"cat > {stdin}", url=server.url), diag)
    assert all(r["ok"] for r in recs)
    expected = {**DIAG, "ranks": "{3}", "thing": "<opaque thing>", "where": str(tmp_path)}
    assert json.loads(stdin.read_text()) == expected
    assert json.loads(server.requests[0][1]) == expected


@pytest.mark.integration
def test_a_diagnosis_json_cannot_encode_at_all_still_runs_the_hook(tmp_path: Path) -> None:
    stdin = tmp_path / "stdin.json"
    cyclic: dict = {"diagnosis": "x", (1, 2): "tuple key"}
    cyclic["self"] = cyclic
    (rec,) = run_give_up_hook(GiveUpHook(command=f"cat > {stdin}"), cyclic)
    assert rec["ok"] and "not serialisable" in json.loads(stdin.read_text())["error"]
