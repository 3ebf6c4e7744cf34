"""The experiment runner and the probe: pure helpers directly, then real 2-rank CPU DeepSpeed launches (e2e)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from mlautotune.run import cpu_features, probe
from mlautotune.errors import UserError
from mlautotune.run.experiment import (Resources, classify, experiment_args, launch_command, port_is_free, reserve_port,
                                   run_experiment, world_size)

SCRIPTS = Path(__file__).parent / "scripts"


# ---------- pure helpers ----------

def test_world_size_from_launcher_resources(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=4\nworker-1 slots=4\n# a comment\n")
    h = str(hostfile)
    assert world_size(Resources(num_gpus=2)) == 2
    assert world_size(Resources(hostfile=h)) == 8
    assert world_size(Resources(hostfile=h, num_nodes=1)) == 4
    assert world_size(Resources(hostfile=h, num_nodes=2, num_gpus=2)) == 4
    assert world_size(Resources(hostfile=h, include="worker-0:0,1@worker-1:3")) == 3
    assert world_size(Resources(hostfile=h, exclude="worker-1")) == 4
    from deepspeed.accelerator import get_accelerator

    assert world_size(Resources()) == get_accelerator().device_count()


def test_world_size_rejects_bad_resources(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=2\n")
    for bad in (Resources(hostfile=str(tmp_path / "missing")), Resources(num_nodes=2),
                Resources(hostfile=str(hostfile), include="worker-9"), Resources(num_gpus=1, include="localhost:0")):
        with pytest.raises(UserError):
            world_size(bad)


def test_experiment_args_point_at_the_config_and_apply_arg_mappings(tiny_experiment):
    exp = tiny_experiment(mbs=8, gas=4, script_args=["--deepspeed_config", "user.json", "--per_device_train_batch_size=1", "--lr", "3"])
    exp.arg_mappings = {" train_micro_batch_size_per_gpu ": " --per_device_train_batch_size",
                        "gradient_accumulation_steps": "--gradient_accumulation_steps", "stage": "--zero_stage",
                        "missing_key": "--nothing"}
    args = experiment_args(exp, "/r/x/ds_config.json")
    assert args == ["--deepspeed_config", "/r/x/ds_config.json", "--per_device_train_batch_size=8", "--lr", "3",
                    "--gradient_accumulation_steps", "4", "--zero_stage", "0"]  # nested key found, like DeepSpeed
    assert exp.script_args[2] == "--per_device_train_batch_size=1"  # the experiment's own list is untouched
    exp.ds_config["gradient_accumulation_steps"] = "auto"
    assert "--gradient_accumulation_steps" not in experiment_args(exp, "c.json")  # "auto" is left to the script


def test_launch_command_goes_through_the_deepspeed_launcher_with_the_probe(tiny_experiment, tmp_path):
    exp = tiny_experiment()
    exp.resources = Resources(num_gpus=2, launcher="openmpi", launcher_args=["--bind_cores_to_rank"])
    cmd = launch_command(exp, tmp_path, 29611, ["--a", "1"])
    assert cmd[1:4] == ["-u", "-m", "deepspeed.launcher.runner"]
    assert cmd[cmd.index("--num_gpus") + 1] == "2" and cmd[cmd.index("--launcher") + 1] == "openmpi"
    assert "--bind_cores_to_rank" in cmd and "--hostfile" not in cmd and "--include" not in cmd
    assert cmd[-8:] == ["--master_port", "29611", "--module", "mlautotune.run.probe", str(tmp_path), exp.script, "--a", "1"]
    exp.resources = Resources(num_gpus=2)  # DeepSpeed's default launcher (pdsh) is not spelt out, in the user's command either
    assert "--launcher" not in launch_command(exp, tmp_path, 29611, []) and "--launcher" not in launch_command(exp, tmp_path, 0, [], probed=False)


def test_reserve_port_comes_from_the_os_and_is_never_handed_out_twice():
    first = reserve_port()
    assert port_is_free(first) and reserve_port() != first
    assert reserve_port(first) != first  # a port handed to a running experiment is not handed out twice
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        assert reserve_port(busy.getsockname()[1]) != busy.getsockname()[1]  # a taken preferred port is skipped


def test_classify_reads_exit_codes_and_probe_records(tmp_path):
    assert classify(None, True, tmp_path, 30)[0] == "timeout"
    (tmp_path / "stderr.log").write_text("".join(f"line {i}\n" for i in range(40)) + "ValueError: boom\n")
    status, reason, metrics = classify(1, False, tmp_path, 30)
    assert status == "failed" and reason.endswith("ValueError: boom") and "line 20" not in reason and metrics == {}
    assert classify(0, False, tmp_path, 30)[0] == "incomplete"
    (tmp_path / "rank1.json").write_text(json.dumps({"status": "oom", "peak_memory_bytes": 900, "memory_limit_bytes": 800, "reason": "over"}))
    assert classify(1, False, tmp_path, 30) == ("oom", "over", {"peak_memory_bytes": 900, "memory_limit_bytes": 800})
    (tmp_path / "rank1.json").unlink()
    assert classify(probe.OOM_EXIT_CODE, False, tmp_path, 30)[0] == "oom"
    (tmp_path / "metrics.json").write_text(json.dumps({"throughput": 5.0}))
    assert classify(0, False, tmp_path, 30) == ("ok", "", {"throughput": 5.0})


# ---------- real launches: 2 CPU ranks, tiny model ----------

def tiny_num_params(vocab=256, hidden=32, seq=32, layers=1):
    h = hidden
    block = 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (4 * h * h + 4 * h) + (4 * h * h + h)
    return vocab * h + seq * h + layers * block + 2 * h  # the head is tied to the token embedding


@pytest.mark.e2e
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_zero_stage_is_measured(stage, tiny_experiment, tmp_path, leftovers):
    with socket.socket() as busy:  # the configured master port is taken: the experiment gets a port from the OS
        busy.bind(("", 0))
        busy.listen()
        base_port = busy.getsockname()[1]
        exp = tiny_experiment(name=f"z{stage}_gas2_tmbspg3", stage=stage, mbs=3, gas=2,
                              script_args=["--deepspeed_config", "user.json", "--per_device_train_batch_size", "1",
                                           "--num_layers", "1", "--hidden_size", "32", "--num_heads", "2",
                                           "--seq_len", "32", "--vocab_size", "256"])
        exp.resources.master_port = base_port
        cpu_cache = Path(cpu_features.cache_file())  # the ranks' op loading asks py-cpuinfo through it
        cpu_cache.unlink(missing_ok=True)
        result = run_experiment(exp, tmp_path)

    assert result.status == "ok", result.reason
    d = Path(result.exp_dir)
    for name in ("cmd.txt", "ds_config.json", "exp.json", "metrics.json", "stdout.log", "stderr.log"):
        assert (d / name).is_file(), name
    assert json.loads((d / "ds_config.json").read_text()) == exp.ds_config
    assert json.loads((d / "exp.json").read_text())["master_port"] != base_port
    assert "--module mlautotune.run.probe" in (d / "cmd.txt").read_text()
    # arg_mappings reached the script: it parsed the experiment's values, not the user's --per_device_train_batch_size 1
    assert (d / "stdout.log").read_text().count("gpt.py flags: per_device_train_batch_size=3 gradient_accumulation_steps=2") == 2

    m = result.metrics
    assert m == json.loads((d / "metrics.json").read_text())
    assert (m["train_batch_size"], m["micro_batch"], m["gas"], m["world_size"]) == (12, 3, 2, 2)
    assert m["throughput"] > 0 and m["FLOPS_per_gpu"] > 0 and m["peak_memory_bytes"] > 50 * 2**20
    assert m["latency"] * m["throughput"] / 1000 == pytest.approx(m["train_batch_size"])
    assert len(m["step_times_ms"]) == m["measured_steps"] >= exp.end_profile_step - exp.start_profile_step + 1  # the minimum window
    assert m["first_measured_step"] == exp.start_profile_step + m["warmup_steps"]
    assert m["interval_rel"] > 0 and isinstance(m["disturbed"], bool) and m["threads_per_rank"] >= 1
    assert m["step_time_min_ms"] <= m["step_time_median_ms"] == m["latency"] <= m["step_time_max_ms"]
    assert m["num_params"] == m["trainable_num_params"] == tiny_num_params()  # ZeRO-3 partitions counted in full
    timeline = json.loads((d / "rank0.json").read_text())["timeline"]
    assert result.returncode == 0 and result.wall_time_s >= timeline["window_end"] - timeline["launch"] > 0  # measured, and consistent
    assert json.loads(cpu_cache.read_text())["arch"]
    assert leftovers(str(d)) == []


@pytest.mark.e2e
def test_a_tuning_experiments_ranks_are_forks_that_see_what_new_interpreters_would(tiny_experiment, tmp_path, leftovers):
    """On CPU a tuning experiment's ranks are forks of the runner server (their import of torch and
    DeepSpeed saved); the final training's are new interpreters. Both see the same path, threads and
    arguments, and the forks' random states differ."""
    views = {}
    for forked in (True, False):
        out = tmp_path / f"views_{forked}"
        out.mkdir()
        exp = tiny_experiment(name=f"view_{forked}", script=SCRIPTS / "rank_view.py", script_args=[], stop_after_window=forked,
                              env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp_path / "extra"), "VIEW_DIR": str(out)})
        result = run_experiment(exp, tmp_path)
        assert result.status == "incomplete", result.reason  # it ends before any step
        assert [json.loads((Path(result.exp_dir) / f"rank{r}.json").read_text())["forked"] for r in (0, 1)] == [forked] * 2
        views[forked] = [json.loads((out / f"view{r}.json").read_text()) for r in (0, 1)]
        assert leftovers(result.exp_dir) == []
    for fork, new in zip(views[True], views[False]):
        assert fork["path"] == new["path"] and str(tmp_path / "extra") in fork["path"]
        assert fork["threads"] == new["threads"] == 1 and fork["omp"] == "1"
        assert [a.replace("view_True", "view_False") for a in fork["argv"]] == new["argv"] and fork["name"] == new["name"] == "__main__"
    assert views[True][0]["numpy_random"] != views[True][1]["numpy_random"]


