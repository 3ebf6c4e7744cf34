"""Whole tuning sessions through the command line: real DeepSpeed launches (CPU, 2 ranks), a real
Optuna study, and a real MLflow store read back with MlflowClient."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

from conftest import MAPPINGS, TINY_MODEL

ROOT = Path(__file__).resolve().parents[1]
HEAVY = Path(__file__).parent / "scripts" / "heavy_gpt.py"
USER_LOGGING = Path(__file__).parent / "scripts" / "user_mlflow_logging.py"
TIMED = Path(__file__).parent / "scripts" / "timed_gpt.py"  # a sleep in every step: a quiet step time
pytestmark = pytest.mark.e2e
QUICK = ["measure.budget_s=1"]  # these sessions test the session, not the measurement (tests/test_measure.py does): a short window


def write_config(path: Path, mbs, stages, **autotuning) -> Path:
    at = {"enabled": True, "start_profile_step": 2, "end_profile_step": 3, "arg_mappings": MAPPINGS, "tuner_type": "gridsearch", **autotuning}
    cfg = {
        "train_micro_batch_size_per_gpu": mbs,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},  # no JIT-compiled op
        "zero_optimization": {"stage": stages},
        "autotuning": at,
    }
    path.write_text(json.dumps(cfg, indent=1))
    return path


def cli(tmp_path: Path, *args: str, script=HEAVY, extra_env=None, **popen):
    # PYTHONFAULTHANDLER: a session that hangs is sent SIGABRT by wait_for and prints every thread's stack
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "PYTHONFAULTHANDLER": "1", **(extra_env or {})}
    argv = [sys.executable, "-m", "mlautotune", *args]
    if script is not None:
        argv += [f"script={script}", f"script_args={' '.join(TINY_MODEL)}", "launcher.num_gpus=2", *QUICK]
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)
    # read as it comes, as a terminal would: a session waited on with its pipe unread blocks once the pipe is full
    proc.lines = []
    proc.reader = threading.Thread(target=lambda: proc.lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    proc.reader.start()
    return proc


def output(proc) -> str:
    """Everything the session printed; once it has ended, to its last line."""
    if proc.poll() is not None:
        proc.reader.join(timeout=30)
    return "".join(proc.lines)


def finish(proc, timeout=600):
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the session did not end in {timeout} s\n{hang_report(proc)}") from None
    return proc.returncode, output(proc)


def client(tmp_path) -> MlflowClient:
    return MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")


def runs(tmp_path, role=None):
    c = client(tmp_path)
    found = c.search_runs([e.experiment_id for e in c.search_experiments()], max_results=1000)
    return [r for r in found if role is None or r.data.tags.get("mlautotune.role") == role]


def test_session_is_tracked_parent_and_children(tmp_path):
    """mbs 1 and 2 run, 3 crashes, 8 goes over the memory limit: ok, ok, failed, oom."""
    config = write_config(tmp_path / "ds.json", [1, 2, 3, 8], 0, memory_limit_per_rank="2GiB", tuner_num_trials=6)
    code, out = finish(cli(tmp_path, f"config={config}"))
    assert code == 0, out
    results = tmp_path / "autotuning_results"

    (parent,) = runs(tmp_path, "session")
    children = [r for r in runs(tmp_path) if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    by_name = {r.data.tags["experiment"]: r for r in children}
    assert set(by_name) == {"z0_gas1_tmbspg1", "z0_gas1_tmbspg2", "z0_gas1_tmbspg3", "z0_gas1_tmbspg8"}
    status = {n: r.data.tags["status"] for n, r in by_name.items()}
    assert status == {"z0_gas1_tmbspg1": "ok", "z0_gas1_tmbspg2": "ok", "z0_gas1_tmbspg3": "failed", "z0_gas1_tmbspg8": "oom"}
    assert "simulated crash" in by_name["z0_gas1_tmbspg3"].data.tags["failure_reason"]
    assert by_name["z0_gas1_tmbspg8"].data.tags["failure_reason"]
    assert by_name["z0_gas1_tmbspg8"].data.metrics["peak_memory_bytes"] > 2 * 2**30

    for name in ("z0_gas1_tmbspg1", "z0_gas1_tmbspg2"):
        r = by_name[name]
        assert {"stage", "micro_batch_size", "gradient_accumulation_steps", "train_batch_size"} <= set(r.data.params)
        m = r.data.metrics
        assert m["throughput"] > 0 and m["FLOPS_per_gpu"] > 0 and m["peak_memory_bytes"] > 0
        tbs = int(r.data.params["train_batch_size"])
        assert m["latency"] == pytest.approx(1000 * tbs / m["throughput"], rel=0.01)
        assert {"step_time_median_ms", "step_time_spread"} <= set(m)
        arts = {a.path for a in client(tmp_path).list_artifacts(r.info.run_id, "experiment")}
        assert {f"experiment/{f}" for f in ("cmd.txt", "ds_config.json", "exp.json", "metrics.json", "stdout.log", "stderr.log")} <= arts

    best_child = max((r for r in children if r.data.tags["status"] == "ok"), key=lambda r: r.data.metrics["throughput"])
    assert parent.data.tags["best_experiment"] == best_child.data.tags["experiment"]
    assert parent.data.metrics["best_throughput"] == pytest.approx(best_child.data.metrics["throughput"])
    assert parent.data.metrics["z0_best_throughput"] == pytest.approx(best_child.data.metrics["throughput"])
    # the MLflow UI lists metrics in the order they were first logged: the best leads, not the last experiment's value
    assert list(parent.data.metrics)[0] == "best_throughput"
    # the best's 95% interval (narrowed by any re-measurement), not the step times' min-max spread
    assert 0 < parent.data.metrics["best_interval_rel"] <= best_child.data.metrics["interval_rel"] + 1e-12
    assert parent.data.metrics["num_oom"] == 1 and parent.data.metrics["num_failed"] == 1 and parent.data.metrics["num_ok"] == 2
    assert parent.info.status == "FINISHED" and parent.data.tags["status"] == "complete"
    assert f"http://127.0.0.1:5000/#/experiments/{parent.info.experiment_id}/runs/{parent.info.run_id}?workflowType=machine_learning" in out
    assert "hardware.accelerator" in parent.data.params and parent.data.params["autotuning.tuner_type"] == "gridsearch"
    parent_arts = {a.path for a in client(tmp_path).list_artifacts(parent.info.run_id)}
    assert {"summary.txt", "ds_config_optimal.json", "cmd_optimal.txt", "trials.csv", "plots"} <= parent_arts

    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    assert optimal["train_micro_batch_size_per_gpu"] == int(best_child.data.params["micro_batch_size"])
    assert optimal["mlautotune"]["status"] == "complete" and "autotuning" not in optimal
    assert optimal["mlautotune"]["interval_rel"] == pytest.approx(parent.data.metrics["best_interval_rel"])
    summary = (results / "summary.txt").read_text()
    assert "| global" in summary and best_child.data.tags["experiment"] in summary
    for png in ("throughput_vs_micro_batch.png", "history.png", "best_so_far.png"):
        assert (results / "plots" / png).stat().st_size > 5000
    assert "best:" in out and "z0_gas1_tmbspg8 oom" in out.replace("  ", " ")


def test_interrupt_then_kill_then_resume(tmp_path, leftovers):
    """SIGINT leaves partial outputs and KILLED runs; SIGKILL leaves no training process; the
    rerun completes, runs no finished experiment twice, and the parent has each experiment once."""
    config = write_config(tmp_path / "ds.json", [1, 2, 4, 6], 0, tuner_num_trials=8)
    launches = tmp_path / "autotuning_results" / "launches.log"
    lines = lambda: launches.read_text().splitlines() if launches.exists() else []

    # Ctrl-C must reach it even when the test runner was started in the background (bash then ignores SIGINT in its children)
    proc = cli(tmp_path, f"config={config}", preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    wait_for(lambda: len(lines()) >= 2, proc)  # the first experiment finished, the second runs
    proc.send_signal(signal.SIGINT)
    deadline = time.time() + 120
    while proc.poll() is None and "interrupted; writing the best so far" not in output(proc) and time.time() < deadline:
        time.sleep(0.05)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # a second Ctrl-C while the partial report is written
    code, out = finish(proc, 120)
    assert code == 130 and "Traceback" not in out, out
    results = tmp_path / "autotuning_results"
    assert (results / "summary.txt").read_text().startswith("PARTIAL")
    assert json.loads((results / "ds_config_optimal.json").read_text())["mlautotune"]["status"] == "partial"
    (parent,) = runs(tmp_path, "session")
    assert parent.info.status == "KILLED"
    assert {r.info.status for r in runs(tmp_path, "experiment")} == {"FINISHED", "KILLED"}

    proc = cli(tmp_path, f"config={config}", start_new_session=True)
    wait_for(lambda: len(lines()) >= 4, proc)  # resumed: the interrupted one again, then one more
    time.sleep(3)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 90  # the ranks' watchdog ends them; on a loaded machine they may still be importing torch
    while leftovers(str(results)) and time.time() < deadline:
        time.sleep(0.5)
    assert leftovers(str(results)) == []

    code, out = finish(cli(tmp_path, f"config={config}"))
    assert code == 0, out
    names = [l.split()[1] for l in lines()]
    finished = [r.data.tags["experiment"] for r in runs(tmp_path, "experiment") if r.data.tags.get("status") != "running"]
    why = f"launches {names}; runs {[(r.data.tags.get('experiment'), r.data.tags.get('status'), r.info.status) for r in runs(tmp_path, 'experiment')]}; output:\n{out}"
    assert sorted(set(names)) == sorted(names_set := set(finished)) == sorted({f"z0_gas1_tmbspg{m}" for m in (1, 2, 4, 6)}), why
    assert len(finished) == len(names_set)  # each experiment once under the parent
    # A launch is repeated only when it was cut short: at most the two interrupted ones.
    assert len(names) - len(set(names)) <= 2
    (parent,) = runs(tmp_path, "session")
    assert parent.info.status == "FINISHED"
    # the resumed parent shows the current best: the declared optimum (the highest posterior mean, not
    # always the luckiest draw) with the value its own run shows
    ok = {r.data.tags["experiment"]: r for r in runs(tmp_path, "experiment") if r.data.tags.get("status") == "ok"}
    declared = ok[parent.data.tags["best_experiment"]]
    assert parent.data.metrics["best_throughput"] == pytest.approx(declared.data.metrics["throughput"])


def test_unreachable_tracking_then_sync(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    config = write_config(tmp_path / "ds.json", [2], 0, tuner_num_trials=2)
    code, out = finish(cli(tmp_path, f"config={config}", f"tracking.tracking_uri=http://127.0.0.1:{dead_port}"))
    assert code == 0, out
    assert "mlautotune sync" in out
    results = tmp_path / "autotuning_results"
    assert json.loads((results / "session.json").read_text())["status"] == "complete"
    assert (results / "ds_config_optimal.json").exists()

    store = f"sqlite:///{tmp_path / 'synced.db'}"
    code, out = finish(cli(tmp_path, "sync", f"autotuning.results_dir={results}", f"tracking.tracking_uri={store}", script=None))
    assert code == 0, out
    c = MlflowClient(store)
    exp = c.get_experiment_by_name("mlautotune")
    found = c.search_runs([exp.experiment_id])
    (parent,) = [r for r in found if r.data.tags.get("mlautotune.role") == "session"]
    children = [r for r in found if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert [r.data.tags["experiment"] for r in children] == ["z0_gas1_tmbspg2"]
    assert children[0].data.metrics["throughput"] > 0
    assert parent.data.metrics["best_throughput"] == pytest.approx(children[0].data.metrics["throughput"])


def test_multirun_gives_one_parent_per_job(tmp_path):
    config = write_config(tmp_path / "ds.json", [2], 0, tuner_num_trials=1)
    code, out = finish(cli(tmp_path, "-m", f"config={config}", "autotuning.tuner_type=gridsearch,random"))
    assert code == 0, out
    parents = runs(tmp_path, "session")
    assert sorted(p.data.params["autotuning.tuner_type"] for p in parents) == ["gridsearch", "random"]
    assert len({p.info.experiment_id for p in parents}) == 1
    assert len({p.data.tags["mlautotune.multirun"] for p in parents}) == 1  # the jobs of one multirun are grouped
    assert client(tmp_path).get_experiment(parents[0].info.experiment_id).name == "mlautotune"


def test_mlflow_run_in_run_mode_trains_with_the_optimum(tmp_path):
    """Tune one configuration under `mlflow run`, then train with it: the final training is a child of
    the run `mlflow run` made, its end-to-end throughput after warm-up on it, and final / tuned on the
    parent. The script sleeps in every step, so the two measure the same work."""
    config = write_config(tmp_path / "ds.json", [2], 0, tuner_num_trials=1)
    # --env-manager local runs the MLproject's `python` from PATH: this environment's.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "PATH": path}
    script_args = " ".join(["--sleep", "0.06", "--jitter", "0", "--steps", "40", *TINY_MODEL])
    argv = [
        sys.executable, "-m", "mlflow", "run", str(ROOT), "--env-manager", "local",
        "-P", f"config={config}", "-P", f"script={TIMED}", "-P", f"script_args={script_args}",
        "-P", "num_gpus=2", "-P", "mode=run", "-P", f"results_dir={tmp_path / 'res'}",
        "-P", f"overrides={' '.join(QUICK)} autotuning.exps_dir={tmp_path / 'exps'}",  # `mlflow run` starts it in the checkout
    ]
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "final / tuned = " in out
    (parent,) = runs(tmp_path, "session")
    assert parent.info.run_id in out  # the run `mlflow run` created is the parent
    assert parent.info.run_name == parent.data.tags["mlautotune.session"]  # renamed after the session
    assert parent.data.params["num_gpus"] == "2" and parent.data.params["launcher.num_gpus"] == "2"  # the CLI's name too, so Compare lines sessions up
    (final,) = runs(tmp_path, "final_training")
    assert final.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert final.data.tags["status"] == "ok" and final.data.metrics["throughput"] > 0
    used = json.loads((tmp_path / "res" / "final_training" / "ds_config.json").read_text())
    assert "autotuning" not in used and "mlautotune" not in used
    assert used["train_micro_batch_size_per_gpu"] == 2

    (tuned,) = [r for r in runs(tmp_path, "experiment") if r.data.tags.get("experiment") == "z0_gas1_tmbspg2"]
    e2e, tuned_tp = final.data.metrics["end_to_end_throughput"], tuned.data.metrics["throughput"]
    assert parent.data.metrics["final_over_tuned"] == pytest.approx(e2e / tuned_tp)
    assert 0.25 < parent.data.metrics["final_over_tuned"] < 4  # the same work (no wall-clock bound: the machine may be shared)
    assert {"interval_rel", "warmup_steps", "measured_steps", "measure_seconds", "disturbed", "threads_per_rank"} <= set(tuned.data.metrics)
    metrics = json.loads((tmp_path / "res" / "final_training" / "metrics.json").read_text())
    assert metrics["end_to_end_steps"] == 40 - metrics["first_measured_step"] + 1  # every step after warm-up, to the script's end


def hang_report(proc) -> str:
    """Where a hung session stands: SIGABRT to it, which with PYTHONFAULTHANDLER prints each of its threads'
    stacks; then its output and the tails of the logs of the experiments it was running (where the
    launcher and the ranks stand)."""
    try:
        below = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        below = []
    logs = {Path(f.path) for p in below for f in _open_files(p) if f.path.endswith(".log")}
    try:
        proc.send_signal(signal.SIGABRT)
    except OSError:
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    time.sleep(2)
    tails = "".join(f"\n--- {log} (last 6000 characters)\n{log.read_text(errors='replace')[-6000:]}" for log in sorted(logs) if log.is_file())
    return f"the session's output:\n{output(proc)}{tails}"


def _open_files(p):
    try:
        return p.open_files()
    except Exception:
        return []


def wait_for(condition, proc, timeout=300):
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, output(proc)
        if time.time() >= deadline:
            raise AssertionError(f"timed out after {timeout} s\n{hang_report(proc)}")
        time.sleep(0.5)


def test_a_session_where_everything_fails_says_why_and_writes_no_optimum(tmp_path):
    config = write_config(tmp_path / "ds.json", [2], 0, tuner_num_trials=2)
    code, out = finish(cli(tmp_path, f"config={config}", script=Path(__file__).parent / "scripts" / "raise_error.py"))
    assert code == 1, out
    assert "no experiment succeeded" in out and "z0_gas1_tmbspg2: failed" in out
    results = tmp_path / "autotuning_results"
    assert not (results / "ds_config_optimal.json").exists() and not (results / "cmd_optimal.txt").exists()
    assert (results / "summary.txt").read_text().startswith("NO RESULT")
    (parent,) = runs(tmp_path, "session")
    assert parent.info.status == "FAILED" and parent.data.tags["status"] == "failed"


SECRETS = ("TRACKPASS77", "TOKEN77xyz", "COMETKEY77")


def test_secrets_user_logging_lock_and_the_mlflow_view(tmp_path):
    """One session against a real `mlflow server` reached with basic-auth credentials in its URI, a
    token in script_args and an API key in the ds_config; the user's script logs to MLflow itself.
    While it runs, a second session on the same folder is refused. Read back through the server's
    REST API (as the UI does) and by downloading every artifact."""
    import urllib.request

    from test_tracking import all_text_of_run, free_port, mlflow_server

    config = write_config(tmp_path / "ds.json", [1, 2], 0, tuner_num_trials=2)
    ds = json.loads(config.read_text())
    ds.update({"comet": {"enabled": False, "api_key": "COMETKEY77"}, "#comment": "kept", "größe": 1})
    config.write_text(json.dumps(ds))
    port = free_port()
    with mlflow_server(tmp_path, port) as server:
        uri = f"http://alice:TRACKPASS77@127.0.0.1:{port}"
        args = [f"config={config}", f"tracking.tracking_uri={uri}", f"script={USER_LOGGING}",
                f"script_args={' '.join(TINY_MODEL)} --hf_token TOKEN77xyz --hold_until {tmp_path / 'go'}", "launcher.num_gpus=2",
                *QUICK]
        first = cli(tmp_path, *args, script=None)
        launches = tmp_path / "autotuning_results" / "launches.log"
        wait_for(lambda: launches.exists() and launches.read_text().strip(), first)
        try:
            code2, out2 = finish(cli(tmp_path, *args, script=None), 120)  # the first session's experiment waits at the gate meanwhile
        finally:
            (tmp_path / "go").touch()
        assert code2 == 2 and f"pid {first.pid} on host {socket.gethostname()}" in out2 and "Traceback" not in out2, out2
        code, out = finish(first)
        assert code == 0, out
        for secret in SECRETS:
            assert secret not in out

        request = urllib.request.Request(f"{server.url}/api/2.0/mlflow/experiments/get-by-name?experiment_name=mlautotune")
        exp_id = json.load(urllib.request.urlopen(request))["experiment"]["experiment_id"]
        body = json.dumps({"experiment_ids": [exp_id], "max_results": 100}).encode()
        found = json.load(urllib.request.urlopen(urllib.request.Request(f"{server.url}/api/2.0/mlflow/runs/search", data=body, headers={"Content-Type": "application/json"})))["runs"]
        tags = lambda r: {t["key"]: t["value"] for t in r["data"].get("tags", [])}
        (parent,) = [r for r in found if tags(r).get("mlautotune.role") == "session"]
        children = [r for r in found if tags(r).get("mlflow.parentRunId") == parent["info"]["run_id"]]
        assert sorted(tags(r)["experiment"] for r in children) == ["z0_gas1_tmbspg1", "z0_gas1_tmbspg2"]
        assert parent["info"]["run_name"] == tags(parent)[ "mlautotune.session"] and parent["info"]["status"] == "FINISHED"

        c = MlflowClient(server.url)
        p = c.get_run(parent["info"]["run_id"])
        kids = [c.get_run(r["info"]["run_id"]) for r in children]
        for run in [p, *kids]:
            text = all_text_of_run(c, run.info.run_id, tmp_path)
            for secret in SECRETS:
                assert secret not in text, (secret, run.info.run_name)
        # the user's own mlflow.log_metric landed in its child run, not in the parent
        assert all(k.data.metrics.get("user_metric") == 42.0 for k in kids) and "user_metric" not in p.data.metrics
        # the parent: the winner's knobs, the speed-up, the summary as description, context tags, no duplicates
        assert p.data.params["best.micro_batch"] in ("1", "2") and p.data.metrics["best.micro_batch"] in (1.0, 2.0)
        assert p.data.metrics["speedup_over_first"] > 0
        assert "| global" in p.data.tags["mlflow.note.content"] and p.data.tags["mlflow.user"]
        assert p.data.params["user_ds_config._comment"] == "kept" and p.data.params["user_ds_config.comet.api_key"] == "***"
        assert not [k for k in p.data.params if k.startswith(("cfg.", "user_ds_config.autotuning"))]
        assert all(v != "" for v in p.data.params.values())
        # children: plain knob names, numbers as metrics, the memory limit, a filterable outcome
        for k in kids:
            assert k.data.tags["status"] == "ok" and k.data.metrics["ok"] == 1.0
            assert k.data.metrics["micro_batch_size"] == float(k.data.params["micro_batch_size"])
            assert int(k.data.params["memory_limit_bytes"]) > 0 and not [x for x in k.data.params if x.startswith(("ds_config.", "zero."))]
        ok = c.search_runs([exp_id], filter_string="tags.status = 'ok'")
        assert {r.info.run_id for r in ok} == {k.info.run_id for k in kids}
    header = (tmp_path / "autotuning_results" / "trials.csv").read_text().splitlines()[0]
    assert header.startswith("experiment,trial,status,stage,micro_batch,gas,knobs,throughput")


@pytest.mark.parametrize("study_there", [False, True], ids=["study elsewhere", "study in the results folder"])
def test_a_full_disk_ends_the_session_failed_with_the_reason(tmp_path, study_there):
    """results_dir on a small tmpfs that the test fills while the first experiment runs (needs root
    to mount; skipped otherwise). MLflow lives elsewhere; the Optuna study too, or (the default) on
    the full disk, where its writes fail inside Optuna (StorageInternalError)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        config = write_config(tmp_path / "ds.json", [1, 2], 0, tuner_num_trials=2)
        results = disk / "res"
        storage = [] if study_there else [f"search.storage=sqlite:///{tmp_path / 'optuna.db'}"]
        proc = cli(tmp_path, f"config={config}", f"autotuning.results_dir={results}", *storage)
        wait_for(lambda: (results / "launches.log").exists(), proc)
        with open(disk / "ballast", "wb") as f:  # fill the disk
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        code, out = finish(proc)
        full = "database or disk is full" if study_there else "No space left on device"
        assert code == 1 and "Traceback" not in out and ("No space left on device" in out or full in out), out
        (parent,) = runs(tmp_path, "session")
        assert parent.info.status == "FAILED" and parent.data.tags["status"] == "failed"
        assert "No space left on device" in parent.data.tags["failure_reason"] or full in parent.data.tags["failure_reason"]
        assert "RUNNING" not in {r.info.status for r in runs(tmp_path)}
        assert "tuning_space" in parent.data.tags["mlflow.note.content"]  # the partial summary, kept in MLflow
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_the_full_run_estimate_in_the_summary_console_and_parent(tmp_path):
    """planned_tokens / --seq_len 32 gives the samples; two experiments (the ds_config as given,
    z0_gas1_tmbspg1, and the profiling's micro-batch 4): each one's time is samples / its measured
    throughput, with its own interval, and the hours saved are the difference."""
    import re

    samples = 36000
    config = write_config(tmp_path / "ds.json", 1, 0, tuner_num_trials=2, planned_tokens=samples * 32)
    code, out = finish(cli(tmp_path, f"config={config}"))
    assert code == 0, out
    results = tmp_path / "autotuning_results"
    (parent,) = runs(tmp_path, "session")
    children = {r.data.tags["experiment"]: r for r in runs(tmp_path) if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert set(children) == {"z0_gas1_tmbspg1", "z0_gas1_tmbspg4"}
    best, start = children[parent.data.tags["best_experiment"]], children["z0_gas1_tmbspg1"]
    hours = lambda child: samples / child.data.metrics["throughput"] / 3600
    m = parent.data.metrics
    assert m["estimate.planned_samples"] == samples and parent.data.params["autotuning.planned_tokens"] == str(samples * 32)
    assert m["estimate.optimum_hours"] == pytest.approx(hours(best))
    assert m["estimate.optimum_hours_high"] == pytest.approx(hours(best) * (1 + best.data.metrics["interval_rel"]))
    assert m["estimate.optimum_gpu_hours"] == pytest.approx(2 * hours(best))  # two ranks
    assert m["estimate.start_hours"] == pytest.approx(hours(start))
    assert m["estimate.start_hours_low"] == pytest.approx(hours(start) * (1 - start.data.metrics["interval_rel"]))
    assert m["estimate.saved_hours"] == pytest.approx(hours(start) - hours(best), abs=1e-12)
    assert m["estimate.saved_hours_low"] <= m["estimate.saved_hours"] <= m["estimate.saved_hours_high"]

    summary = (results / "summary.txt").read_text()
    assert f"Full-run estimate: {samples * 32:,} tokens (autotuning.planned_tokens) / 32 tokens per sample (--seq_len) = {samples:,} samples." in summary
    unit = {"h": 1, "min": 1 / 60, "s": 1 / 3600}
    for label, child in (("At the optimum", best), ("At your starting configuration", start)):
        found = re.search(rf"{label} {child.data.tags['experiment']}: ([0-9.,]+) (h|min|s) \(", summary)
        assert found, summary
        assert float(found.group(1).replace(",", "")) * unit[found.group(2)] == pytest.approx(hours(child), rel=1e-3)  # 4 significant digits
    assert "Full-run estimate:" in out and "Saved:" in out  # the console's final block is the summary
    assert parent.data.tags["estimate"].startswith("Full-run estimate:")
    # mlautotune's own autotuning keys never reach DeepSpeed
    for used in (results / "z0_gas1_tmbspg1" / "ds_config.json", results / "ds_config_optimal.json"):
        assert "planned_tokens" not in used.read_text() and "autotuning" not in json.loads(used.read_text())
