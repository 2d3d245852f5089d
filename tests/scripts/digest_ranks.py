"""One rank of two, for tests/test_digest.py: the replicas' digest check over real gloo, rank 1
reaching every check LATE_S after rank 0 (a pipeline's first stage still in its backward while
the last stage waits). Prints one JSON line of what it saw. Usage: digest_ranks.py RANK STORE_FILE"""

import json
import sys
import time
import warnings

import torch
import torch.distributed as dist

from nonstop.protocol.rank_policy import RankSdc
from nonstop.state.digest import Digests, SilentCorruption

LATE_S = 0.3
rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
torch.manual_seed(0)
model = torch.nn.Linear(64, 64)
checks = Digests(RankSdc(enabled=True, action="replace", max_overhead_pct=0.5, replay_every=0))
spent = []
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for step in range(1, 8):
        if rank == 1:
            time.sleep(LATE_S)
        spent.append(checks.check([model], step, 2))
    if rank == 1:  # a flipped bit: the check names both ranks (two replicas)
        with torch.no_grad():
            model.weight.view(torch.int32).view(-1)[5] ^= 1 << 3
    try:
        checks.check([model], 8, 2)
        found = None
    except SilentCorruption as exc:
        found = exc.suspects
print(json.dumps({"cost_s": checks.cost_s, "waited_s": max(spent), "checks": checks.checks,
                  "found": found, "warnings": [f"{w.category.__name__}: {w.message}"
                                               for w in caught]}))
dist.destroy_process_group()
