"""A rank's CUDA error as its event carries it: its kind, the CUDA runtime's name and text.
Which exception is which is told in ``decide/cuda.py``."""

from __future__ import annotations

import dataclasses
from typing import Any

#: kind -> (sticky: the CUDA context is unusable after it, what it means)
KINDS: dict[str, tuple[bool, str]] = {
    "cuda_assert": (True, "a device-side assert (a check in a kernel, e.g. an index out of range)"),
    "cuda_error": (True, "a CUDA error that leaves the process's CUDA context unusable"),
    "gpu_hardware": (True, "the GPU reported a hardware fault"),
    "cuda_oom": (False, "the GPU ran out of memory"),
}


@dataclasses.dataclass(frozen=True)
class CudaFault:
    """One CUDA error of a rank, as its event carries it."""

    kind: str  # a key of KINDS
    name: str  # the CUDA runtime's name, e.g. cudaErrorAssert
    text: str  # what it says, e.g. "device-side assert triggered"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown CUDA fault kind {self.kind!r}")
        if not isinstance(self.name, str) or not isinstance(self.text, str):
            raise ValueError("a CUDA fault's name and text are strings")

    @property
    def sticky(self) -> bool:
        """Whether the process's CUDA context is unusable: it is never restarted in place."""
        return KINDS[self.kind][0]

    def describe(self) -> str:
        return f"{self.name} ({self.text})"

    def record(self) -> dict[str, str]:
        return {"kind": self.kind, "name": self.name, "text": self.text}

    @classmethod
    def from_record(cls, rec: Any) -> "CudaFault":
        """The fault an event carries; a record that is not one is refused (ValueError)."""
        if not isinstance(rec, dict) or set(rec) != {"kind", "name", "text"}:
            raise ValueError(f"not a CUDA fault record: {rec!r}")
        return cls(rec["kind"], rec["name"], rec["text"])
