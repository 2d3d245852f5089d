"""examples/train_ddp.py, then a while longer in the script once training is over (as a script
that uploads its results would): the job's end is reached with its rank processes still alive.
``LINGER_S`` (default 1) is how long; rank 0 prints "lingering" when it starts to."""

import os
import runpy
import sys
import time
from pathlib import Path

import nonstop  # noqa: F401 - a wrapped script (train_ddp.py wraps its training)

TRAIN = Path(nonstop.__file__).parent / "examples" / "train_ddp.py"
sys.argv[0] = str(TRAIN)
runpy.run_path(str(TRAIN), run_name="__main__")
if os.environ.get("RANK") == "0":
    print("lingering", flush=True)
time.sleep(float(os.environ.get("LINGER_S", "1")))
