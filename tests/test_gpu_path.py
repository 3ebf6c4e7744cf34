"""What a CPU machine can check of the GPU path: how CUDA and NCCL failures in an experiment's output
are classified (texts in the formats torch, CUDA and NCCL print them, tests/data/gpu_failures), and that
a rank on a GPU reads its device memory, not its RSS. The runner's fresh-process path on a GPU is in
test_runner_process.py; the GPU run itself is benchmarks/gpu_check.py."""

import json
from pathlib import Path

import pytest

from mlautotune.run import probe
from mlautotune.run.experiment import classify

RECORDED = Path(__file__).parent / "data" / "gpu_failures"


def failed_experiment(tmp_path, log: str, error: str = "") -> Path:
    """An experiment folder as a failed launch leaves it: stderr.log, and rank 0's record when the probe saw the exception."""
    (tmp_path / "stderr.log").write_text((RECORDED / log).read_text() if log else "")
    if error:
        (tmp_path / "rank0.json").write_text(json.dumps({"rank": 0, "status": "failed", "error": error, "peak_memory_bytes": 0}))
    return tmp_path


@pytest.mark.parametrize("log, returncode, expected", [
    ("cuda_oom.log", 1, "oom"),  # torch's allocator, in a rank whose record was never written
    ("cuda_error_oom.log", 1, "oom"),  # cudaErrorMemoryAllocation raised as a plain RuntimeError
    ("nccl_unhandled_cuda_oom.log", 1, "oom"),  # NCCL could not allocate its buffers
    ("oom_then_nccl_timeout.log", -6, "oom"),  # rank 0 ran out of memory, rank 1 waited for it: the OOM is the cause
    ("nccl_watchdog_timeout.log", -6, "timeout"),  # a collective hung; NCCL's watchdog aborted the rank
    ("cuda_illegal_memory_access.log", -6, "failed"),  # a kernel's fault, not a capacity limit
    ("nccl_unhandled_cuda_error.log", 1, "failed"),
    ("nccl_remote_error.log", 1, "failed"),
])
def test_cuda_and_nccl_failures_in_stderr_are_classified(tmp_path, log, returncode, expected):
    status, reason, metrics = classify(returncode, False, failed_experiment(tmp_path, log), 900.0)
    assert status == expected
    assert f"exit code {returncode}" in reason and metrics == {}


def test_an_out_of_memory_error_the_probe_recorded_as_a_plain_failure_is_an_oom(tmp_path):
    """A RuntimeError (not torch.OutOfMemoryError) the probe caught: its record's error names it."""
    error = "RuntimeError: CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API call"
    status, reason, _ = classify(1, False, failed_experiment(tmp_path, "", error), 900.0)
    assert status == "oom" and reason.startswith("rank 0: RuntimeError: CUDA error: out of memory")


def test_an_ordinary_failure_stays_failed(tmp_path):
    status, _, _ = classify(1, False, failed_experiment(tmp_path, "", "ValueError: memory_size must be positive"), 900.0)
    assert status == "failed"


def test_the_tuners_own_timeout_and_the_probes_oom_exit_come_first(tmp_path):
    exp_dir = failed_experiment(tmp_path, "nccl_watchdog_timeout.log")
    assert classify(None, True, exp_dir, 60.0)[0] == "timeout"
    assert classify(probe.OOM_EXIT_CODE, False, failed_experiment(tmp_path, "cuda_illegal_memory_access.log"), 60.0)[0] == "oom"


def test_a_gpu_rank_reads_the_device_memory_not_its_rss():
    """DeepSpeed's real CUDA accelerator, on a machine where CUDA was never initialised: torch reports no
    device memory allocated, while the same process's RSS is hundreds of MB (torch is imported)."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    rss = probe.peak_memory_bytes(CPU_Accelerator())
    assert rss > 50 * 2**20
    assert probe.peak_memory_bytes(CUDA_Accelerator()) == 0


def test_the_memory_limit_caps_the_allocator_on_cuda_only():
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    assert probe.limit_device_memory(CPU_Accelerator(), 2**30, 0) is None  # on CPU the probe checks the RSS instead
