"""One session, every view: the console, summary.txt, trials.csv, session.json, the MLflow parent and the
child its tag points at, and the Optuna study give the same optimum, the median of the winner's
measurements; disturbed measurements are said everywhere. A real `mlflow run` of the MLproject (CPU,
2 ranks), read back with MlflowClient and Optuna's API."""

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient

from conftest import MAPPINGS, TINY_MODEL

ROOT = Path(__file__).resolve().parents[1]
HEAVY = Path(__file__).parent / "scripts" / "heavy_gpt.py"
pytestmark = pytest.mark.e2e


def test_every_view_of_a_disturbed_re_measured_session_gives_one_optimum(tmp_path):
    """measure.max_cpu_wait=0: any wait for a CPU disturbs a window, so the first measurements are
    disturbed and the search measures the leader again. The results folder held another session's
    files: they are archived and the session starts (no refusal, no exit 2)."""
    results = tmp_path / "results"
    results.mkdir()
    (results / "session.json").write_text(json.dumps({"session": "older-session"}))
    (results / "summary.txt").write_text("the older session's summary\n")
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": [4, 5], "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                              "zero_optimization": {"stage": 0},
                              "autotuning": {"enabled": True, "start_profile_step": 2, "end_profile_step": 3, "arg_mappings": MAPPINGS,
                                             "tuner_type": "model_based", "tuner_num_trials": 3, "memory_limit_per_rank": "4GiB"}}))
    # `mlflow run` starts the entry point in the project's folder, the checkout: every output folder goes under tmp_path
    # near-tied sizes: the third is a re-measurement
    overrides = f"autotuning.tuner_num_trials=3 search.stop_probability=0.001 measure.budget_s=1 measure.max_cpu_wait=0.0 autotuning.exps_dir={tmp_path / 'exps'}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
           "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    argv = [sys.executable, "-m", "mlflow", "run", str(ROOT), "--env-manager", "local", "--experiment-name", "views",
            "-P", f"config={ds}", "-P", f"script={HEAVY}", "-P", f"script_args={' '.join(TINY_MODEL)}", "-P", "num_gpus=2",
            "-P", f"results_dir={results}", "-P", f"overrides={overrides}"]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out

    # the console and the summary
    assert re.search(r"\] z0_gas1_tmbspg\d+ ok +[\d.,]+ samples/s DISTURBED \(the training threads waited for a CPU", out), out
    summary = (results / "summary.txt").read_text()
    name, value = re.search(r"Optimum: (\S+)  throughput=([\d.]+) ", summary).groups()
    value = float(value)
    assert re.search(r"\d+ of \d+ measurements \(\d+%\) were disturbed", summary), summary
    assert f"Optimum: {name}  throughput={value:g}" in out  # the console prints the summary
    assert (results / "previous_sessions" / "older-session" / "summary.txt").read_text() == "the older session's summary\n"

    # the files
    rows = {r["experiment"]: r for r in csv.DictReader((results / "trials.csv").open())}
    assert float(rows[name]["throughput"]) == pytest.approx(value, rel=1e-5)
    record = json.loads((results / "session.json").read_text())
    assert record["metrics"]["best_throughput"] == pytest.approx(value, rel=1e-5)

    # MLflow: the parent is the run `mlflow run` made; its tag's child run, and the re-measurement nested under it
    c = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = c.search_runs([c.get_experiment_by_name("views").experiment_id], max_results=100)
    parent = next(r for r in runs if r.data.tags.get("mlautotune.role") == "session")
    assert parent.data.metrics["best_throughput"] == pytest.approx(value, rel=1e-5)
    assert c.get_metric_history(parent.info.run_id, "best_throughput")[-1].value == pytest.approx(value, rel=1e-5)
    assert parent.data.tags["best_experiment"] == name and re.match(r"\d+ of \d+ measurements: ", parent.data.tags["disturbed"])
    assert parent.data.tags["search"] in ("finished", "stopped_by_budget") and parent.data.metrics["num_disturbed"] >= 1
    assert parent.data.params["launcher.num_gpus"] == parent.data.params["num_gpus"] == "2"  # the CLI's names, under mlflow run too
    best = c.get_run(parent.data.tags["best_run_id"])
    assert best.data.tags["experiment"] == name and best.data.metrics["throughput"] == pytest.approx(value, rel=1e-5)
    repeats = [r for r in runs if r.data.tags.get("mlautotune.repeat_of") is not None]
    assert repeats and all(c.get_run(r.data.tags["mlflow.parentRunId"]).data.tags["mlautotune.role"] == "experiment" for r in repeats)

    # Optuna: the objective's name, the experiments' names, re-measurements marked, the session's optimum
    study = optuna.load_study(study_name=record["session"], storage=f"sqlite:///{results / 'optuna.db'}")
    assert study.metric_names == ["throughput"]
    done_trials = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert all(t.user_attrs["name"].startswith("z0_gas1_tmbspg") for t in done_trials)
    assert any(t.user_attrs.get("remeasurement_of") for t in done_trials)
    assert study.user_attrs["optimum"]["experiment"] == name and study.user_attrs["optimum"]["throughput"] == pytest.approx(value, rel=1e-5)
    importances = optuna.importance.get_param_importances(study)
    assert importances.get("gas", 0.0) == 0.0 and importances.get("stage", 0.0) == 0.0  # one value each: not searched