@pytest.mark.e2e
def test_a_forked_ranks_peak_memory_counts_what_a_new_rank_would(tiny_experiment, tmp_path):
    """A fork starts with ~200 MB of torch's library pages uncounted in its RSS (16% of this model's
    peak at micro-batch 4, seen here); the probe adds the ones it has not touched (within 3% of a new
    rank's peak, seen here; RSS itself varies by about that much from run to run)."""
    peaks, uncounted = {}, {}
    for forked in (True, False):
        exp = tiny_experiment(name=f"mem_{forked}", mbs=4, stop_after_window=forked,
                              script_args=["--num_layers", "4", "--hidden_size", "256", "--seq_len", "128", "--steps", "8"])
        exp.resources = Resources(num_gpus=1)
        result = run_experiment(exp, tmp_path)
        assert result.status == "ok", result.reason
        peaks[forked] = result.metrics["peak_memory_bytes"]
        uncounted[forked] = json.loads((Path(result.exp_dir) / "rank0.json").read_text())["uncounted_bytes"]
    assert uncounted[False] == 0 and uncounted[True] > 50 * 2**20
    assert peaks[True] == pytest.approx(peaks[False], rel=0.06), peaks


@pytest.mark.e2e
def test_memory_over_the_limit_is_oom(tiny_experiment, tmp_path, leftovers):
    # The default model at micro-batch 64 peaks near 1.3 GB per rank; start-up alone stays under 0.65 GB.
    limit = 900 * 2**20
    result = run_experiment(tiny_experiment(mbs=64, script_args=[], memory_limit_bytes=limit), tmp_path)
    assert result.status == "oom" and result.returncode == probe.OOM_EXIT_CODE
    assert result.metrics["peak_memory_bytes"] > limit == result.metrics["memory_limit_bytes"]
    assert "over the limit" in result.reason
    ranks = [json.loads(p.read_text()) for p in Path(result.exp_dir).glob("rank*.json")]
    assert any(r["status"] == "oom" and "first_forward" in r["timeline"] for r in ranks)  # hit while training
    assert not (Path(result.exp_dir) / "metrics.json").exists()
    assert leftovers(result.exp_dir) == []


