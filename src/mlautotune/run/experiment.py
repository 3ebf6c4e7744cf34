"""Run one experiment through the DeepSpeed launcher and measure it. The only module that starts experiments.

Each experiment is `python -m deepspeed.launcher.runner <resources> --module mlautotune.run.probe <exp_dir>
<script> <args>` in its own process group (started by runner_process: on CPU, the runner forked from
a process that has imported it); the probe in every rank writes metrics.json. The outcome
comes from the exit code, the probe's per-rank records and the clock, never from the logs' wording.
"""

import os
import shlex
import signal
import socket
import subprocess
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from mlautotune.redact import redact, redact_args
from mlautotune.run import cpu_features, failures, logs, ops, probe, runner_process
from mlautotune.inputs.config import MeasureConf, Resources
from mlautotune.errors import UserError
from mlautotune.files import atomic_write_json, atomic_write_text, inside, read_json
from mlautotune.run.lifeline import EXPERIMENT_MARK, end_strays, group_members, release_shared_memory, tuner_lifeline
from mlautotune.inputs.scriptargs import set_deepspeed_config, set_flag
from mlautotune.inputs.space import CHECKPOINTING_KEY

STATUSES = ("ok", "oom", "timeout", "failed", "incomplete")


@dataclass
class Experiment:
    name: str  # z{stage}_gas{gas}_tmbspg{mbs}[_<knob codes>]
    ds_config: Dict[str, Any]  # complete, concrete, no autotuning section
    script: str
    script_args: List[str]
    resources: Resources
    params: Dict[str, Any]  # the tuned values: stage, micro_batch, gas and every tuned knob (flat)
    arg_mappings: Dict[str, str] = field(default_factory=dict)
    start_profile_step: int = 3
    end_profile_step: int = 5
    memory_limit_bytes: Optional[int] = None
    timeout_s: float = 900.0
    stop_after_window: bool = True  # False: measure the window, then let the script train to its end (mode=run)
    env: Dict[str, str] = field(default_factory=dict)  # added to the launcher's environment (threads, MLflow run id, ...)
    measure: Dict[str, Any] = field(default_factory=lambda: asdict(MeasureConf()))  # the probe's window settings (conf measure.*)


@dataclass
class Result:
    name: str
    status: str  # one of STATUSES
    metrics: Dict[str, Any] = field(default_factory=dict)  # metrics.json content (ok), else what was measured
    reason: str = ""  # empty for ok; the error's last lines or what happened otherwise
    wall_time_s: float = 0.0
    exp_dir: str = ""
    returncode: Optional[int] = None

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Result":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


DEFAULT_HOSTFILE = "/job/hostfile"  # the DeepSpeed launcher's default (deepspeed.launcher.constants)
STDERR_TAIL_LINES = 20
POLL_S = 0.25
_ports_lock = threading.Lock()
_ports_in_use: set = set()  # ports of experiments running in this process (parallel runs)


def world_size(resources: Resources) -> int:
    """The number of ranks the DeepSpeed launcher will start for these resources."""
    from deepspeed.launcher.runner import apply_num_nodes_and_gpus, fetch_hostfile, parse_inclusion_exclusion

    r = resources
    hostfile = r.hostfile or DEFAULT_HOSTFILE
    if r.hostfile and not os.path.isfile(hostfile):
        raise UserError(f"The hostfile {hostfile} does not exist.",
                        "Fix launcher.hostfile, or drop it to run on this machine only.")
    if (r.num_nodes is not None or r.num_gpus is not None) and (r.include or r.exclude):
        raise UserError("launcher.num_nodes/num_gpus cannot be combined with launcher.include/exclude "
                        "(the DeepSpeed launcher refuses it).", "Use either num_nodes/num_gpus or include/exclude.")
    try:
        pool = fetch_hostfile(hostfile) if os.path.isfile(hostfile) else None
        if not pool:
            if (r.num_nodes or 1) > 1:
                raise UserError(f"launcher.num_nodes={r.num_nodes} needs a hostfile listing the nodes.",
                                "Set launcher.hostfile.")
            from deepspeed.accelerator import get_accelerator

            pool = {"localhost": get_accelerator().device_count()}
        active = parse_inclusion_exclusion(pool, r.include or "", r.exclude or "")
    except ValueError as e:
        raise UserError(f"The launcher resources are not valid: {e}.", "Fix launcher.hostfile/include/exclude.") from e
    active = apply_num_nodes_and_gpus(active, r.num_nodes or -1, r.num_gpus or -1)
    n = sum(len(slots) for slots in active.values())
    if n < 1:
        raise UserError("The launcher resources select no device at all.", "Check launcher.include/exclude and the hostfile.")
    return n


