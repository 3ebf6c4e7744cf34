"""A user training script for session tests: the bundled GPT workload, plus activation-like
memory that grows with the micro-batch (64 MiB per sample), a 1.5 GiB cliff from micro-batch 8 on
(like a kernel that picks a large workspace: no linear memory model foresees it, so the run
really goes out of memory), and a crash at micro-batch 3.

It reads its micro-batch from --per_device_train_batch_size, which mlautotune sets through
arg_mappings, so this also checks that the mapping reaches the script.
"""

import runpy
import sys
from pathlib import Path

import torch

import mlautotune

args = sys.argv[1:]
mbs = int(args[args.index("--per_device_train_batch_size") + 1])
if mbs == 3:
    raise RuntimeError("simulated crash: this script cannot run micro-batch 3")
ballast = torch.ones(mbs * 16 * 2**20 + (384 * 2**20 if mbs >= 8 else 0))  # touched, so it counts in the RSS
workload = Path(mlautotune.__file__).parent / "workloads" / "gpt.py"
sys.argv = [str(workload), *args]
runpy.run_path(str(workload), run_name="__main__")
