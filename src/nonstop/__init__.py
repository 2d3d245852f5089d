"""nonstop: distributed PyTorch training that keeps going.

The public API is small: ``State`` (what survives a restart), ``wrap`` (make a training function
restartable in-process), ``Context`` (what the function sees of its generation), ``step_seed``,
``reproducible``, ``Mesh`` (a sharded job's device mesh), ``RNGState`` (the random generators, as state to register) and
``GlobalBatchSampler`` (each step's samples, the same whatever the world size).
Importing nonstop does not import torch.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

# what nonstop has to tell its user it prints itself, once and prefixed "nonstop:"; its loggers
# say nothing on their own (Python would print their warnings raw, beside those lines)
logging.getLogger(__name__).addHandler(logging.NullHandler())

__version__ = "0.1.0"
__all__ = ["State", "RNGState", "Mesh", "wrap", "Context", "step_seed", "reproducible",
           "GlobalBatchSampler", "__version__"]

if TYPE_CHECKING:
    from .runtime.mesh import Mesh
    from .runtime.registered import RNGState, State
    from .ddp import reproducible
    from .runtime.context import Context, step_seed
    from .runtime.sampler import GlobalBatchSampler
    from .runtime.wrap import wrap


def __getattr__(name: str) -> Any:
    if name in ("State", "RNGState"):
        from .runtime import registered

        return getattr(registered, name)
    if name == "Mesh":
        from .runtime.mesh import Mesh

        return Mesh
    if name == "wrap":
        from .runtime.wrap import wrap

        return wrap
    if name in ("Context", "step_seed"):
        from .runtime import context

        return getattr(context, name)
    if name == "reproducible":
        from .ddp import reproducible

        return reproducible
    if name == "GlobalBatchSampler":
        from .runtime.sampler import GlobalBatchSampler

        return GlobalBatchSampler
    raise AttributeError(f"module 'nonstop' has no attribute {name!r}")
