"""Several workers on one session, against the real servers of scripts/services.sh (PostgreSQL for the
Optuna study and MLflow's store, `mlflow server` with served artifacts), each worker a real
`python -m mlautotune worker` launching real DeepSpeed experiments (1 CPU rank each)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
import psutil
import pytest
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from conftest import MAPPINGS, TINY_MODEL, holds_file_under
from test_bad_inputs import error_lines, run_cli

ROOT = Path(__file__).resolve().parents[1]
SESSION = "two-workers"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def services():
    """PostgreSQL and mlflow server started by scripts/services.sh in a folder the postgres user can
    reach (pytest's tmp folders are private to root), stopped and removed afterwards. A machine that
    cannot start them fails the test: this is what CI must be able to run."""
    folder = tempfile.mkdtemp(dir="/tmp", prefix="mlautotune-services-")
    os.chmod(folder, 0o755)
    env = {**os.environ, "PG_PORT": str(free_port()), "MLFLOW_PORT": str(free_port()), "PYTHON": sys.executable}
    script = str(ROOT / "scripts" / "services.sh")
    try:
        started = subprocess.run(["bash", script, "start", folder], env=env, capture_output=True, text=True, timeout=600)
        if started.returncode != 0:
            pytest.fail(f"scripts/services.sh could not start PostgreSQL and the MLflow server (exit {started.returncode}):\n{started.stdout}\n{started.stderr}")
        exports = {}
        for line in Path(folder, "env.sh").read_text().splitlines():
            if line.startswith("export "):
                key, _, value = line[len("export "):].partition("=")
                exports[key] = value
        yield exports
    finally:
        subprocess.run(["bash", script, "stop", folder], env=env, capture_output=True, timeout=120)
        shutil.rmtree(folder, ignore_errors=True)


def write_config(path: Path) -> Path:
    at = {"enabled": True, "start_profile_step": 2, "end_profile_step": 3, "arg_mappings": MAPPINGS, "tuner_type": "gridsearch", "tuner_num_trials": 5}
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": [1, 2, 4, 8],
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": [0, 1]},
        "autotuning": at,
    }))
    return path


def start(command: str, folder: Path, services, log: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "mlautotune", command, f"config={folder / 'ds.json'}", f"script_args={' '.join(TINY_MODEL)}",
            "launcher.num_gpus=1", f"search.session={SESSION}", f"search.storage={services['MLAUTOTUNE_STORAGE']}",
            "search.heartbeat_seconds=2", "measure.budget_s=1"]
    env = {**os.environ, "MLFLOW_TRACKING_URI": services["MLFLOW_TRACKING_URI"]}
    with open(folder / log, "w") as out:
        return subprocess.Popen(argv, cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT)


def trials_of(study: optuna.Study, pid: int):
    return [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("worker", "").endswith(f":{pid}")]


def ranks_in(exp_dir: Path):
    """The experiment's running ranks: new interpreters by their command line; forks of launch.py
    (runner_process, on CPU) by the experiment's logs open in them and in their launcher's runner."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmdline = p.info["cmdline"] or []
            if (any(str(exp_dir) in a for a in cmdline) and any(a.startswith("--local_rank") for a in cmdline)) or (
                    holds_file_under(p, str(exp_dir)) and p.parent() is not None and holds_file_under(p.parent().parent(), str(exp_dir))):
                found.append(p)
        except psutil.Error:
            pass
    return found


@pytest.mark.e2e
def test_workers_share_one_session_and_a_killed_workers_experiment_is_run_again(services, tmp_path, leftovers):
    """Workers 1 and 2 start together; worker 2 is SIGKILLed in the middle of its second experiment
    and worker 3 joins (a restarted node). The killed experiment is run again by another worker once
    its heartbeat is 8 s old, nothing of worker 2 survives, and the session ends with one parent run,
    each experiment recorded once, and the report written once."""
    write_config(tmp_path / "ds.json")
    workers = [start("worker", tmp_path, services, "w1.log"), start("worker", tmp_path, services, "w2.log")]
    victim = workers[1]
    try:
        study = None
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and victim.poll() is None:
            try:
                study = study or optuna.load_study(study_name=SESSION, storage=services["MLAUTOTUNE_STORAGE"])
            except KeyError:
                time.sleep(1)
                continue
            mine = trials_of(study, victim.pid)
            running = [t for t in mine if t.state == TrialState.RUNNING]
            if len(mine) >= 2 and running and ranks_in(tmp_path / "autotuning_results" / running[0].user_attrs["name"]):
                break
            time.sleep(0.5)
        assert victim.poll() is None and study is not None, f"worker 2 never ran a second experiment:\n{(tmp_path / 'w2.log').read_text()[-3000:]}"
        killed = running[0]
        exp_dir = tmp_path / "autotuning_results" / killed.user_attrs["name"]
        port = json.loads((exp_dir / "exp.json").read_text())["master_port"]
        its_processes = psutil.Process(victim.pid).children(recursive=True)
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        workers.append(start("worker", tmp_path, services, "w3.log"))
        for w in (workers[0], workers[2]):
            assert w.wait(timeout=900) == 0, (tmp_path / f"w{workers.index(w) + 1}.log").read_text()[-3000:]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
    logs = {n: (tmp_path / f"w{n}.log").read_text() for n in (1, 3)}

    # Nothing of the killed worker survives: its launcher and ranks (the lifeline ends them), their shared memory.
    assert [p for p in its_processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
    assert leftovers(str(exp_dir)) == []
    assert sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*")) == []

    # Its trial was failed after the heartbeat grace and its configuration run again by another worker.
    trials = study.get_trials(deepcopy=False)
    assert trials[killed.number].state == TrialState.FAIL and "result" not in trials[killed.number].user_attrs
    again = [t for t in trials if t.number > killed.number and t.params == killed.params and "result" in t.user_attrs]
    assert len(again) == 1 and not again[0].user_attrs["worker"].endswith(f":{victim.pid}")
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    done = [t for t in trials if "result" in t.user_attrs and "duplicate_of" not in t.user_attrs]
    assert {t.user_attrs["worker"] for t in done} >= {f"{socket.gethostname()}:{w.pid}" for w in workers[:2]}  # both measured something
    assert len(done) <= 5  # tuner_num_trials is the session's budget, not each worker's

    # MLflow: one parent run, one child per measured experiment, no configuration twice, the report on the parent.
    client = MlflowClient(services["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()], max_results=1000)
    parents = [r for r in runs if r.data.tags.get("mlautotune.role") == "session"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert sorted(r.info.run_name for r in children) == sorted(t.user_attrs["name"] for t in done)
    assert all(r.info.status in ("FINISHED", "FAILED") for r in children)
    configs = [tuple(sorted(r.data.params.items())) for r in children]
    assert len(set(configs)) == len(configs)
    assert {"summary.txt", "ds_config_optimal.json", "cmd_optimal.txt", "trials.csv", "plots"} <= {a.path for a in client.list_artifacts(parents[0].info.run_id)}
    assert parents[0].data.metrics["num_experiments"] == len(done)
    page = f"{services['MLFLOW_TRACKING_URI']}/#/experiments/{parents[0].info.experiment_id}/runs/{parents[0].info.run_id}?workflowType=machine_learning"
    assert all(f"in the MLflow UI: {page}" in text for text in logs.values()), "each worker names the parent run's page"

    # The report was written once, by the worker that finished last; the other left it to that one.
    assert sum("writing the session's report" in text for text in logs.values()) == 1
    assert sum("another worker writes the report" in text for text in logs.values()) == 1
    assert (tmp_path / "autotuning_results" / "summary.txt").is_file()

    # `mlautotune report` writes it again at any time, into the same parent run.
    summary = (tmp_path / "autotuning_results" / "summary.txt").read_text()
    (tmp_path / "autotuning_results" / "summary.txt").unlink()
    report = start("report", tmp_path, services, "report.log")
    assert report.wait(timeout=300) == 0, (tmp_path / "report.log").read_text()[-3000:]
    assert (tmp_path / "autotuning_results" / "summary.txt").read_text().split("Tuning completed")[0] == summary.split("Tuning completed")[0]
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()], max_results=1000)
    assert len([r for r in runs if r.data.tags.get("mlautotune.role") == "session"]) == 1


def test_a_worker_with_another_world_size_is_refused(tmp_path):
    """Throughput at another world size is not comparable: a worker with 1 rank cannot join a session tuned with 2."""
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    optuna.create_study(storage=storage, study_name="ws", direction="maximize").set_user_attr("world_size", 2)
    write_config(tmp_path / "ds.json")
    code, _, err = run_cli(tmp_path, ["worker", f"config={tmp_path / 'ds.json'}", "launcher.num_gpus=1", "search.session=ws",
                                      f"search.storage={storage}", "tracking.enabled=false"])
    assert code == 2, err
    assert len(error_lines(err)) == 1 and "is tuned with 2 ranks per experiment" in error_lines(err)[0]
    assert [t for t in optuna.load_study(study_name="ws", storage=storage).trials] == []


def test_workers_on_other_devices_join_the_same_session():
    """A worker's session is named by what is measured, its world size included, not by which devices or hosts it uses."""
    from hydra import compose, initialize_config_dir

    from mlautotune.cli import CONF_DIR
    from mlautotune.inputs.config import register_configs
    from mlautotune.session import identity

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        first = compose(config_name="config", overrides=["launcher.include='localhost:0,1'"])
        second = compose(config_name="config", overrides=["launcher.include='localhost:2,3'"])
    name = lambda cfg, **kw: identity(cfg, {"zero_optimization": {"stage": 1}}, Path("train.py"), ["--epochs", "1"], **kw)
    assert name(first, world_size=2) == name(second, world_size=2)
    assert name(first, world_size=2) != name(first, world_size=4)
    assert name(first) != name(second)  # a lone `tune` session still keeps its launcher in its identity
