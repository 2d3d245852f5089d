"""CUDA errors, told from an exception's type and text: which poison the process (its CUDA context
is unusable: only a new process goes on), which a retry can fix, and whose they are (docs/faults.md)."""

from __future__ import annotations

import re

from ..protocol.cuda import CudaFault

#: (the CUDA runtime's name, the text it prints, kind). The text is cudaGetErrorString's, which
#: PyTorch and NCCL both quote; the name is in PyTorch's message from 2.8 on ("Search for `...'").
ERRORS: tuple[tuple[str, str, str], ...] = (
    ("cudaErrorAssert", "device-side assert triggered", "cuda_assert"),
    ("cudaErrorIllegalAddress", "an illegal memory access was encountered", "cuda_error"),
    ("cudaErrorLaunchFailure", "unspecified launch failure", "cuda_error"),
    ("cudaErrorMisalignedAddress", "misaligned address", "cuda_error"),
    ("cudaErrorIllegalInstruction", "an illegal instruction was encountered", "cuda_error"),
    ("cudaErrorInvalidPc", "invalid program counter", "cuda_error"),
    ("cudaErrorInvalidAddressSpace", "operation not supported on global/shared address space",
     "cuda_error"),
    ("cudaErrorHardwareStackError", "hardware stack error", "cuda_error"),
    ("cudaErrorLaunchTimeout", "the launch timed out and was terminated", "cuda_error"),
    ("cudaErrorContextIsDestroyed", "context is destroyed", "cuda_error"),
    ("cudaErrorECCUncorrectable", "uncorrectable ECC error encountered", "gpu_hardware"),
    ("cudaErrorNvlinkUncorrectable", "uncorrectable NVLink error", "gpu_hardware"),
    ("cudaErrorDevicesUnavailable", "is/are busy or unavailable", "gpu_hardware"),
    ("cudaErrorNoDevice", "no CUDA-capable device is detected", "gpu_hardware"),
    ("cudaErrorUnknown", "CUDA error: unknown error", "gpu_hardware"),  # what an Xid leaves behind
    ("cudaErrorMemoryAllocation", "CUDA out of memory", "cuda_oom"),
)
_BY_NAME = {name: (text, kind) for name, text, kind in ERRORS}
_NAMED = re.compile(r"`(cudaError\w+)'")
_OOM_TYPES = ("OutOfMemoryError",)  # torch.OutOfMemoryError (torch.cuda.OutOfMemoryError)


def classify(type_name: str, message: str) -> CudaFault | None:
    """The CUDA fault an exception of type ``type_name`` saying ``message`` is, or None when it
    is not one that matters here (any other CUDA error is the user's code: an exception)."""
    named = _NAMED.search(message)
    if named and named.group(1) in _BY_NAME:
        text, kind = _BY_NAME[named.group(1)]
        return CudaFault(kind, named.group(1), text.removeprefix("CUDA error: "))
    if type_name in _OOM_TYPES:
        return CudaFault("cuda_oom", "cudaErrorMemoryAllocation", "CUDA out of memory")
    for name, text, kind in ERRORS:
        if text in message:
            return CudaFault(kind, name, text.removeprefix("CUDA error: "))
    return None


def of_exception(exc: BaseException) -> CudaFault | None:
    """``classify`` for an exception and the exceptions it was raised from."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        found = classify(type(exc).__name__, str(exc))
        if found is not None:
            return found
        exc = exc.__cause__ or exc.__context__
    return None
