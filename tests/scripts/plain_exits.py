"""A torchrun-style script that exits with code 3 after a few steps, on every attempt."""

import sys
import time

import torch.distributed as dist

dist.init_process_group("gloo")
time.sleep(0.5)
if dist.get_rank() == 1:
    sys.exit(3)
dist.barrier()
