"""HSDP with tensor parallelism (a 3-D mesh ``(dp_replicate, dp_shard, tp)``) made restartable
with nonstop.

    nonstop run --nproc 8 --spares 1 examples/train_3d.py --steps 100 --save final.pt

examples/train_2d.py with two replica groups (``--replicas 2`` unless given): the mesh is
``(2, world / (2 * tp), tp)``. Each rank's twin in the other replica group holds the same part
(the same ``dp_shard`` and ``tp`` coordinates), and a lost rank's replacement receives it live:
the rest of its tensor-parallel group waits in memory, nothing is lost. Read train_2d.py for the
script itself.
"""

import os
import runpy
import sys

import nonstop  # noqa: F401 - the script it runs uses nonstop: nonstop run reads that from here

if not any(a == "--replicas" or a.startswith("--replicas=") for a in sys.argv[1:]):
    sys.argv[1:1] = ["--replicas", "2"]
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_2d.py"),
               run_name="__main__")
