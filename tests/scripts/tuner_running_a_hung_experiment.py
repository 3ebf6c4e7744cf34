"""A stand-in tuner process: runs one experiment that hangs, so a test can signal this process mid-experiment.

Usage: python tuner_running_a_hung_experiment.py <results_dir> <marker>
"""

import sys
from pathlib import Path

from mlautotune.run.experiment import Experiment, Resources, run_experiment

results_dir, marker = sys.argv[1], sys.argv[2]
script = Path(__file__).with_name("sleep_forever.py")
exp = Experiment(name="hung", ds_config={"train_micro_batch_size_per_gpu": 1}, script=str(script),
                 script_args=["--marker", marker], resources=Resources(num_gpus=2), params={}, timeout_s=300)
run_experiment(exp, Path(results_dir))
