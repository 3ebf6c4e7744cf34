"""Hostile and mistaken inputs (issue 49), beyond tests/test_bad_inputs.py's table: host names that would
be ssh options, a results folder of the user's own files, stores that fail, the drop-in's argparse,
secrets in what the tool writes, logs that flood, a tracking server that is down, a daemon that
leaves its experiment's process group. The pure checks directly, then the real entry points."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from mlautotune.errors import UserError
from mlautotune.inputs.hosts import check_selection, is_host, read_hostfile
from test_bad_inputs import error_lines, run_cli

SCRIPTS = Path(__file__).parent / "scripts"
HOSTILE_HOSTS = ["-oProxyCommand=touch${IFS}MARK", "-F/etc/passwd", "--", "-", "host;id", "host$(id)", "a b", "host`id`", "../etc", "host/x",
                 "-l", "h..x", "x" * 254, "h|x", "h&x", "ho\\st"]
GOOD_HOSTS = ["localhost", "worker-1", "node_07", "gpu01.cluster.local", "10.0.0.7", "fe80::1", "2001:db8::2", "a" * 63]


# ---------- pure checks ----------

@pytest.mark.parametrize("name", HOSTILE_HOSTS)
def test_a_hostile_host_name_is_not_a_host(name):
    assert not is_host(name)


@pytest.mark.parametrize("name", GOOD_HOSTS)
def test_host_names_and_addresses_are_hosts(name):
    assert is_host(name)


@pytest.mark.parametrize("text,fragment", [
    ("-oProxyCommand=touch${IFS}MARK slots=2\n", "not a host name or an IP address"),
    ("worker-1 slots=2\n--help slots=1\n", "line 2"),
    ("worker-1 slots=1.5\n", "slots='1.5'"),
    ("worker-1 slots=0\n", "slots='0'"),
    ("worker-1 slots=-1\n", "slots='-1'"),
    ("worker-1 slots=2 extra\n", "line 1"),
    ("worker-1\n", "is not '<host> slots=<n>'"),
    ("worker-1 slots=2\nworker-1 slots=2\n", "twice"),
    ("# only a comment\n\n", "lists no hosts"),
])
def test_a_bad_hostfile_line_is_refused(tmp_path, text, fragment):
    (tmp_path / "hosts").write_text(text)
    with pytest.raises(UserError) as e:
        read_hostfile(tmp_path / "hosts")
    assert fragment in e.value.message


def test_a_good_hostfile_is_read(tmp_path):
    (tmp_path / "hosts").write_text("# nodes\nworker-1 slots=8\n10.0.0.2   slots=4\n\n")
    assert read_hostfile(tmp_path / "hosts") == {"worker-1": 8, "10.0.0.2": 4}


@pytest.mark.parametrize("text", ["-oProxyCommand=id", "worker-1@-oProxyCommand=id", "worker-1:0,x", "worker 1", "w:0@;id"])
def test_a_hostile_include_is_refused(text):
    with pytest.raises(UserError):
        check_selection(text, "include")


def test_include_syntax_is_accepted():
    for text in ("worker-1", "worker-1:0,1@worker-2", "10.0.0.7:3"):
        check_selection(text, "include")


# ---------- the real entry points, in this process (as the console scripts call them) ----------

def ds_config(tmp_path, **autotuning):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "autotuning": {"enabled": True, **autotuning}}))
    return path


def assert_one_paragraph(code, err, fragment, secret="s3cr3tpw"):
    assert code == 2, err
    assert "Traceback" not in err and "usage:" not in err, err
    lines = error_lines(err)
    assert len(lines) == 1 and fragment in lines[0], err
    assert secret not in err


def test_a_hostile_hostfile_never_reaches_ssh(tmp_path):
    """A real `tune` with a hostfile whose first host is an ssh option that runs a command: refused
    before any launch, and the command never runs."""
    marker = tmp_path / "MARK"
    (tmp_path / "hosts").write_text(f"-oProxyCommand=touch${{IFS}}{marker} slots=1\nworker-2 slots=1\n")
    code, _, err = run_cli(tmp_path, [f"config={ds_config(tmp_path, experiment_timeout=30, tuner_num_trials=1)}", f"launcher.hostfile={tmp_path / 'hosts'}",
                                      "tracking.enabled=false"])
    assert_one_paragraph(code, err, "not a host name or an IP address")
    time.sleep(1)
    assert not marker.exists() and not (tmp_path / "autotuning_results").exists()


USER_FILES = {"ds.json": None, "train.py": "print('the user script')\n", "mlflow.db": "not really sqlite\n", "notes.txt": "mine\n",
              "session.json": '{"session": "not mlautotune\'s"}\n'}


def user_folder(tmp_path) -> dict:
    ds_config(tmp_path)
    for name, text in USER_FILES.items():
        if text is not None:
            (tmp_path / name).write_text(text)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "shard0").write_text("data\n")
    return {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}


@pytest.mark.parametrize("extra,fragment", [
    (["autotuning.results_dir=.", "autotuning.overwrite=true"], "is the working folder"),
    (["autotuning.results_dir=@TMP@", "autotuning.overwrite=true"], "is the working folder"),
    (["autotuning.results_dir=.", "autotuning.overwrite=false"], "is the working folder"),
    (["autotuning.results_dir=sub", "autotuning.overwrite=true", "script=sub/train.py"], "the training script's folder"),
    (["autotuning.results_dir=store", "autotuning.overwrite=true", "tracking.tracking_uri=sqlite:///store/mlflow.db"], "the MLflow tracking store's folder"),
    (["autotuning.results_dir=store", "search.storage=sqlite:///store/optuna.db"], "the Optuna storage's folder"),
    (["autotuning.results_dir=data", "autotuning.overwrite=true"], "holds files that mlautotune did not write ('shard0')"),
    (["autotuning.results_dir=data"], "holds files that mlautotune did not write"),
])
def test_a_results_folder_of_user_files_is_refused_and_nothing_moves(tmp_path, extra, fragment):
    """`tune` itself (not plan): refused before the folder is touched; every user file is where it was, unchanged."""
    before = user_folder(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "train.py").write_text("print('x')\n")
    (tmp_path / "store").mkdir()
    before = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    args = [a.replace("@TMP@", str(tmp_path)) for a in extra]
    code, _, err = run_cli(tmp_path, [f"config={tmp_path / 'ds.json'}", "tracking.enabled=false", *args])
    assert_one_paragraph(code, err, fragment)
    after = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before
    assert not (tmp_path / "previous_sessions").exists()


def test_archiving_moves_only_the_tools_own_files(tmp_path):
    from mlautotune.inputs.results_folder import archive_previous_session

    res = tmp_path / "res"
    (res / "z0_gas1_tmbspg2").mkdir(parents=True)
    (res / "z0_gas1_tmbspg2" / "cmd.txt").write_text("x")
    (res / "z1_gas1_tmbspg4").mkdir()  # the tool's name, but not its content
    (res / "z1_gas1_tmbspg4" / "mine.txt").write_text("x")
    for name in ("session.json", "summary.txt", "trials.csv", "notes.txt", "train.py"):
        (res / name).write_text('{"session": "old"}' if name == "session.json" else "x")
    archive_previous_session(res)
    assert sorted(p.name for p in res.iterdir()) == ["notes.txt", "previous_sessions", "train.py", "z1_gas1_tmbspg4"]
    assert sorted(p.name for p in (res / "previous_sessions" / "old").iterdir()) == ["session.json", "summary.txt", "trials.csv", "z0_gas1_tmbspg2"]


@pytest.mark.parametrize("storage,fragment", [
    ("postgresql+psycopg://me:s3cr3tpw@127.0.0.1:@PORT@/optuna", "server at 127.0.0.1:@PORT@"),
    ("mysql://me:s3cr3tpw@127.0.0.1:3306/optuna", "needs the mysql driver 'mysqldb', which is not installed"),
    ("mysql+pymysql://me:s3cr3tpw@db/optuna", "driver 'pymysql', which is not installed"),
    ("sqlite://", "in-memory sqlite database"),
    ("sqlite:///:memory:", "in-memory sqlite database"),
])
def test_a_storage_that_fails_is_one_paragraph_without_its_password(tmp_path, storage, fragment):
    port = closed_port()
    storage, fragment = storage.replace("@PORT@", str(port)), fragment.replace("@PORT@", str(port))
    code, _, err = run_cli(tmp_path, [f"config={ds_config(tmp_path)}", "tracking.enabled=false", f"search.storage={storage}"])
    assert_one_paragraph(code, err, fragment)
    assert not (tmp_path / "autotuning_results" / "session.json").exists()


def test_a_sqlite_storage_in_a_read_only_folder_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(ro)], capture_output=True).returncode != 0:
        os.chmod(ro, 0o555)
        if os.access(ro, os.W_OK):
            pytest.skip("no read-only folder here (root without mount)")
    try:
        code, _, err = run_cli(tmp_path, [f"config={ds_config(tmp_path)}", "tracking.enabled=false", f"search.storage=sqlite:///{ro}/optuna.db"])
        assert_one_paragraph(code, err, "the study's sqlite file cannot be written")
    finally:
        subprocess.run(["umount", str(ro)], capture_output=True)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("argv,fragment", [
    (["--bogus_flag", "train.py", "--deepspeed", "ds.json"], "unrecognized arguments: --bogus_flag"),
    ([], "no training script is given"),
    (["--num_gpus", "two", "train.py", "--deepspeed", "ds.json"], "invalid int value: 'two'"),
    (["--autotuning", "bogus", "train.py", "--deepspeed", "ds.json"], "invalid choice: 'bogus'"),
    (["--num_nodes", "1.5", "train.py", "--deepspeed", "ds.json"], "invalid int value: '1.5'"),
    (["--master_port"], "expected one argument"),
    (["--include=-oProxyCommand=touch${IFS}MARK", "train.py", "--deepspeed", "ds.json"], "not a host name or an IP address"),
])
def test_the_drop_in_gives_one_paragraph_not_argparse_usage(tmp_path, argv, fragment):
    from mlautotune.deepspeed_cli import main

    ds_config(tmp_path)
    (tmp_path / "train.py").write_text("print('x')\n")
    code, _, err = run_cli(tmp_path, argv, main=main)
    assert_one_paragraph(code, err, fragment)
    assert not (tmp_path / "MARK").exists()


@pytest.mark.parametrize("argv,fragment", [
    (["hydra/launcher=joblib"], "hydra/launcher=joblib is not an installed Hydra option (available: basic)"),
    (["hydra/sweeper=optuna"], "hydra/sweeper=optuna is not an installed Hydra option"),
    (["hydra.run.dir=@TMP@/notes.txt/out"], "hydra.run.dir="),
    (["-m", "hydra.sweep.dir=@TMP@/notes.txt/out", "autotuning.tuner_type=random,gridsearch"], "hydra.sweep.dir="),
    (["plan", "-m", "autotuning.tuner_type=random,gridsearch"], "plan does not take -m/--multirun"),
    (["sync", "--multirun"], "sync does not take -m/--multirun"),
    (["+foo=bar"], "'+foo=bar' adds the key 'foo'"),
    (["++autotuning.bogus=1"], "adds the key 'autotuning.bogus'"),
    (["~autotuning.metric=throughput"], "deletes the key 'autotuning.metric'"),
    (["-m", "autotuning.tuner_typo=random,gridsearch"], "'autotuning.tuner_typo' is not a setting of mlautotune"),
    (["-m", "autotuning.tuner_num_trials=3,many"], "autotuning.tuner_num_trials='many' is not a whole number"),
    (["tracking.tracking_uri=postgresql://me:s3cr3tpw@127.0.0.1:1/db", "+x=1"], "adds the key 'x'"),
])
def test_hydra_level_mistakes_are_one_paragraph(tmp_path, argv, fragment):
    ds_config(tmp_path)
    (tmp_path / "notes.txt").write_text("a file, not a folder\n")
    code, _, err = run_cli(tmp_path, [a.replace("@TMP@", str(tmp_path)) for a in argv] + [f"config={tmp_path / 'ds.json'}"])
    assert_one_paragraph(code, err, fragment)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.json", "notes.txt"]


def test_the_mlproject_entry_point_refuses_an_unknown_parameter_in_one_paragraph(tmp_path, monkeypatch):
    from mlautotune import mlproject

    monkeypatch.setattr(sys, "argv", ["mlproject", "nonsense=1", "config=ds.json"])
    code, _, err = run_cli(tmp_path, [], main=lambda argv: mlproject.main())
    assert_one_paragraph(code, err, "'nonsense' is not a parameter of the MLproject")


# ---------- real experiments and sessions ----------

@pytest.mark.e2e
def test_a_flooding_script_with_a_detached_daemon_and_secrets(tiny_experiment, tmp_path, monkeypatch, leftovers):
    """One real 2-rank launch of a script that starts a setsid daemon, prints its token and an environment
    secret, floods stderr with 6 MB and fails: the daemon is killed and named in launches.log, stderr.log
    keeps its head and tail (and says so), and no file of the experiment holds either secret."""
    from mlautotune.redact import remember_secrets
    from mlautotune.run import logs
    from mlautotune.run.experiment import run_experiment

    monkeypatch.setenv("MY_SERVICE_PASSWORD", "env-secret-9f3k2")
    args = ["--marker", str(tmp_path / "daemon"), "--hf_token", "hf_tok3n_value_xyz", "--flood_mb", "6"]
    remember_secrets(args, {"MY_SERVICE_PASSWORD": "env-secret-9f3k2"})  # what open_session notes for a session
    result = run_experiment(tiny_experiment(script=SCRIPTS / "flood_and_detach.py", script_args=args, timeout_s=120.0), tmp_path)
    assert result.status == "failed"
    exp_dir = Path(result.exp_dir)
    pids = [int(p.read_text()) for p in tmp_path.glob("daemon.*")]
    assert len(pids) == 1
    alive = psutil.pid_exists(pids[0]) and psutil.Process(pids[0]).status() != psutil.STATUS_ZOMBIE
    assert not alive
    assert f"killed pid {pids[0]}" in (exp_dir / "launches.log").read_text()
    stderr = (exp_dir / "stderr.log").read_text()
    assert (exp_dir / "stderr.log").stat().st_size < 2 * logs.LOG_KEEP_BYTES + 4096
    assert "bytes of this log were cut here" in stderr and stderr.rstrip().endswith("flood")
    assert "token in the clear: ***; from the environment: ***" in (exp_dir / "stdout.log").read_text()
    for path in exp_dir.iterdir():
        text = path.read_text(errors="replace")
        assert "hf_tok3n_value_xyz" not in text and "env-secret-9f3k2" not in text, path.name
    assert "***" in (exp_dir / "cmd.txt").read_text()
    assert leftovers(result.exp_dir) == []


def test_a_tracking_server_that_never_answers_is_tried_once_then_the_session_goes_on_untracked(tmp_path, monkeypatch):
    """A real socket that accepts connections and never answers: the first call is tried (2 attempts), every
    later one is skipped at once, the outage is said once, without the URI's password."""
    import threading

    import optuna

    from mlautotune.track.tracking import Tracker

    server = socket.create_server(("127.0.0.1", 0))
    held = []
    threading.Thread(target=lambda: [held.append(server.accept()) for _ in iter(int, 1)], daemon=True).start()
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")
    messages = []
    t = Tracker(f"http://me:s3cr3tpw@127.0.0.1:{server.getsockname()[1]}", "mlautotune", say=messages.append, backoff_s=0.1, results_dir="RES")
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'optuna.db'}", study_name="s")
    assert t.open_parent(study, "sess", {"a": 1}, {}, []) is None and not t.online
    for n in range(5):
        t.child_started(n, f"z0_gas1_tmbspg{n + 1}", {"stage": 0}, {"status": "running"})
        t.child_finished(n, f"z0_gas1_tmbspg{n + 1}", {"stage": 0}, {"throughput": 1.0}, {"status": "ok"}, None, "FINISHED")
    t.close_parent({}, {}, [], "FINISHED")
    assert len(held) == 2, len(held)  # the first call's two attempts, nothing after
    assert t.missed >= 1 and not t._children
    assert len(messages) == 1 and "goes on untracked" in messages[0] and "mlautotune sync autotuning.results_dir=RES" in messages[0]
    assert "s3cr3tpw" not in messages[0]
    server.close()


def test_a_multirun_with_a_password_in_a_url_keeps_it_out_of_its_files_and_console(tmp_path):
    """A real Hydra multirun whose study server is down: the job refuses it in one paragraph, and Hydra's
    multirun.yaml and job lines, written before the jobs, hold the URL with its password masked."""
    uri = f"postgresql+psycopg://me:s3cr3tpw@127.0.0.1:{closed_port()}/optuna"
    code, out, err = run_cli(tmp_path, ["-m", f"config={ds_config(tmp_path)}", "tracking.enabled=false", f"search.storage={uri}", "autotuning.tuner_type=random,gridsearch"])
    assert code == 2 and "Traceback" not in err, err
    assert "s3cr3tpw" not in out + err
    record = (tmp_path / "multirun" / "multirun.yaml").read_text()
    assert "me:***@127.0.0.1" in record and "s3cr3tpw" not in record
    assert not any("s3cr3tpw" in str(p) for p in tmp_path.rglob("*"))