@pytest.mark.e2e
def test_a_script_that_raises_is_failed_with_its_message(tiny_experiment, tmp_path, leftovers):
    result = run_experiment(tiny_experiment(script=SCRIPTS / "raise_error.py", script_args=[]), tmp_path)
    assert result.status == "failed"
    assert result.reason.splitlines()[0].endswith(": ValueError: tiny script failed on purpose: code 4242")  # headline
    assert result.reason.rstrip().endswith("ValueError: tiny script failed on purpose: code 4242")  # stderr's last lines
    assert result.returncode not in (0, probe.OOM_EXIT_CODE)
    assert leftovers(result.exp_dir) == []


@pytest.mark.e2e
def test_a_hung_script_times_out_and_leaves_no_process(tiny_experiment, tmp_path, leftovers):
    marker = tmp_path / "started"
    exp = tiny_experiment(script=SCRIPTS / "sleep_forever.py", script_args=["--marker", str(marker)], timeout_s=30.0)  # start-up (~10 s, on CPU) fits on a busy machine
    result = run_experiment(exp, tmp_path)
    assert result.status == "timeout" and "30 s" in result.reason and result.wall_time_s >= exp.timeout_s
    host, port, token = json.loads((Path(result.exp_dir) / "probe.json").read_text())["lifeline"]  # for ranks on other hosts
    assert host == socket.gethostname() and port > 0 and token
    rank_pids = [int(p.read_text()) for p in tmp_path.glob("started.*")]
    assert len(rank_pids) == 2  # both ranks were inside the script when the group was killed
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in rank_pids)
    assert leftovers(result.exp_dir) == []


