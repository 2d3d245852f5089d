"""The test session's starter of rank scripts: it imports torch (and what the scripts import) once,
then forks a process per request that runs a script as ``python SCRIPT ARGS...`` would - in
milliseconds rather than the seconds of CPU a fresh interpreter spends importing torch.

    python forker.py SOCKET      (a Unix socket it listens on, until its parent is gone)

A request is one JSON datagram - argv (the script and its arguments), env, cwd - with the
child's stdout and stderr as two descriptors (SCM_RIGHTS). A waiter forked for the request forks
the child, answers {"pid": PID}, waits for it and answers {"code": CODE} (negative: killed by that
signal): the child's parent is the waiter, the test signals it by its pid. The forker itself
starts no thread, so a fork never copies a lock some thread held (tests/conftest.py starts it)."""

import array
import atexit
import importlib
import json
import os
import runpy
import select
import signal
import socket
import sys
import traceback

PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "torch.distributed.fsdp",
           "torch.distributed.tensor", "torch.distributed.device_mesh", "nonstop",
           "nonstop.runtime.pg", "nonstop.runtime.verdict", "nonstop.ddp")
MAX_MSG = 1 << 20


def main(path: str) -> None:
    parent = os.getppid()
    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    tmp = f"{path}.{os.getpid()}"
    listener.bind(tmp)
    listener.listen(16)
    os.rename(tmp, path)  # there once it can fork
    while os.getppid() == parent:
        readable, _, _ = select.select([listener], [], [], 1.0)
        _reap()
        if readable:
            conn, _ = listener.accept()
            _serve(conn, listener)


def _reap() -> None:
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def _serve(conn: socket.socket, listener: socket.socket) -> None:
    fds: list[int] = []
    try:
        data, anc, _, _ = conn.recvmsg(MAX_MSG, socket.CMSG_SPACE(2 * 4))
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                arr = array.array("i")
                arr.frombytes(payload[:len(payload) - len(payload) % arr.itemsize])
                fds.extend(arr)
        if data and len(fds) == 2:
            if os.fork() == 0:
                listener.close()
                _wait_for(json.loads(data), fds, conn)  # never returns
    except OSError:
        pass
    finally:
        conn.close()
        for fd in fds:
            os.close(fd)


def _wait_for(req: dict, fds: list[int], conn: socket.socket) -> None:
    code = 1
    try:
        pid = os.fork()
        if pid == 0:
            conn.close()
            _child(req, fds)  # never returns
        for fd in fds:
            os.close(fd)
        conn.send(json.dumps({"pid": pid}).encode())
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        conn.send(json.dumps({"code": code}).encode())
        code = 0
    except BaseException:  # noqa: BLE001 - a fork never returns into the forker's loop
        traceback.print_exc()
    os._exit(code)


def _child(req: dict, fds: list[int]) -> None:
    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            os.close(fd)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        script = os.path.abspath(req["argv"][0])
        sys.argv = list(req["argv"])
        sys.path[0] = os.path.dirname(script)  # as ``python SCRIPT`` puts it
        import random

        random.seed()  # a fork shares its parent's random state: a new process has its own
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - what a fresh interpreter prints of an error
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1])
