"""Tracking against a real MLflow store (sqlite, and a real `mlflow server` on loopback), a real
Optuna study, no launches: keys, timestamps, redaction, outages, sync, the REST view; plus the
pure parts (redaction rules, names and paths, the session lock)."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from mlautotune.errors import UserError
from mlautotune.files import inside, safe_name
from mlautotune.redact import MASK, redact, redact_args, redact_text, remember_secrets, secret_key
from mlautotune.session import SessionLock
from mlautotune.inputs.space import experiment_name
from mlautotune.track.tracking import Tracker, child_payload, clean_key

SECRETS = ("DBPASS77", "TRACKPASS77", "TOKEN77xyz", "COMETKEY77")


def store(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def study(tmp_path, name="s1"):
    return optuna.create_study(storage=f"sqlite:///{tmp_path / 'optuna.db'}", study_name=name, load_if_exists=True, direction="maximize")


def all_text_of_run(client: MlflowClient, run_id: str, tmp_path: Path) -> str:
    """Params, tags and every artifact's content of a run, as one string."""
    run = client.get_run(run_id)
    out = [json.dumps(run.data.params), json.dumps(run.data.tags)]
    local = Path(client.download_artifacts(run_id, "", str(tmp_path / f"dl-{run_id}")))
    out += [p.read_text(errors="replace") for p in local.rglob("*") if p.is_file()]
    return "\n".join(out)


# ---------- redaction rules ----------

@pytest.mark.parametrize("key", ["comet.api_key", "hf_token", "--hf_token", "MLFLOW_TRACKING_PASSWORD", "apiKey", "client_secret", "auth", "wandb.api_key", "DB_PWD"])
def test_secret_keys(key):
    assert secret_key(key)


@pytest.mark.parametrize("key", ["reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_max_live_parameters", "max_tokens", "tokenizer_name", "key", "author", "sub_group_size", "PWD", "OLDPWD"])
def test_zero_knobs_and_ordinary_keys_are_not_secrets(key):
    assert not secret_key(key)


