"""One rank of a 2-rank gloo generation that is closed, then released (tests/test_pg_release.py).

argv: rank, store port, mode. ``drain``: both ranks release; ``stuck``: rank 1 never does and
rank 0 releases with the group's sockets left open, so its probes cannot complete; ``busy``: an
operation of the generation is still running on one of gloo's threads (its completion callback
takes a while, and needs the GIL to end) while the other is idle (on rank 0; rank 1's
completes at once). Prints the seconds ``release``
took and whether the group is still kept; in ``busy`` mode, releases again once the operation is
over."""

import os
import sys
import tempfile
import threading
import time

import torch.distributed as dist

from nonstop.runtime import pg

rank, port, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
group = pg.GenerationGroup("127.0.0.1", port, 0, rank, 2, "gloo", "g/0/pg", 30.0, 60.0)
group.open()
import torch  # noqa: E402

t = torch.ones(4)
dist.all_reduce(t)
assert t[0].item() == 2.0
# (a worker thread is named once it first runs: on a loaded machine that may come after the
# first operation returned; seen once in a full run of the suite)
named_by = time.monotonic() + 5.0
while len(group.workers()) < 2 and time.monotonic() < named_by:
    time.sleep(0.01)
print(f"workers {len(group.workers())}", flush=True)
busy = threading.Event()
looked = threading.Event()  # rank 0 has released once (the worker must be busy until then)
if mode == "busy":
    def slow(_fut):
        busy.set()
        # rank 0: a worker thread of the group, still busy with the ended generation until the
        # first release has looked (a fixed time was outlasted by close() on a loaded machine).
        # Rank 1's operation may have completed before its callback was attached: the callback
        # then runs on the main thread, which must not wait for a release it has yet to make
        if rank == 0:
            looked.wait(60)

    # rank 0's operation must be posted, its callback attached, before rank 1's: then it
    # completes on a worker thread (attached to a future already complete - rank 0 slow to get
    # there on a loaded machine - the callback ran on the main thread: nothing was busy)
    attached = os.path.join(tempfile.gettempdir(), f"nonstop-kept-group-{port}.attached")
    if rank == 1:
        waited_by = time.monotonic() + 30
        while not os.path.exists(attached) and time.monotonic() < waited_by:
            time.sleep(0.01)
        time.sleep(0.1)
    pending = dist.all_reduce(torch.ones(4), async_op=True).get_future().then(slow)
    if rank == 0:
        open(attached, "w").close()
    assert busy.wait(30)
    if rank == 1:
        os.unlink(attached)
group.close()
if mode == "stuck":
    if rank == 1:
        time.sleep(2)  # alive and silent: its end of the group answers nothing
        sys.exit(0)
    group._group_fds = {}  # nothing shut: the probe waits for a peer that never joins
t0 = time.monotonic()
gone = group.release()
print(f"released {time.monotonic() - t0:.3f} kept {int(not gone)}", flush=True)
looked.set()
if mode == "busy":
    pending.wait()
    t0 = time.monotonic()
    gone = group.release()
    print(f"again {time.monotonic() - t0:.3f} kept {int(not gone)}", flush=True)
sys.stdout.flush()
os._exit(0)  # as a rank ends (bootstrap): a kept group is never destroyed by the interpreter
