"""The training scripts of benchmarks/gpu_check.py, run by the probe in each rank like any user script.

    gpu_check_rank.py --hang           initialise the accelerator, then hang (the experiment must end as `timeout`)
    gpu_check_rank.py <gpt.py flags>   the bundled GPT, with an independent reading of the device's peak memory

The reading: a thread writes torch.cuda.max_memory_allocated() of this rank's device to
$GPU_CHECK_PEAK_DIR/peak<LOCAL_RANK>.json every 50 ms (the probe ends the rank after its window, so
the script never reaches an end of its own). Nothing of it is the probe's code: the check compares it
with the probe's peak_memory_bytes. On CPU nothing is written.
"""

import json
import os
import sys
import threading
import time


def watch_peak(folder: str, device: int) -> None:
    import torch

    path = os.path.join(folder, f"peak{device}.json")
    while True:
        if torch.cuda.is_initialized():
            with open(path + ".tmp", "w") as f:
                json.dump({"max_memory_allocated": torch.cuda.max_memory_allocated(device), "time": time.time()}, f)
            os.replace(path + ".tmp", path)
        time.sleep(0.05)


def hang() -> None:
    import torch

    if torch.cuda.is_available():
        torch.zeros(1, device=f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")  # a CUDA context that the kill must end too
    time.sleep(3600)


if __name__ == "__main__":
    if "--hang" in sys.argv:
        hang()
    import torch

    if torch.cuda.is_available() and os.environ.get("GPU_CHECK_PEAK_DIR"):
        threading.Thread(target=watch_peak, args=(os.environ["GPU_CHECK_PEAK_DIR"], int(os.environ.get("LOCAL_RANK", 0))), daemon=True).start()
    from mlautotune.workloads import gpt

    gpt.main()
