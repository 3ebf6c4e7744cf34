"""What a failed experiment's own output says it was, for the accelerator failures that no exit code names.

The probe turns an out-of-memory exception it sees (torch.OutOfMemoryError) into its own exit code,
and the tuner's clock names a timeout. Some failures reach neither: CUDA and NCCL errors raised as a
plain RuntimeError from a kernel launch or a collective, in a thread the probe does not run, or
NCCL's watchdog, which aborts the rank (SIGABRT) after a collective hung. Their rank exits like any
other failure, so only the runtime's own message tells them apart: fixed texts printed by CUDA, cuBLAS,
NCCL and torch's allocator, matched here, never a search for the word "error".

- out of memory -> `oom`: the configuration needs more device memory than the rank has; a smaller
  micro-batch or a higher ZeRO stage can fit, and the memory model learns the edge from it. NCCL
  reports an allocation failure of its own buffers as an unhandled CUDA error whose last error is
  'out of memory': the same edge.
- a collective that ran past NCCL's timeout -> `timeout`: no result in the time allowed, as when the
  tuner's clock runs out (the ranks waited on each other); the same error in two stages is then not
  taken for a broken script.
- anything else -> `failed`, with its last lines: an illegal memory access, a launch failure, an
  NCCL system, internal or remote error are faults of a kernel, the script or the machine, which no
  smaller configuration reliably mends.
An out-of-memory sign wins over a timeout: a rank that ran out of memory leaves the others waiting
in their next collective, so both can be printed, and the OOM is the cause.
"""

from pathlib import Path
from typing import Iterable, Optional

TAIL_BYTES = 1 << 16  # the end of stderr.log that is read: the failing rank's traceback and the launcher's lines after it

OOM_SIGNS = (
    "torch.OutOfMemoryError",  # torch's caching allocator (also torch.cuda.OutOfMemoryError)
    "CUDA out of memory",  # its message: "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has ..."
    "CUDA error: out of memory",  # cudaErrorMemoryAllocation from a kernel launch or the CUDA runtime
    "CUBLAS_STATUS_ALLOC_FAILED",  # cuBLAS could not allocate its workspace
    "Cuda failure 'out of memory'",  # NCCL: ncclUnhandledCudaError ... Last error: Cuda failure 'out of memory'
    "Cuda failure 2 'out of memory'",  # the same in older NCCL versions, with the CUDA error number
    "HIP out of memory",  # torch's allocator on ROCm
)
TIMEOUT_SIGNS = (
    "Watchdog caught collective operation timeout",  # ProcessGroupNCCL: WorkNCCL(...) ran for N milliseconds before timing out
)


def kind_of(texts: Iterable[str]) -> Optional[str]:
    """"oom", "timeout", or None (an ordinary failure) for what the ranks and their stderr said."""
    text = "\n".join(t for t in texts if t)
    if any(sign in text for sign in OOM_SIGNS):
        return "oom"
    if any(sign in text for sign in TIMEOUT_SIGNS):
        return "timeout"
    return None


def stderr_end(path: Path) -> str:
    """The last TAIL_BYTES of a log ("" if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - TAIL_BYTES))
            return f.read().decode(errors="replace")
    except OSError:
        return ""
