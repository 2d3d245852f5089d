"""HSDP (``fully_shard`` over a 2-D mesh) made restartable with nonstop.

    nonstop run --nproc 4 --spares 1 examples/train_hsdp.py --steps 100 --save final.pt

examples/train_fsdp.py with two replica groups (``--replicas 2`` unless given): the mesh is
``(dp_replicate, dp_shard)`` = ``(2, world / 2)``; each rank's twin in the other replica group
holds the same shard, and a lost rank's replacement receives it live from its twin: nothing is
lost even without a snapshot at every step. Read train_fsdp.py for the script itself.
"""

import os
import runpy
import sys

import nonstop  # noqa: F401 - the script it runs uses nonstop: nonstop run reads that from here

if not any(a == "--replicas" or a.startswith("--replicas=") for a in sys.argv[1:]):
    sys.argv[1:1] = ["--replicas", "2"]
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_fsdp.py"),
               run_name="__main__")