def lookup(config: Dict[str, Any], key: str) -> Any:
    """A ds_config value by key, searched depth-first like DeepSpeed's get_val_by_key; None when absent."""
    if key in config:
        return config[key]
    for v in config.values():
        if isinstance(v, dict) and (found := lookup(v, key)) is not None:
            return found
    return None


def experiment_args(exp: Experiment, ds_config_path: str) -> List[str]:
    """The script's arguments for this experiment: its ds_config, and the arg_mappings flags set to its values."""
    args = set_deepspeed_config(list(exp.script_args), ds_config_path)
    for key, flag in exp.arg_mappings.items():
        if key.strip() == CHECKPOINTING_KEY:  # a tuned switch of the script's, not a ds_config value: set when on
            if exp.params.get(CHECKPOINTING_KEY):
                args = set_flag(args, flag.strip(), "true")
            continue
        value = lookup(exp.ds_config, key.strip())
        if value is not None and value != "auto":
            args = set_flag(args, flag.strip(), str(value))
    return args


def plain_command(exp: Experiment, ds_config_path: str) -> List[str]:
    """The command a user would type to train with this experiment's config: `deepspeed <launcher flags> script <args>`.
    The same builder as the experiment's own launch (cmd_optimal.txt, exp.json's plain_cmd, the final training)."""
    return launch_command(exp, Path(ds_config_path).parent, 0, experiment_args(exp, ds_config_path), probed=False)


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT left by our own ranks is no clash
        try:
            s.bind(("", port))
            return True
        except OSError:
            return False


def reserve_port(preferred: Optional[int] = None) -> int:
    """A master port: `preferred` (launcher.master_port) on the first attempt if set and free, else
    one the OS hands out (bind to port 0), never one a running experiment of ours holds."""
    with _ports_lock:
        # A taken preferred port is not tried: ranks connecting to a stranger's listener can hang
        # until the experiment's timeout instead of failing.
        port = preferred if preferred is not None and port_is_free(preferred) else None
        while port is None or port in _ports_in_use:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
        _ports_in_use.add(port)
        return port


def launch_command(exp: Experiment, exp_dir: Path, port: int, args: List[str], probed: bool = True) -> List[str]:
    """The DeepSpeed launcher command; `probed=False` gives the plain command a user would type for this config."""
    r = exp.resources
    cmd = list(runner_process.RUNNER_COMMAND) if probed else ["deepspeed"]
    launcher = r.launcher if r.launcher != Resources.launcher else None  # DeepSpeed's default (pdsh) goes without saying
    for flag, value in (("--hostfile", r.hostfile), ("--num_nodes", r.num_nodes), ("--num_gpus", r.num_gpus),
                        ("--include", r.include), ("--exclude", r.exclude), ("--launcher", launcher)):
        if value not in (None, ""):
            cmd += [flag, str(value)]
    cmd += list(r.launcher_args)  # further DeepSpeed launcher flags, e.g. --no_ssh, --bind_cores_to_rank
    if not probed:  # the user's own port, if they chose one (experiments take free ports from it)
        port_flag = ["--master_port", str(r.master_port)] if r.master_port != Resources.master_port else []
        return cmd + port_flag + [exp.script, *args]
    return cmd + ["--master_port", str(port), "--module", "mlautotune.run.probe", str(exp_dir), exp.script, *args]


def _end_group(proc: runner_process.Process, graceful: bool) -> None:
    """Kill the experiment's whole process group; with a hostfile, let the launcher stop remote ranks first."""
    if graceful and proc.poll() is None:
        proc.terminate()  # the DeepSpeed runner turns SIGTERM into a kill on every node
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        # A runner forked by the server a moment ago may not have made its group yet (setsid comes first
        # in the child, before it starts anything): then it is alone, and killed by its pid.
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    _wait_until_group_gone(proc.pid)


def _wait_until_group_gone(pgid: int, timeout_s: float = 15.0) -> None:
    """SIGKILL is asynchronous: return only once no live process of the group is left (ranks are
    grandchildren, so waiting for the launcher alone is not enough)."""
    deadline = time.monotonic() + timeout_s
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _raise_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def _measured_everywhere(exp_dir: Path) -> bool:
    """True once metrics.json is written and every rank has recorded its measurement and exited.

    The ranks exit right after that record; waiting on the launcher to notice would add ~3 s per
    experiment (its 1 s poll plus two interpreter shutdowns with torch loaded).
    """
    import psutil

    if not (exp_dir / probe.METRICS_FILE).exists():
        return False
    ranks = [r for r in _rank_records(exp_dir) if r.get("status") == "measured"]
    if len(ranks) < read_json(exp_dir / probe.METRICS_FILE).get("world_size", 1):
        return False
    here = socket.gethostname()
    for r in ranks:
        if r.get("host") == here:
            try:
                if psutil.Process(r["pid"]).status() != psutil.STATUS_ZOMBIE:
                    return False
            except psutil.NoSuchProcess:
                pass
    return True


