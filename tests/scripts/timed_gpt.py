"""A user training script with controlled step times: the bundled GPT workload, plus a sleep in every
optimizer step of --sleep seconds and a random extra of up to --jitter seconds (seeded per rank).

With a sleep much longer than the tiny model's compute the step time is quiet whatever else runs on
the machine; with a large jitter it is noisy. Usage: timed_gpt.py --sleep 0.05 --jitter 0 <gpt.py args>.
"""

import random
import runpy
import sys
import time
from pathlib import Path

from deepspeed.runtime.engine import DeepSpeedEngine

import mlautotune

args = sys.argv[1:]


def take(flag: str) -> float:
    i = args.index(flag)
    value = float(args[i + 1])
    del args[i:i + 2]
    return value


sleep, jitter = take("--sleep"), take("--jitter")
rng = random.Random()
backward = DeepSpeedEngine.backward


def timed_backward(engine, *a, **kw):
    time.sleep(sleep + rng.uniform(0.0, jitter))
    return backward(engine, *a, **kw)


DeepSpeedEngine.backward = timed_backward
workload = Path(mlautotune.__file__).parent / "workloads" / "gpt.py"
sys.argv = [str(workload), *args]
runpy.run_path(str(workload), run_name="__main__")
