"""Entry point of every process ``nonstop run`` starts: ranks and warm spares alike.

``python -m nonstop.runtime.bootstrap SCRIPT [ARGS...]``: tie our life to the launcher, pay the slow
imports, then either run the script at once (it calls ``nonstop.wrap``, which waits for a rank when
there is none yet) or wait for a rank first (a plain torchrun script reads RANK at the top).
"""

from __future__ import annotations

import ast
import ctypes
import faulthandler
import importlib
import os
import runpy
import signal
import sys
import time
import traceback
from typing import Any

from .. import protocol

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    expected = os.environ.get(protocol.ENV_LAUNCHER_PID)
    if expected and os.getppid() != int(expected):
        os._exit(1)  # the launcher died before we could tie ourselves to it


def script_imports(path: str) -> tuple[list[str], bool, bool]:
    """Top-level modules the script imports, whether it uses nonstop, and whether it uses DDP."""
    try:
        with open(path, "rb") as fh:
            source = fh.read()
        tree = ast.parse(source, path)
    except (OSError, SyntaxError, ValueError):
        return [], False, False
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    uses_nonstop = any(n == "nonstop" or n.startswith("nonstop.") for n in names)
    uses_ddp = b"DistributedDataParallel" in source or b"DDP(" in source
    return names, uses_nonstop, uses_ddp


def prewarm(names: list[str], uses_ddp: bool) -> None:
    """Import what the script imports (and what DDP imports lazily), ignoring what fails: the
    script itself will report it."""
    wanted = ["torch", "torch.distributed"] + names
    if uses_ddp:
        wanted += ["torch.nn.parallel", "torch._dynamo"]
    for name in wanted:
        if name in sys.modules or name == "__main__":
            continue
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - best effort; the script re-imports and reports
            pass


def main() -> None:
    die_with_parent()
    # SIGUSR1 writes every thread's Python stack to stderr (the worker's log): nonstop asks for it
    # before killing a rank that missed a deadline, so a hang says where it was stuck.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if len(sys.argv) < 2:
        print("usage: python -m nonstop.runtime.bootstrap SCRIPT [ARGS...]", file=sys.stderr)
        sys.exit(2)
    script, args = sys.argv[1], sys.argv[2:]
    from . import worker

    rt = worker.current()
    if rt is None:
        print("nonstop bootstrap: not started by nonstop run", file=sys.stderr)
        sys.exit(2)
    rt.emit("hello", pid=os.getpid())
    names, uses_nonstop, uses_ddp = script_imports(script)
    t0 = time.time()
    prewarm(names, uses_ddp)
    mode = os.environ.get(protocol.ENV_SPARE_MODE, "script" if uses_nonstop else "import")
    msg = rt.poll_message()
    if msg is None and mode == "import":
        rt.emit("ready", pid=os.getpid(), mode="import", warm_s=time.time() - t0)
        msg = rt.wait_message()
    if msg is not None and msg["type"] == protocol.EXIT:
        os._exit(0)
    if rt.assignment is not None:
        rt.apply_env(rt.assignment)
        if not uses_nonstop:
            rt.assignment_consumed = True
            rt.emit("entered", gen=rt.assignment["gen"], rank=rt.assignment["rank"], plain=True,
                    step=None, t_assigned=time.time())
    run_script(rt, script, args)


def run_script(rt: Any, script: str, args: list[str]) -> None:
    """Run the script as ``__main__`` and end the process with its exit code.

    The process ends from *inside* each handler, with ``os._exit``, and the script's globals stay
    referenced until then: freeing them (or a failed script's frames) would destroy its process
    group, and a gloo group's destructor joins its worker
    threads while holding the GIL - a worker still finishing an aborted operation may need the
    GIL, and both would wait forever. Nothing needs destroying in a process that ends anyway.
    """
    from . import worker

    sys.argv = [script] + args
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        # keep the script's globals (its DDP, its group) referenced until the process ends
        kept = runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            _end(exc.code or 0)
        print(exc.code, file=sys.stderr)
        _end(1)
    except BaseException as exc:  # noqa: BLE001 - report the user's error to the launcher, once
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__):
            tb = tb.tb_next
        text = "".join(traceback.format_exception(type(exc), exc, tb))
        where = ""
        for frame, lineno in traceback.walk_tb(tb):
            if os.path.abspath(frame.f_code.co_filename) == os.path.abspath(script):
                where = f" ({os.path.basename(script)}, line {lineno})"
        rt.emit("exit", code=1, error=f"{type(exc).__name__}: {exc}{where}"[:2000],
                traceback=text[-20000:],
                import_error=isinstance(exc, (ImportError, SyntaxError)) and not rt.wrapped,
                collective=worker.is_collective_error(exc),
                gen=(rt.assignment or {}).get("gen"), rank=(rt.assignment or {}).get("rank"))
        _end(1)
    _end(0, kept)


def _end(code: int, *keep: Any) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