def test_redaction_of_urls_args_and_text():
    assert redact_text("postgresql://bob:DBPASS77@db:5432/optuna") == f"postgresql://bob:{MASK}@db:5432/optuna"
    assert redact_text("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db"
    assert redact_args(["--hf_token", "abc", "--token=def", "--steps", "3"]) == ["--hf_token", MASK, f"--token={MASK}", "--steps", "3"]
    line = "cmd = export MLFLOW_TRACKING_PASSWORD=pw1234; export MLFLOW_TRACKING_URI=http://u:pw5678@h:5000; python t.py"
    assert "pw1234" not in redact_text(line) and "pw5678" not in redact_text(line)
    cfg = {"comet": {"api_key": "COMETKEY77", "enabled": True}, "zero_optimization": {"reduce_bucket_size": 5e8}}
    assert redact(cfg) == {"comet": {"api_key": MASK, "enabled": True}, "zero_optimization": {"reduce_bucket_size": 5e8}}
    remember_secrets(["--hf_token", "TOKEN77xyz"])  # printed in any shape later: still masked
    assert "TOKEN77xyz" not in redact_text("argv: ['--hf_token', 'TOKEN77xyz']")


# ---------- names and paths ----------

def test_a_hostile_knob_name_stays_inside_results_dir(tmp_path):
    name = experiment_name(0, 1, 2, {"/_._._/_._._/": 1, "../../etc": 2})
    assert set(name) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
    assert inside(tmp_path, name).parent == tmp_path.resolve()
    for bad in ("../x", "/etc/passwd", "..", "a/../../b"):
        with pytest.raises(ValueError):
            inside(tmp_path / "results", bad)
    assert safe_name("..") not in (".", "..") and safe_name("a/b c") == "abc"


def test_clean_key():
    assert clean_key("#comment") == "_comment"
    assert clean_key("größe").isascii() and clean_key("größe") != clean_key("grosse")
    long = "k" * 300
    assert len(clean_key(long)) <= 250 and clean_key(long) != clean_key("k" * 299)
    assert clean_key("zero_optimization.reduce_bucket_size") == "zero_optimization.reduce_bucket_size"


# ---------- the MLflow store ----------

def test_metrics_are_dated_and_a_resumed_parent_shows_the_new_best(tmp_path):
    st = study(tmp_path)
    t1 = Tracker(store(tmp_path), "mlautotune", say=lambda s: None)
    parent = t1.open_parent(st, "sess", {"a": 1}, {}, [])
    t1.log_parent({"best_throughput": 120.0}, step=0)
    t1.close_parent({"best_throughput": 120.0}, {}, [], "KILLED", step=1)
    # a resumed session: the same study, the same parent, a new best that is lower than the old value
    t2 = Tracker(store(tmp_path), "mlautotune", say=lambda s: None)
    assert t2.open_parent(st, "sess", {"a": 1}, {}, []) == parent
    t2.close_parent({"best_throughput": 100.0}, {}, [], "FINISHED", step=5)
    c = MlflowClient(store(tmp_path))
    assert c.get_run(parent).data.metrics["best_throughput"] == 100.0
    history = c.get_metric_history(parent, "best_throughput")
    assert [h.step for h in history] == [0, 1, 5]
    assert all(h.timestamp > 1.7e12 for h in history)  # milliseconds since the epoch, not 1970
    assert c.get_run(parent).info.run_name == "sess"


def test_odd_keys_and_long_values_are_tracked_fully(tmp_path, monkeypatch):
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    odd = {"#comment": "x", "größe": 3, "k" * 300: 1, "zero_optimization.reduce_bucket_size": 5e8, "long": "v" * 10000, "empty": ""}
    messages = []
    t = Tracker(store(tmp_path), "mlautotune", say=messages.append)
    parent = t.open_parent(study(tmp_path), "sess", odd, {"note#1": "y"}, [])
    assert parent and t.online and messages == []
    params = MlflowClient(store(tmp_path)).get_run(parent).data.params
    assert {clean_key(k) for k in odd if k != "empty"} <= set(params) and "empty" not in params
    assert params["long"].endswith("[full value: long_values/long.txt]")
    text = MlflowClient(store(tmp_path)).download_artifacts(parent, "long_values/long.txt", str(tmp_path / "dl"))
    assert Path(text).read_text() == "v" * 10000
    assert (tmp_path / "mlartifacts").is_dir() and not (tmp_path / "cwd" / "mlruns").exists()  # beside the db, not in the cwd


def test_no_secret_reaches_params_tags_or_artifacts(tmp_path):
    remember_secrets(["--hf_token", "TOKEN77xyz"], "postgresql://bob:DBPASS77@db/optuna")
    exp_dir = tmp_path / "z0_gas1_tmbspg2"
    exp_dir.mkdir()
    (exp_dir / "stdout.log").write_text("cmd = export MLFLOW_TRACKING_URI=http://alice:TRACKPASS77@h:5000; python t.py --hf_token TOKEN77xyz\n")
    (exp_dir / "ds_config.json").write_text(json.dumps({"comet": {"api_key": "COMETKEY77"}, "train_micro_batch_size_per_gpu": 2}))
    (exp_dir / "cmd.txt").write_text("python t.py --token=TOKEN77xyz\n")
    session_json = tmp_path / "session.json"
    session_json.write_text(json.dumps({"storage": "postgresql://bob:DBPASS77@db/optuna"}))
    t = Tracker(store(tmp_path), "mlautotune", say=lambda s: None)
    params = {"search.storage": "postgresql://bob:DBPASS77@db/optuna", "script_args": "--hf_token TOKEN77xyz",
              "user_ds_config.comet.api_key": "COMETKEY77", "tracking": "http://alice:TRACKPASS77@h:5000"}
    parent = t.open_parent(study(tmp_path), "sess", params, {"uri": "http://alice:TRACKPASS77@h"}, [session_json])
    t.child_started(0, "z0_gas1_tmbspg2", {"stage": 0}, {"status": "running"})
    t.child_finished(0, "z0_gas1_tmbspg2", {"stage": 0}, {"throughput": 1.0}, {"status": "ok"}, str(exp_dir), "FINISHED")
    t.close_parent({}, {}, [session_json], "FINISHED", note="summary with TOKEN77xyz")
    c = MlflowClient(store(tmp_path))
    for run_id in (parent, t._children[0]):
        text = all_text_of_run(c, run_id, tmp_path)
        assert MASK in text
        for secret in SECRETS:
            assert secret not in text, (secret, run_id)
    assert "experiment/stdout.log" in {a.path for a in c.list_artifacts(t._children[0], "experiment")}


def test_an_outage_is_retried_shown_once_and_tracking_comes_back(tmp_path):
    """A real `mlflow server` that is down at first, then started on the same port."""
    port = free_port()
    messages = []
    st = study(tmp_path)
    t = Tracker(f"http://127.0.0.1:{port}", "mlautotune", attempts=2, backoff_s=0.1, cooldown_s=0, say=messages.append, results_dir="RES")
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    try:
        assert t.open_parent(st, "sess", {}, {}, []) is None and not t.online
        assert len(messages) == 1 and "mlautotune sync autotuning.results_dir=RES" in messages[0] and "2 attempts" in messages[0]
        with mlflow_server(tmp_path, port) as _:
            assert t.open_parent(st, "sess", {"a": 1}, {}, []) is not None and t.online
            assert "reachable again" in messages[-1] and len(messages) == 2
            t.child_finished(3, "z0_gas1_tmbspg4", {"stage": 0}, {"throughput": 2.0}, {"status": "ok"}, None, "FINISHED")  # created late
            c = MlflowClient(f"http://127.0.0.1:{port}")
            (child,) = c.search_runs([t.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{t.parent_id}'")
            assert child.data.metrics["throughput"] == 2.0 and child.info.status == "FINISHED"
    finally:
        os.environ.pop("MLFLOW_HTTP_REQUEST_MAX_RETRIES", None)


def test_sync_completes_an_unfinished_child(tmp_path):
    """A child created but never finished (the tuner lost MLflow mid-experiment) is completed by sync."""
    from mlautotune.commands import sync_command

    results = tmp_path / "res"
    results.mkdir()
    st = study(tmp_path, "sess")
    trial = st.ask()
    result = {"name": "z0_gas1_tmbspg2", "status": "ok", "metrics": {"throughput": 7.0}, "reason": "", "wall_time_s": 3.0, "exp_dir": str(results / "z0_gas1_tmbspg2")}
    trial.set_user_attr("params", {"stage": 0, "micro_batch": 2, "gas": 1})
    trial.set_user_attr("result", result)
    st.tell(trial, 7.0)
    (results / "session.json").write_text(json.dumps({"session": "sess", "storage": f"sqlite:///{tmp_path / 'optuna.db'}", "status": "complete",
                                                      "metrics": {"best_throughput": 7.0}, "tags": {"status": "complete"}, "tracking": {"uri": store(tmp_path)}}))
    t = Tracker(store(tmp_path), "mlautotune", say=lambda s: None)
    t.open_parent(st, "sess", {}, {}, [])
    t.child_started(trial.number, "z0_gas1_tmbspg2", {"stage": 0}, {"status": "running"})
    cfg = OmegaConf.create({"autotuning": {"results_dir": str(results)}, "tracking": {"tracking_uri": None, "experiment_name": "mlautotune"}})
    sync_command(cfg)
    run = MlflowClient(store(tmp_path)).get_run(t._children[trial.number])
    assert run.info.status == "FINISHED" and run.data.metrics["throughput"] == 7.0 and run.data.metrics["ok"] == 1.0
    assert run.data.tags["status"] == "ok" and run.data.params["micro_batch_size"] == "2"


def test_fill_in_finishes_the_runs_of_results_the_study_has_and_mlflow_missed(tmp_path):
    """A session killed between recording a result in the study and finishing its child run; a
    result tracked during an outage; a run finished already; a trial cut off. The study is the record."""
    st = study(tmp_path, "sess")
    t = Tracker(store(tmp_path), "mlautotune", say=lambda s: None)
    t.open_parent(st, "sess", {}, {}, [])

    def trial(mb, status, metrics):
        tr = st.ask()
        tr.set_user_attr("params", {"stage": 0, "micro_batch": mb, "gas": 1})
        tr.set_user_attr("result", {"name": f"z0_gas1_tmbspg{mb}", "status": status, "metrics": metrics, "reason": "", "wall_time_s": 2.0, "exp_dir": None})
        st.tell(tr, metrics.get("throughput"), state=optuna.trial.TrialState.COMPLETE if metrics else optuna.trial.TrialState.FAIL)
        return tr.number

    killed = trial(2, "ok", {"throughput": 7.0})
    t.child_started(killed, "z0_gas1_tmbspg2", {"stage": 0}, {"status": "running"})  # its finish never came
    missed = trial(4, "oom", {})  # no run at all
    done = trial(8, "ok", {"throughput": 9.0})
    t.child_started(done, "z0_gas1_tmbspg8", {"stage": 0}, {"status": "running"})
    t.child_finished(done, "z0_gas1_tmbspg8", {}, {"throughput": 9.0}, {"status": "ok"}, None, "FINISHED")
    cut = st.ask()
    t.child_started(cut.number, "z0_gas1_tmbspg16", {"stage": 0}, {"status": "running"})
    t.kill_open_children()  # Ctrl-C: the cut-off trial's run and the unfinished one are KILLED
    st.tell(cut, state=optuna.trial.TrialState.FAIL)

    assert t.fill_in(st) == 2
    c = MlflowClient(store(tmp_path))
    runs = {r.data.tags["experiment"]: r for r in c.search_runs([t.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{t.parent_id}'")}
    assert runs["z0_gas1_tmbspg2"].info.status == "FINISHED" and runs["z0_gas1_tmbspg2"].data.metrics["throughput"] == 7.0
    assert runs["z0_gas1_tmbspg2"].data.tags["status"] == "ok"
    assert runs["z0_gas1_tmbspg4"].info.status == "FAILED" and runs["z0_gas1_tmbspg4"].data.tags["status"] == "oom"
    assert runs["z0_gas1_tmbspg16"].info.status == "KILLED"  # no result: it is run again, not filled in
    assert len(c.get_metric_history(runs["z0_gas1_tmbspg8"].info.run_id, "throughput")) == 1  # not logged twice
    assert t.fill_in(st) == 0


def test_child_payload_plain_names_numbers_and_ok():
    params, metrics, tags = child_payload({"stage": 1, "micro_batch": 4, "gas": 1, "overlap_comm": True, "reduce_bucket_size": 5e8},
                                          {"name": "n", "status": "oom", "metrics": {"peak_memory_bytes": 3e9}, "reason": "over"}, 2**31)
    assert set(params) == {"stage", "micro_batch_size", "gradient_accumulation_steps", "overlap_comm", "reduce_bucket_size", "memory_limit_bytes"}
    assert metrics["micro_batch_size"] == 4.0 and metrics["overlap_comm"] == 1.0 and metrics["ok"] == 0.0
    assert metrics["memory_limit_bytes"] == 2**31 and metrics["peak_memory_fraction"] > 1
    assert tags["status"] == "oom" and "throughput" not in metrics


# ---------- the session lock ----------

def test_the_session_lock_names_its_holder_and_is_released(tmp_path):
    held = SessionLock(tmp_path, "s1").acquire()
    code = "import sys; from pathlib import Path; from mlautotune.session import SessionLock; SessionLock(Path(sys.argv[1]), 's2').acquire()"
    other = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True)
    assert other.returncode != 0 and "UserError" in other.stderr
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in other.stderr
    with pytest.raises(UserError):
        SessionLock(tmp_path, "s3").acquire()  # a second lock in the same process is refused too
    held.release()
    SessionLock(tmp_path, "s4").acquire().release()


# ---------- a real MLflow server ----------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class mlflow_server:
    """`mlflow server` on loopback with a sqlite backend and served artifacts, for the test's duration."""

    def __init__(self, tmp_path: Path, port: int):
        self.argv = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
                     "--artifacts-destination", str(tmp_path / "server-artifacts"), "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
        self.url = f"http://127.0.0.1:{port}"
        self.log = tmp_path / "server.log"

    def __enter__(self):
        import urllib.request

        self.proc = subprocess.Popen(self.argv, stdout=open(self.log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 180
        while time.time() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2)
                return self
            except OSError:
                time.sleep(0.5)
        raise AssertionError("mlflow server did not start: " + self.log.read_text()[-2000:])

    def __exit__(self, *exc):
        import signal

        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(timeout=30)


def test_a_re_measurement_is_nested_under_its_configuration_whose_run_shows_the_median(tmp_path):
    """The configuration's run is the one the parent's best_run_id points at: its metric is the median of
    its measurements, and its re-measurement is a run nested under it, found again on resume."""
    from mlautotune.track.tracking import REPEAT_TAG

    st = study(tmp_path)
    t = Tracker(store(tmp_path), "mlautotune", say=lambda s: None)
    parent = t.open_parent(st, "sess", {}, {}, [])
    first = t.child_started(0, "z0_gas1_tmbspg4", {}, {})
    t.child_finished(0, "z0_gas1_tmbspg4", {}, {"throughput": 90.0}, {"status": "ok"}, None, "FINISHED")
    rep = t.child_started(1, "z0_gas1_tmbspg4_rep1", {}, {REPEAT_TAG: "0"})
    t.child_finished(1, "z0_gas1_tmbspg4_rep1", {}, {"throughput": 101.0}, {"status": "ok", REPEAT_TAG: "0"}, None, "FINISHED")
    t.log_configuration(0, "throughput", [90.0, 101.0], 95.5, step=1)
    c = MlflowClient(store(tmp_path))
    assert c.get_run(rep).data.tags["mlflow.parentRunId"] == first
    assert c.get_run(first).data.tags["mlflow.parentRunId"] == parent
    assert c.get_run(first).data.metrics["throughput"] == 95.5 and c.get_run(first).data.metrics["measurements"] == 2
    assert [m.value for m in c.get_metric_history(first, "throughput")] == [90.0, 95.5]
    again = Tracker(store(tmp_path), "mlautotune", say=lambda s: None)
    again.open_parent(st, "sess", {}, {}, [])
    assert again.run_id_of(1) == rep  # the nested run is the session's too: a resume does not create it twice


def test_two_parents_of_one_session_name_get_different_run_names(tmp_path):
    """The same settings tuned in two results folders: two studies, one name; the MLflow table tells them apart."""
    t = Tracker(store(tmp_path), "mlautotune", say=lambda s: None)
    a = t.open_parent(study(tmp_path, "a"), "gpt-model_based-123", {}, {}, [])
    b = Tracker(store(tmp_path), "mlautotune", say=lambda s: None).open_parent(
        optuna.create_study(storage=f"sqlite:///{tmp_path / 'other.db'}", study_name="gpt-model_based-123"), "gpt-model_based-123", {}, {}, [])
    c = MlflowClient(store(tmp_path))
    assert (c.get_run(a).info.run_name, c.get_run(b).info.run_name) == ("gpt-model_based-123", "gpt-model_based-123-2")
    assert Tracker(store(tmp_path), "mlautotune", say=lambda s: None).open_parent(study(tmp_path, "a"), "gpt-model_based-123", {}, {}, []) == a
    assert c.get_run(a).info.run_name == "gpt-model_based-123"  # resumed: its name stays


def test_the_runs_table_link_opens_with_the_metrics_as_columns(tmp_path):
    """MLflow's runs table shows no metric column by default: the session's link opens a shared view
    (an experiment tag the UI reads) whose columns are the metrics that rank the runs."""
    from mlautotune.track.tracking import VIEW_TAG

    t = Tracker(store(tmp_path), "mlautotune", say=lambda s: None)
    t.open_parent(study(tmp_path), "sess", {}, {"metric": "latency"}, [])
    view = json.loads(MlflowClient(store(tmp_path)).get_experiment(t.experiment_id).tags[VIEW_TAG])
    assert view["selectedColumns"][:2] == ["metrics.`best_latency`", "metrics.`latency`"] and view["orderByAsc"] is True
    assert f"runs?viewStateShareKey=mlautotune&workflowType=machine_learning" in t.where()