def _wait(proc: runner_process.Process, exp_dir: Path, timeout_s: float, graceful: bool, ds_config: Dict[str, Any]) -> tuple:
    """Wait for the experiment: (timed_out, measured). The group is always killed before returning.
    Meanwhile, a lock left by a rank killed while it loaded an op (another worker's, or a timed-out
    experiment's) is removed once stale: this experiment's ranks would wait on it until the timeout."""
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if in_main else None
    if in_main and previous == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_on_sigterm)  # so SIGTERM unwinds through the cleanup below
    deadline = time.monotonic() + timeout_s
    sweep = time.monotonic() + ops.STALE_LOCK_SWEEP_S
    try:
        while time.monotonic() < deadline:
            try:
                proc.wait(timeout=min(POLL_S, max(0.0, deadline - time.monotonic())))
                return False, False
            except subprocess.TimeoutExpired:
                if _measured_everywhere(exp_dir):
                    return False, True
                if time.monotonic() > sweep:
                    sweep = time.monotonic() + ops.STALE_LOCK_SWEEP_S
                    ops.remove_stale_locks(ds_config, lambda text: _log_launch(exp_dir, text))
        return proc.poll() is None, False
    finally:
        if in_main and previous == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, previous)
        # also on KeyboardInterrupt/SIGTERM, which then propagate; a second Ctrl-C waits for the kill
        interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN) if in_main else None
        try:
            _end_group(proc, graceful)
        finally:
            if in_main:
                signal.signal(signal.SIGINT, interrupt)


def _rank_records(exp_dir: Path) -> List[dict]:
    records = []
    for path in sorted(exp_dir.glob("rank*.json")):
        try:
            records.append(read_json(path))
        except (OSError, ValueError):
            pass
    return records


