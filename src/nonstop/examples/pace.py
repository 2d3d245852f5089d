"""How the examples stand in for accelerator work, and how a harness paces them: each step
sleeps ``--sleep-ms``, and ``--slow-ms`` more while ``--slow-file`` exists - a test holds a job
back until it has seen what it waits for (a drain, a fault, a host coming back), then removes
the file and the rest runs at full speed. The sleeps change no number."""

from __future__ import annotations

import argparse
import os
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sleep-ms", type=float, default=0.0, help="stand-in for accelerator work")
    parser.add_argument("--slow-file", metavar="FILE",
                        help="while this file exists, each step sleeps --slow-ms more (a harness "
                             "holds the job back; no number changes)")
    parser.add_argument("--slow-ms", type=float, default=200.0)


def pause(args: argparse.Namespace) -> None:
    """A step's stand-in sleep, and the harness's while its file exists."""
    ms = args.sleep_ms
    if args.slow_file and os.path.exists(args.slow_file):
        ms += args.slow_ms
    if ms:
        time.sleep(ms / 1000)
