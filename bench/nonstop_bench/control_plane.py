"""``nonstop bench control-plane``: can the control plane carry a job of thousands of ranks?

The real controller (``nonstop.controller.elected``, elected in a real etcd) runs a job whose hosts are
simulated: this process stands in for H host agents of 8 ranks each. Every simulated host
registers in etcd under a lease of its own, listens on a port of its own and speaks the hosts'
real protocol (the authenticated channel, the typed messages of ``protocol/messages.py``); its
ranks say what real ranks say (hello, ready, joining, entered, first step, left, done) and meet,
for each generation, on a real store (torch's TCPStore, libuv) under the generation's prefix. Only
the training is missing: a step takes no time.

One rank's process is reported dead (SIGKILL). Measured from that report: the controller's
decision (the aborts reach every host), every rank's assignment in the new generation delivered,
the rendezvous of the new generation complete for all, and every rank past its first step (the
incident closed). At 1,024, 4,096 and 16,384 ranks by default.

What one machine cannot show: the hosts' work runs here on the same cores as the controller and
etcd; on a cluster it runs on the hosts. The simulated ranks share a pool of store connections
(``control_plane_sim.STORE_CONNS``; thousands of connections from one process stall here):
each rank's add is its own request, and the hosts of a group (one in ``STORE_CONNS``) wait for
the generation to open with one request. JSON printed last on stdout:
``{"scenario": "control_plane", "results": [{"ranks": N, "store": "etcd", "recovery_s":
{"median": ..}, ...}]}``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from .control_plane_sim import PER_HOST, TIMEOUT_S, measure

SIZES = (1024, 4096, 16384)
TARGET_S = 1.0  # at 16,384 ranks: fault reported -> every rank in the new generation


def _raise_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, need))
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


PLACEMENTS = ("shared", "split")


def _placements(text: str | None) -> list[str]:
    from nonstop.errors import UsageError

    names = [p.strip() for p in (text or ",".join(PLACEMENTS)).split(",") if p.strip()]
    bad = [p for p in names if p not in PLACEMENTS]
    if bad or not names:
        raise UsageError(f"--placement: {', '.join(bad) or 'none'}: not one of "
                         f"{', '.join(PLACEMENTS)}")
    if "split" in names and len(os.sched_getaffinity(0)) < 2:
        raise UsageError("--placement split needs 2 cores or more")
    return names


def _measure_all(sizes: list[int], repeat: int, spares: int, base: Path, placement: str,
                 seed: int | None) -> list[dict[str, Any]]:
    """Every size, ``repeat`` times, with one etcd. ``split``: the controller and etcd run on the
    first core, this process (the simulated hosts and the rendezvous store) on the others, as on
    a cluster, where the hosts' work runs on the hosts; ``shared``: every process on every core."""
    from nonstop.store.etcd_server import EtcdCluster

    cores = os.sched_getaffinity(0)
    pin: tuple[str, ...] = ()
    if placement == "split":
        pin = ("taskset", "-c", str(min(cores)))
    results = []
    etcd = EtcdCluster([("e0", "127.0.0.1", pin)], base / "etcd")
    try:
        etcd.start()
        if pin:  # (this thread's threads, made from now on, inherit it)
            os.sched_setaffinity(0, cores - {min(cores)})
        for n in sizes:
            runs, errors = [], []
            for k in range(repeat):
                try:
                    r = measure(n, spares, base / f"k{k}", etcd.url, (seed or 0) + k,
                                timeout_s=TIMEOUT_S, pin=pin)
                except (RuntimeError, TimeoutError, OSError) as exc:  # said, and the next size
                    errors.append(str(exc).strip().splitlines()[0])
                    print(f"nonstop bench control-plane: {n} ranks ({placement}): {errors[-1]}",
                          file=sys.stderr, flush=True)
                    continue
                r["placement"] = placement
                runs.append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)
            rec: dict[str, Any] = {"ranks": n, "hosts": n // PER_HOST, "store": "etcd",
                                   "placement": placement}
            if runs:
                rec.update({
                    "recovery_s": {"median": round(statistics.median(
                        r["recovery_s"] for r in runs), 4)},
                    "first_step_s": {"median": round(statistics.median(
                        r["first_step_s"] for r in runs), 4)},
                    "phases_s": {p: round(statistics.median(r["phases_s"][p] for r in runs), 4)
                                 for p in runs[0]["phases_s"]},
                    "start_s": round(statistics.median(r["start_s"] for r in runs), 3)})
            if errors:
                rec["errors"] = errors
            results.append(rec)
    finally:
        os.sched_setaffinity(0, cores)
        etcd.stop()
    return results


def main(args: argparse.Namespace) -> int:
    from nonstop.errors import UsageError
    from nonstop.store.etcd_server import etcd_binary
    from .scale import _ints

    sizes = _ints(args.sizes, SIZES, "--sizes")
    if min(sizes) < PER_HOST or any(n % PER_HOST for n in sizes):
        raise UsageError(f"--sizes: multiples of {PER_HOST} ranks (simulated hosts of {PER_HOST})")
    repeat = args.repeat or 1  # a run of thousands of simulated ranks takes minutes
    spares = 1
    try:
        etcd_binary()
    except Exception as exc:  # noqa: BLE001
        raise UsageError(f"bench control-plane needs etcd: {exc}") from None
    _raise_fd_limit(12 * max(sizes) // PER_HOST + 4096)
    placements = _placements(args.placement)
    base = Path(tempfile.mkdtemp(prefix="nonstop-cp-"))
    results = []
    try:
        for placement in placements:
            results += _measure_all(sizes, repeat, spares, base / placement, placement, args.seed)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    out = {"scenario": "control_plane", "per_host": PER_HOST, "target_s": TARGET_S,
           "results": results}
    print(json.dumps(out))
    return 0 if all("recovery_s" in r for r in results) else 1
