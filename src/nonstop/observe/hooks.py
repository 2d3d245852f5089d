"""The escalation hook nonstop runs when it gives up on a job: a shell command and/or an HTTP POST,
each given the diagnosis as JSON. It never raises: a failing hook must not crash a clean give-up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from functools import partial
from typing import Any

from ..policy import GiveUpHook

TAIL = 2000  # characters of output kept for the record: enough to see why, small enough to log
# Linux refuses to exec with any one environment string over 128 KiB (MAX_ARG_STRLEN); a bigger
# diagnosis is left out of the environment rather than losing the whole command to E2BIG.
ENV_LIMIT = 100_000


def run_give_up_hook(hook: GiveUpHook, diagnosis: dict[str, Any]) -> list[dict[str, Any]]:
    """Run the hook's command, then POST to its URL (whichever are set); one record per action."""
    body = _to_json(diagnosis)
    records: list[dict[str, Any]] = []
    if hook.command:
        run = partial(_command, hook.command, body, hook.timeout_s)
        records.append(_guarded("command", hook.command, run))
    if hook.url:
        records.append(_guarded("url", hook.url, partial(_post, hook.url, body, hook.timeout_s)))
    return records


def _to_json(diagnosis: dict[str, Any]) -> str:
    try:
        return json.dumps(diagnosis, default=str)  # sets, paths, exceptions...: their str() will do
    except Exception as exc:  # noqa: BLE001 - non-str keys, a cycle: send something, not nothing
        try:
            text = repr(diagnosis)[-TAIL:]
        except Exception:  # noqa: BLE001 - a __repr__ that raises: the error alone will do
            text = ""
        return json.dumps({"error": f"diagnosis not serialisable: {exc}", "repr": text})


def _guarded(action: str, target: str, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    # The helpers catch what they expect; this catches what they don't, so the give-up still ends
    # cleanly whatever the hook does.
    t0 = time.monotonic()
    try:
        record = run()
    except Exception as exc:  # noqa: BLE001
        record = {"ok": False, "detail": _line(f"{type(exc).__name__}: {exc}"), "output": ""}
    seconds = round(time.monotonic() - t0, 3)
    return {"action": action, "target": target, **record, "seconds": seconds}


def _line(text: str) -> str:
    return " ".join(text.split())  # the detail is a one-line summary, whatever the error said


def _tail(data: bytes | None) -> str:
    return (data or b"").decode(errors="replace")[-TAIL:]


def _command(command: str, body: str, timeout_s: float) -> dict[str, Any]:
    env = dict(os.environ)
    if len(body) < ENV_LIMIT:
        env["NONSTOP_DIAGNOSIS"] = body
    try:
        # Its own session, so that on timeout one killpg ends the shell and all it started.
        proc = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    except (OSError, ValueError) as exc:  # no /bin/sh, a NUL byte in the command, ...
        return {"ok": False, "detail": _line(f"could not start: {exc}"), "output": ""}
    try:
        out, _ = proc.communicate(body.encode(), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()  # reap the shell
        try:
            out, _ = proc.communicate(timeout=1.0)
        except subprocess.TimeoutExpired as exc:
            # Something that left the group (setsid) still holds the pipe: don't wait for it.
            out = exc.output
            if proc.stdout is not None:
                proc.stdout.close()
        detail = f"timeout after {timeout_s:g} s: process group killed"
        return {"ok": False, "detail": detail, "output": _tail(out), "timed_out": True}
    code = proc.returncode
    detail = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
    return {"ok": code == 0, "detail": detail, "output": _tail(out)}


def _post(url: str, body: str, timeout_s: float) -> dict[str, Any]:
    request = urllib.request.Request(url, data=body.encode(), method="POST",
                                     headers={"Content-Type": "application/json",
                                              "User-Agent": "nonstop-give-up-hook"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            status, data = response.status, response.read(1 << 20)  # bounded: only the tail is kept
    except urllib.error.HTTPError as exc:  # urllib raises for >= 400; the body often says why
        try:
            data = exc.read(1 << 20)
        except Exception:  # noqa: BLE001 - the status alone is enough
            data = b""
        detail = _line(f"HTTP {exc.code} {exc.reason}")
        return {"ok": False, "detail": detail, "output": _tail(data)}
    except Exception as exc:  # noqa: BLE001 - refused, DNS, timeout, TLS: all just "failed"
        record = {"ok": False, "detail": _line(f"{type(exc).__name__}: {exc}"), "output": ""}
        if isinstance(exc, TimeoutError) or isinstance(getattr(exc, "reason", None), TimeoutError):
            record["timed_out"] = True
        return record
    return {"ok": status < 400, "detail": f"HTTP {status}", "output": _tail(data)}


def on_give_up(hook: GiveUpHook, log: Any, display: Any, report: dict[str, Any]) -> None:
    """The job gives up: run the policy's hook (if any), each action logged, a failure shown."""
    if not (hook.command or hook.url):
        return
    for record in run_give_up_hook(hook, report):
        log.write("hook", **record)
        if record.get("timed_out"):
            log.deadline("give_up_hook", hook.timeout_s, waited_s=record["seconds"],
                         action=record["action"], target=record["target"])
        if not record["ok"]:
            display.info(f"give-up hook {record['action']} failed: {record['detail']}")
