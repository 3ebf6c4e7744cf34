"""A user training script that does its own MLflow logging and takes a secret token.

It logs `user_metric` with plain `mlflow.log_metric` (rank 0), prints its arguments and its
MLFLOW_* environment the way DeepSpeed's multi-node runner prints the command it exports, and then
trains the bundled GPT workload. Session tests check that the metric lands in the experiment's
child run and that the printed secrets are masked in every uploaded log. With `--hold_until FILE` it
waits for FILE before training (a test's gate: the session is surely still running meanwhile).
"""

import os
import runpy
import sys
import time
from pathlib import Path

import mlflow

import mlautotune

args = sys.argv[1:]
print(f"user script argv: {args}", flush=True)
exports = "; ".join(f"export {k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MLFLOW_"))
print(f"cmd = {exports}; python {sys.argv[0]}", flush=True)
if "--hf_token" in args:
    i = args.index("--hf_token")
    args = args[:i] + args[i + 2 :]
if "--hold_until" in args:  # a test holds the session here until it has done what it must while the session runs
    i = args.index("--hold_until")
    gate, args = Path(args[i + 1]), args[:i] + args[i + 2 :]
    deadline = time.monotonic() + 300
    while not gate.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
if os.environ.get("RANK", "0") == "0":
    mlflow.log_metric("user_metric", 42.0)
    mlflow.end_run()
workload = Path(mlautotune.__file__).parent / "workloads" / "gpt.py"
sys.argv = [str(workload), *args]
runpy.run_path(str(workload), run_name="__main__")
