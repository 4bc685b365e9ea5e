"""Which failures belong to the process and which to a request.

A stage keeps serving through errors that concern the requests it was running (bad values
that slipped validation, non-finite outputs, a processing error): those requests end with an
error. Faults of the process itself leave its device or memory in a state nothing in the
process can vouch for — out of memory, a CUDA error (which poisons the context) — and end the
process; the server then restarts the stage.
"""

from __future__ import annotations

from omnistage.memory import ArenaError

_DEVICE_FAULT_MARKERS = ("CUDA", "cuda", "CUBLAS", "cuDNN", "NCCL", "out of memory")


def is_process_fault(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError | ArenaError | SystemExit | KeyboardInterrupt):
        return True
    if type(exc).__name__ in ("OutOfMemoryError", "AcceleratorError"):  # torch's CUDA errors
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _DEVICE_FAULT_MARKERS)
