"""Shared fixtures: a tiny CPU experiment through the real DeepSpeed launcher, and a leftover-process check."""
import json
import os
from pathlib import Path

import psutil
import pytest

from mlautotune.run.experiment import Experiment, Resources
from mlautotune.workloads import GPT_SCRIPT

TINY_MODEL = ["--num_layers", "1", "--hidden_size", "32", "--num_heads", "2", "--seq_len", "32", "--vocab_size", "256"]
MAPPINGS = {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size", "gradient_accumulation_steps": "--gradient_accumulation_steps"}


@pytest.fixture
def tiny_experiment():
    """A factory: a 2-rank CPU experiment of the bundled workload with a tiny model (override any field)."""

    def make(name="z0_gas1_tmbspg2", stage=0, mbs=2, gas=1, script=GPT_SCRIPT, script_args=None, **fields):
        ds_config = {"train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": gas, "steps_per_print": 1000,
                     "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage}}
        fields.setdefault("timeout_s", 180.0)
        return Experiment(name=name, ds_config=ds_config, script=str(script),
                          script_args=list(TINY_MODEL if script_args is None else script_args),
                          resources=Resources(num_gpus=2), params={"stage": stage, "micro_batch": mbs, "gas": gas},
                          arg_mappings=dict(MAPPINGS), **fields)

    return make


def holds_file_under(p, folder: str) -> bool:
    """Whether process p has a file under `folder` open (a rank forked by runner_process has the
    server's command line, and the experiment's logs as its output)."""
    return p is not None and any(f.path.startswith(folder) for f in p.open_files())


@pytest.fixture
def leftovers():
    """A function: what is left of an experiment (`text` is its folder, or any command-line text): the
    live (non-zombie) processes whose command line mentions `text` or that have a file under it open
    (a rank forked by runner_process has the server's command line, and the experiment's logs as its
    output), and, for every experiment folder under `text`, the shared-memory buffers DeepSpeed's CPU
    all-reduce created on its master port."""

    def find(text: str) -> list:
        found = []
        for p in psutil.process_iter(["cmdline", "status"]):
            try:
                if p.info["status"] != psutil.STATUS_ZOMBIE and (any(text in part for part in (p.info["cmdline"] or []))
                                                                 or holds_file_under(p, text)):
                    found.append(p)
            except psutil.Error:
                pass
        root = Path(text)
        for exp_json in ([root / "exp.json"] if (root / "exp.json").is_file() else root.glob("**/exp.json")) if root.is_dir() else []:
            port = json.loads(exp_json.read_text())["master_port"]
            found += sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))
        return found

    return find


# What a session or an MLflow server writes into its working folder when it is given no other place.
WORKING_TREE_OUTPUTS = ("mlflow.db", "mlruns", "mlartifacts", "autotuning_results", "autotuning_exps", "outputs", "multirun")


@pytest.fixture(autouse=True, scope="session")
def nothing_written_into_the_checkout():
    """Every test writes in its own temporary folder: a session, `mlflow ui` or `mlflow server` started
    with the checkout as its working folder leaves MLflow's store or artifacts there (and a later
    `git add -A` commits them)."""
    root = Path(__file__).resolve().parents[1]
    before = {name for name in WORKING_TREE_OUTPUTS if (root / name).exists()}
    yield
    new = sorted(name for name in WORKING_TREE_OUTPUTS if (root / name).exists() and name not in before)
    assert not new, f"the tests wrote {new} into the checkout {root}; give the command a working folder under its tmp_path"