@pytest.mark.e2e
def test_a_script_that_ends_before_the_window_is_incomplete(tiny_experiment, tmp_path, leftovers):
    exp = tiny_experiment(script_args=["--steps", "2", "--num_layers", "1", "--hidden_size", "32", "--vocab_size", "256"])
    result = run_experiment(exp, tmp_path)
    assert result.status == "incomplete" and result.returncode == 0
    assert "after 2 optimizer steps" in result.reason
    assert not (Path(result.exp_dir) / "metrics.json").exists()
    assert leftovers(result.exp_dir) == []


@pytest.mark.e2e
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_stopped_or_killed_tuner_leaves_no_training_process(sig, tmp_path, leftovers):
    """SIGTERM: the runner kills the group and re-raises. SIGKILL: the probe's watchdog in the ranks ends the group."""
    marker = tmp_path / "started"
    tuner = subprocess.Popen([sys.executable, str(SCRIPTS / "tuner_running_a_hung_experiment.py"), str(tmp_path), str(marker)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 90
    while len(list(tmp_path.glob("started.*"))) < 2 and time.time() < deadline and tuner.poll() is None:
        time.sleep(0.2)
    assert len(list(tmp_path.glob("started.*"))) == 2, tuner.stderr.read().decode()[-2000:]
    tuner.send_signal(sig)
    assert tuner.wait(timeout=30) == (128 + sig if sig == signal.SIGTERM else -sig)
    deadline = time.time() + 10  # the watchdog looks for the tuner once a second
    while leftovers(str(tmp_path / "hung")) and time.time() < deadline:
        time.sleep(0.2)
    assert leftovers(str(tmp_path / "hung")) == []


@pytest.mark.e2e
def test_a_lock_left_by_a_rank_killed_while_loading_an_op_does_not_hang_the_next_experiment(tiny_experiment, tmp_path, leftovers, monkeypatch):
    """Every rank takes torch's build lock for a moment when it loads a DeepSpeed op, even a built one.
    A worker SIGKILLed in that moment left the lock behind, and every later experiment on the machine
    waited on it until its timeout (seen in the workers test). The experiment's wait removes it once stale."""
    from torch.utils.cpp_extension import _get_build_directory

    from mlautotune.run import ops

    monkeypatch.setattr(ops, "STALE_LOCK_SWEEP_S", 1.0)
    lock = Path(_get_build_directory("deepspeed_shm_comm", verbose=False)) / "lock"
    lock.touch()
    os.utime(lock, (time.time() - 3600, time.time() - 3600))  # older than the grace, and held by nobody
    try:
        result = run_experiment(tiny_experiment(timeout_s=120.0), tmp_path)
    finally:
        left = lock.exists()
        lock.unlink(missing_ok=True)
    assert result.status == "ok", result.reason
    assert not left and "left by a DeepSpeed op build that was killed" in (Path(result.exp_dir) / "launches.log").read_text()
    assert leftovers(result.exp_dir) == []