def _tail(path: Path, lines: int = STDERR_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def classify(returncode: Optional[int], timed_out: bool, exp_dir: Path, timeout_s: float) -> tuple:
    """(status, reason, metrics) from how the launcher ended and what the probe left in exp_dir."""
    ranks = _rank_records(exp_dir)
    metrics_path = exp_dir / probe.METRICS_FILE
    if timed_out:
        return "timeout", f"no result after {timeout_s:g} s; the experiment's process group was killed", {}
    oom = [r for r in ranks if r.get("status") == "oom"]
    if returncode == probe.OOM_EXIT_CODE or oom:
        peak = max((r.get("peak_memory_bytes") or 0 for r in ranks), default=0)
        metrics = {"peak_memory_bytes": peak} if peak else {}
        if oom and oom[0].get("memory_limit_bytes"):
            metrics["memory_limit_bytes"] = oom[0]["memory_limit_bytes"]
        reason = oom[0].get("reason", "") if oom else "a rank ran out of memory"
        return "oom", reason, metrics
    if returncode == 0 and metrics_path.exists():
        return "ok", "", read_json(metrics_path)
    if returncode == 0:
        reasons = [r["reason"] for r in ranks if r.get("reason")]
        return "incomplete", reasons[0] if reasons else "the script ended before the measurement window", {}
    headline = next((f"rank {r.get('rank')}: {r['error']}\n" for r in ranks if r.get("error")), "")
    reason = f"{headline}exit code {returncode}; last lines of stderr.log:\n{_tail(exp_dir / 'stderr.log')}"
    kind = failures.kind_of([*(r.get("error", "") for r in ranks), failures.stderr_end(exp_dir / "stderr.log")])
    if kind == "oom":  # a CUDA or NCCL out-of-memory error the probe did not see (failures.py)
        peak = max((r.get("peak_memory_bytes") or 0 for r in ranks), default=0)
        return "oom", reason, {"peak_memory_bytes": peak} if peak else {}
    return kind or "failed", reason, {}


PORT_ATTEMPTS = 3


def prepare(ds_config: Optional[Dict[str, Any]], say) -> None:
    """Before a process's first experiment: the runner server starts importing (it overlaps what the
    caller does next), DeepSpeed's missing ops are built, and the CPU's features are cached for the
    ranks' op loading, so none of it is paid inside an experiment."""
    runner_process.warm()
    if cpu_features.install():
        import cpuinfo

        cpuinfo.get_cpu_info()
    ops.ensure_built(ds_config, say)


def run_experiment(exp: Experiment, results_dir: Path) -> Result:
    """Launch one experiment, wait for it (at most exp.timeout_s) and say how it ended. Leaves no process behind.

    A launch that failed because its master port was taken meanwhile (a clash: another process
    holds the port once our group is gone) is a launcher failure, not a result: it is launched
    again on a port from the OS, at most PORT_ATTEMPTS times, each launch with the whole timeout."""
    try:
        exp_dir = inside(results_dir, exp.name)
    except ValueError:
        raise UserError(f"The experiment name {exp.name!r} would put its folder outside {results_dir}.", "Rename the ds_config keys that produce it.")
    preferred = exp.resources.master_port
    for attempt in range(PORT_ATTEMPTS):
        result, port = _launch_once(exp, exp_dir, time.time(), preferred if attempt == 0 else None)
        if result.status != "failed" or port_is_free(port):
            break
        _log_launch(exp_dir, f"launch {attempt + 1} failed with master port {port} in use by another process; launching again on another port")
    atomic_write_json(exp_dir / "result.json", result.to_dict())
    return result


def _log_launch(exp_dir: Path, text: str) -> None:
    """A line in the experiment's launches.log: what happened to its launch beside the run itself."""
    with open(exp_dir / "launches.log", "a") as f:
        f.write(text + "\n")


def _launch_once(exp: Experiment, exp_dir: Path, started: float, preferred: Optional[int]) -> tuple:
    exp_dir.mkdir(parents=True, exist_ok=True)
    for stale in [exp_dir / probe.METRICS_FILE, exp_dir / "result.json", *exp_dir.glob("rank*.json")]:
        stale.unlink(missing_ok=True)

    ds_config_path = exp_dir / "ds_config.json"
    # Never DeepSpeed's own autotuning: its engine would stop the run at its own end_profile_step.
    atomic_write_json(ds_config_path, {k: v for k, v in exp.ds_config.items() if k != "autotuning"})
    args = experiment_args(exp, str(ds_config_path))
    port = reserve_port(preferred)
    timeout = exp.timeout_s if exp.timeout_s != float("inf") else None
    token = uuid.uuid4().hex
    try:
        cmd = launch_command(exp, exp_dir, port, args)
        # What is written about the command has its secrets masked (only cmd_optimal.txt must run as it is).
        atomic_write_text(exp_dir / "cmd.txt", shlex.join(redact_args(cmd)) + "\n")
        atomic_write_json(exp_dir / "exp.json", redact({
            "name": exp.name, "params": exp.params, "ds_config": str(ds_config_path), "script": exp.script,
            "plain_cmd": redact_args(plain_command(exp, str(ds_config_path))),
            "script_args": redact_args(args), "user_script_args": redact_args(exp.script_args), "arg_mappings": exp.arg_mappings,
            "resources": asdict(exp.resources), "master_port": port, "start_profile_step": exp.start_profile_step,
            "end_profile_step": exp.end_profile_step, "memory_limit_bytes": exp.memory_limit_bytes, "timeout_s": timeout,
            "measure": exp.measure, "env": exp.env}))
        atomic_write_json(exp_dir / probe.SETTINGS_FILE, {
            "start_profile_step": exp.start_profile_step, "end_profile_step": exp.end_profile_step,
            "memory_limit_bytes": exp.memory_limit_bytes, "stop_after_window": exp.stop_after_window,
            "measure": exp.measure, "tuner_pid": os.getpid(), "tuner_pgid": os.getpgrp(),
            "tuner_create_time": _create_time(), "tuner_host": socket.gethostname(), "launch_time": time.time(),
            "lifeline": [*tuner_lifeline().address, token]})
        for log in ("stdout.log", "stderr.log"):
            atomic_write_text(exp_dir / log, "")
        proc = runner_process.start(cmd, str(exp_dir / "stdout.log"), str(exp_dir / "stderr.log"), {**os.environ, **exp.env, EXPERIMENT_MARK: token},
                                    fork_ranks=exp.stop_after_window)
        budget = max(0.0, exp.timeout_s - (time.time() - started))
        timed_out, measured = _wait(proc, exp_dir, budget, graceful=bool(exp.resources.hostfile), ds_config=exp.ds_config)
    finally:
        tuner_lifeline().cut(token)  # ranks on other hosts end too
        for stray in end_strays(token):  # detached from the group (setsid): found by the mark in its environment
            _log_launch(exp_dir, f"killed {stray}: the experiment had started it and it outlived the experiment's process group")
        release_shared_memory(port)  # what the ranks could not remove themselves (killed, failed)
        with _ports_lock:
            _ports_in_use.discard(port)

    for log in ("stdout.log", "stderr.log"):
        logs.settle(exp_dir / log)
    # Measured everywhere: every rank ended with os._exit(0); only the launcher's shutdown was cut short.
    returncode = 0 if measured else proc.returncode
    status, reason, metrics = classify(returncode, timed_out, exp_dir, exp.timeout_s)
    result = Result(name=exp.name, status=status, metrics=metrics, reason=reason, wall_time_s=time.time() - started,
                    exp_dir=str(exp_dir), returncode=returncode)
    return result, port


def _create_time() -> float:
    import psutil

    return psutil.Process().create_time()
