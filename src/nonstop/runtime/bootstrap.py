"""Entry point of every process ``nonstop run`` starts: ranks and warm spares alike.

``python -m nonstop.runtime.bootstrap SCRIPT [ARGS...]``: tie our life to the launcher, pay the slow
imports, then either run the script at once (a spare of a script that calls ``nonstop.wrap``, which
waits for a rank when there is none yet) or wait for a rank first (a rank's process; a spare of a
plain torchrun script, which reads RANK at the top).

A script that fails before reaching its training function is reported as failing at import: the
launcher stops the job rather than retry what fails the same way every time.
"""

from __future__ import annotations

import ast
import ctypes
import faulthandler
import functools
import importlib
import os
import runpy
import signal
import sys
import time
import traceback
from typing import Any

import nonstop.protocol as protocol
from ..protocol import events
from ..decide.cuda import of_exception

PR_SET_PDEATHSIG = 1
_GROUP_INIT: list[bool] = []  # not empty once a plain script called init_process_group


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
    from ..script_scan import imported_names, uses_nonstop

    names = imported_names(tree)
    uses_ddp = b"DistributedDataParallel" in source or b"DDP(" in source
    return names, uses_nonstop(path, tree), uses_ddp


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
    rt.emit(events.Started(pid=os.getpid()))
    names, uses_nonstop, uses_ddp = script_imports(script)
    watch_group_init(rt)
    t0 = time.time()
    prewarm(names, uses_ddp)
    mode = os.environ.get(protocol.ENV_SPARE_MODE, "script" if uses_nonstop else "import")
    msg = rt.poll_message()
    if msg is None and mode == "import":
        rt.emit(events.Ready(pid=os.getpid(), mode="import", warm_s=time.time() - t0))
        msg = rt.wait_message()
    elif msg is None and mode == "rank":
        # A rank's assignment is published as soon as the store is up (a replacement's before it
        # is started): waiting costs nothing, and the script runs with its rank in the
        # environment, so a failure at import is the script's whatever it reads at top level.
        msg = rt.wait_message()
    if isinstance(msg, protocol.Exit):
        os._exit(0)
    if rt.assignment is not None:
        rt.apply_env(rt.assignment)
        if not uses_nonstop:
            rt.assignment_consumed = rt.entered_plain = True
            rt.emit(events.EnteredGeneration(gen=rt.assignment.gen, rank=rt.assignment.rank,
                                             plain=True, step=None, t_assigned=time.time()))
    run_script(rt, script, args)


def _assigned_to(rt: Any) -> dict[str, Any]:
    """The generation and rank of the process's assignment (None: a spare that had none)."""
    a = rt.assignment
    return {"gen": a.gen if a else None, "rank": a.rank if a else None}


def watch_group_init(rt: Any = None) -> None:
    """Note when a script that does not use ``nonstop.wrap`` reaches its distributed part
    (``init_process_group``): an error before that point is the script's own and repeats on every
    attempt, one after it may come from a peer, and is recovered from. There, the faults injected
    into this rank that are keyed to steps are reported (``no_steps``, via ``plain``): nonstop
    sees no steps in such a script, so they could never fire, and the run is refused."""
    try:
        import torch.distributed as dist
        c10d = dist.distributed_c10d
    except (ImportError, AttributeError):
        return
    original = c10d.init_process_group

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if rt is not None and not rt.wrapped and not _GROUP_INIT:
            _unfireable(rt)
        _GROUP_INIT.append(True)
        return original(*args, **kwargs)

    dist.init_process_group = c10d.init_process_group = init_process_group


def _unfireable(rt: Any) -> None:
    a = rt.assignment
    rank = a.rank if a is not None else rt.rank
    faults = [f.describe() for f in rt.injector.need_steps(False) if f.applies(rank)]
    if faults:
        rt.emit(events.NoSteps(gen=a.gen if a else None, rank=rank, via="plain",
                               registered=False, function=None, faults=faults))


def _before_training(rt: Any) -> bool:
    """Whether the script failed before reaching its training function (``nonstop.wrap``'s
    function, or a plain script's process group)."""
    if rt.wrapped or _GROUP_INIT:
        return False
    dist = sys.modules.get("torch.distributed")
    return not (dist is not None and dist.is_available() and dist.is_initialized())


def _describe(exc: BaseException, script: str) -> tuple[str, str]:
    """One line (the error, and the script's line it went through last) and the traceback from the
    script's first frame on: bootstrap's and runpy's frames are noise to the user."""
    tb = exc.__traceback__
    ours = (__file__, runpy.__file__, "<frozen runpy>")
    while tb is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    where = ""
    for frame, lineno in traceback.walk_tb(tb):
        if os.path.abspath(frame.f_code.co_filename) == os.path.abspath(script):
            where = f" ({os.path.basename(script)}, line {lineno})"
    return f"{type(exc).__name__}: {exc}{where}"[:2000], text[-20000:]


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
    # whether the script runs with its rank in the environment (a warm spare runs it without)
    assigned = rt.assignment is not None
    try:
        # keep the script's globals (its DDP, its group) referenced until the process ends
        kept = runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if exc.code is None or isinstance(exc.code, int) else 1
        if code is not exc.code:
            print(exc.code, file=sys.stderr)
        if code and _before_training(rt):
            # the script gave up at its top level (argparse, a check of its own): every attempt
            # would do the same, and it said why in its output (no traceback to add)
            error, _ = _describe(exc, script)
            rt.emit(events.Exiting(code=code, error=error, traceback=None, import_error=True,
                                   assigned=assigned, collective=False, **_assigned_to(rt)))
        _end(code or 0)
    except BaseException as exc:  # noqa: BLE001 - report the user's error to the launcher, once
        error, text = _describe(exc, script)
        at_import = _before_training(rt)
        cuda = None if at_import else of_exception(exc)
        rt.emit(events.Exiting(code=1, error=error, traceback=text, import_error=at_import,
                               assigned=assigned, cuda=cuda, **_assigned_to(rt),
                               collective=not at_import and worker.is_collective_error(exc)))
        _end(1)
    _end(0, kept)


def _end(code: int, *keep: Any) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
