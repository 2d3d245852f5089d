"""One rank of a 2-rank gloo generation that is closed, then released (tests/test_pg_release.py).

argv: rank, store port, mode. ``drain``: both ranks release; ``stuck``: rank 1 never does and
rank 0 releases with the group's sockets left open, so its probe cannot complete. Prints the
seconds ``release`` took and how many groups were kept undestroyed."""

import sys
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
group.close()
if mode == "stuck":
    if rank == 1:
        time.sleep(2)  # alive and silent: its end of the group answers nothing
        sys.exit(0)
    group._group_fds = {}  # nothing shut: the probe waits for a peer that never joins
t0 = time.monotonic()
group.release()
print(f"released {time.monotonic() - t0:.3f} undrained {len(pg._UNDRAINED)}", flush=True)
