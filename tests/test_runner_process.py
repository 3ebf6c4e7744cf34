"""How an experiment's DeepSpeed runner and its launch.py are started: on CPU, forked from a process
that has imported them. A real runner launches a real rank; the test checks what the rank sees
against what a fresh `python -u -m deepspeed.launcher.runner` process gives it."""

import json
import os
import subprocess
import sys

import pytest

from mlautotune.run import runner_process

RANK = """
import json, os, sys
import psutil
launcher = psutil.Process(os.getppid())
print(json.dumps({"cwd": os.getcwd(), "marker": os.environ.get("MLAUTOTUNE_TEST_MARKER"), "pgid": os.getpgid(0),
                  "stdin": sys.stdin.read(), "argv": sys.argv[1:], "launcher_cmdline": launcher.cmdline(),
                  "launcher_parent": launcher.ppid(), "dist": [os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")]}), flush=True)
sys.exit(int(sys.argv[-2]))
"""


def launch(tmp_path, exit_code: int, accelerator=None):
    (tmp_path / "rank.py").write_text(RANK)
    out, err = tmp_path / "stdout.log", tmp_path / "stderr.log"
    for f in (out, err):
        f.write_text("")
    cmd = [*runner_process.RUNNER_COMMAND, "--num_gpus", "1", "rank.py", str(exit_code), "--flag"]
    cwd = os.getcwd()
    os.chdir(tmp_path)  # the rank's script is found relative to the tuner's working folder
    try:
        proc = runner_process.start(cmd, str(out), str(err), {**os.environ, "MLAUTOTUNE_TEST_MARKER": "seen"}, accelerator=accelerator)
    finally:
        os.chdir(cwd)
    try:
        returncode = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.terminate()
        raise
    lines = [line for line in out.read_text().splitlines() if line.startswith("{")]
    return proc, returncode, json.loads(lines[-1]) if lines else None, err.read_text()


@pytest.mark.e2e
def test_the_forked_runner_gives_the_rank_what_a_fresh_runner_process_would(tmp_path):
    proc, returncode, seen, stderr = launch(tmp_path, 3)
    assert isinstance(proc, runner_process.ForkedRunner)  # this machine's accelerator is the CPU
    assert seen is not None, stderr
    assert seen["cwd"] == str(tmp_path) and seen["marker"] == "seen" and seen["argv"][-2:] == ["3", "--flag"]
    assert seen["pgid"] == proc.pid  # the experiment's own process group, which experiment.py kills as a whole
    assert seen["stdin"] == ""
    assert seen["dist"] == ["0", "0", "1"]  # what launch.py sets for its ranks
    # launch.py did not start as a new interpreter (that import is ~6 s): it is a fork of the runner
    assert runner_process.LAUNCH_MODULE not in " ".join(seen["launcher_cmdline"]) and seen["launcher_parent"] == proc.pid
    assert returncode == 3  # the rank's exit code, through launch.py and the runner


@pytest.mark.e2e
def test_on_a_gpu_the_runner_and_its_launch_are_new_processes(tmp_path):
    """CUDA is not fork-safe: with any accelerator but the CPU, the runner is `python -u -m
    deepspeed.launcher.runner ...` itself, which starts launch.py as a new interpreter too."""
    proc, returncode, seen, stderr = launch(tmp_path, 3, accelerator="cuda")
    assert isinstance(proc, subprocess.Popen) and proc.args[:len(runner_process.RUNNER_COMMAND)] == runner_process.RUNNER_COMMAND
    assert seen is not None, stderr
    assert runner_process.LAUNCH_MODULE in " ".join(seen["launcher_cmdline"])  # launch.py was started as a command
    assert seen["pgid"] == proc.pid and seen["marker"] == "seen" and seen["dist"] == ["0", "0", "1"]
    assert returncode == 3


@pytest.mark.e2e
def test_a_new_server_takes_over_when_the_old_one_is_gone(tmp_path):
    runner_process.warm()
    old = runner_process._server
    old.proc.kill()
    old.proc.wait()
    proc, returncode, seen, stderr = launch(tmp_path, 0)
    assert isinstance(proc, runner_process.ForkedRunner) and proc.server is not old
    assert returncode == 0 and seen is not None, stderr


def test_other_commands_start_as_new_processes(tmp_path):
    out, err = tmp_path / "o", tmp_path / "e"
    proc = runner_process.start([sys.executable, "-c", "import os; print(os.getpgid(0) == os.getpid())"], str(out), str(err), dict(os.environ))
    assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=60) == 0
    assert out.read_text().strip() == "True"


def test_a_rank_is_forked_only_when_nothing_read_at_a_process_start_differs(monkeypatch):
    monkeypatch.setattr(runner_process, "_SERVER_ENV", {"PATH": "/bin", "KMP_DUPLICATE_LIB_OK": "True"})
    rank = {"PATH": "/bin", "RANK": "1", "OMP_NUM_THREADS": "2", "PYTHONPATH": "/x", "MLFLOW_RUN_ID": "r"}
    assert runner_process._forkable(rank)  # the launcher's and the tuner's variables; the fork sets its threads and path
    assert not runner_process._forkable({**rank, "LD_PRELOAD": "/usr/lib/libtcmalloc.so"})  # read by the loader
    assert not runner_process._forkable({**rank, "MALLOC_ARENA_MAX": "2"})  # by the allocator, at the start
    assert not runner_process._forkable({**rank, "KMP_DUPLICATE_LIB_OK": "False"})  # set otherwise than the import does
    assert not runner_process._forkable({**rank, "PYTHONHASHSEED": "0"})
    assert not runner_process._forkable({**rank, "MKL_NUM_THREADS": "4"})  # the fork sets OMP's count, for MKL too


def test_a_runner_whose_group_does_not_exist_yet_is_killed_by_its_pid():
    """A runner the server forked a moment ago may be ended (a timeout already spent while the server
    started) before its setsid: no group of its pid exists yet. It must still be killed, not waited on."""
    import signal
    import threading

    from mlautotune.run.experiment import _end_group

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # in our group, as a child before its setsid
    try:
        ended = threading.Thread(target=_end_group, args=(proc, False), daemon=True)
        ended.start()
        ended.join(timeout=60)
        assert not ended.is_alive() and proc.returncode == -signal.SIGKILL
    finally:
        proc.kill()
