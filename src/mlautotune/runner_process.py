"""The process that runs DeepSpeed's launcher (`deepspeed.launcher.runner`) for one experiment.

`python -m deepspeed.launcher.runner ...` spends ~4 s importing torch and DeepSpeed before it reads
its arguments, and the `python -u -m deepspeed.launcher.launch ...` it starts on the node spends
~6 s more: half of a small experiment on CPU. On the CPU accelerator the runner runs instead in a
fork of a server process that imported both once (`python -m mlautotune.runner_process`, started
with the session): the same `runner.main(argv)` on the same arguments, environment, working
folder, output files and new process group as the command, without the import. A single-node
runner starts its launch.py the same way, as a fork of itself running `launch.main()` with the
command's arguments and environment (`ForkedLaunch`); remote launches (pdsh, MPI, Slurm) are
started as commands. The ranks are always new processes. The server reports each child's exit
code; it ends when the tuner does (its requests pipe closes).

Device runtimes (CUDA and the others) are not fork-safe, so on an accelerator the command is
started as a new process; there an experiment's minutes make the 10 s small.
"""

import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import traceback
from typing import Any, Dict, List, Optional, Union

from mlautotune.ops import accelerator_name

RUNNER_MODULE = "deepspeed.launcher.runner"
RUNNER_COMMAND = [sys.executable, "-u", "-m", RUNNER_MODULE]
LAUNCH_MODULE = "deepspeed.launcher.launch"
LAUNCH_COMMAND = [sys.executable, "-u", "-m", LAUNCH_MODULE]  # as runner.py builds it for the local node
START_TIMEOUT_S = 120.0  # the server's import included

_server: Optional["Server"] = None
_server_lock = threading.Lock()


def start(cmd: List[str], stdout: str, stderr: str, env: Dict[str, str]) -> "Process":
    """Start `cmd` in a new process group, stdin from /dev/null and its output appended to the two
    files; the runner command as a fork of the preloaded server on CPU."""
    server = _cpu_server() if cmd[:len(RUNNER_COMMAND)] == RUNNER_COMMAND else None
    if server is not None:
        pid = server.fork({"argv": cmd[len(RUNNER_COMMAND):], "stdout": stdout, "stderr": stderr, "env": env, "cwd": os.getcwd()})
        if pid is not None:
            return ForkedRunner(server, pid, cmd)
    with open(stdout, "a") as out, open(stderr, "a") as err:
        return subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True, env=env)


def warm() -> None:
    """Start the server now, so that its import overlaps what the tuner does before its first
    experiment (the ops check, MLflow, the study) instead of delaying that experiment."""
    _cpu_server()


def _cpu_server() -> Optional["Server"]:
    global _server
    with _server_lock:
        if _server is None or not _server.alive():
            _server = Server() if accelerator_name() == "cpu" else None
        return _server


class Server:
    """The tuner's side of the server: one request at a time, exit codes read by a thread."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, start_new_session=True)  # no terminal signals: it ends with its pipe
        self.lock = threading.Lock()
        self.started: "queue.Queue[int]" = queue.Queue()
        self.exits: Dict[int, int] = {}
        self.changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True, name="runner-server").start()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read(self) -> None:
        for line in self.proc.stdout:
            message = json.loads(line)
            if "started" in message:
                self.started.put(message["started"])
            else:
                with self.changed:
                    self.exits[message["pid"]] = message["code"]
                    self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def fork(self, request: Dict[str, Any]) -> Optional[int]:
        """The child's pid, or None if the server is gone (the caller starts a process instead)."""
        with self.lock:
            try:
                self.proc.stdin.write(json.dumps(request).encode() + b"\n")
                self.proc.stdin.flush()
                pid = self.started.get(timeout=START_TIMEOUT_S)
            except (OSError, queue.Empty):
                return None
            with self.changed:
                self.exits.pop(pid, None)  # a reused pid's old exit
            return pid

    def wait(self, pid: int, timeout: Optional[float]) -> Optional[int]:
        with self.changed:
            self.changed.wait_for(lambda: pid in self.exits or not self.alive(), timeout)
            if pid not in self.exits and not self.alive() and not _exists(pid):
                self.exits[pid] = 1  # the server died before it could say: the exit code is lost
            return self.exits.get(pid)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


class ForkedRunner:
    """A runner forked by the server, with the part of `subprocess.Popen` that experiment.py uses."""

    def __init__(self, server: Server, pid: int, cmd: List[str]):
        self.server, self.pid, self.args = server, pid, cmd

    @property
    def returncode(self) -> Optional[int]:
        return self.server.wait(self.pid, 0)

    def poll(self) -> Optional[int]:
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        code = self.server.wait(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def terminate(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


Process = Union[subprocess.Popen, ForkedRunner]


# ---- the server --------------------------------------------------------------------------------------
def serve() -> None:
    """Import the runner, then fork a runner per request line on stdin; report on the original stdout
    {"started": pid} and, once reaped, {"pid": pid, "code": exit code}. Ends when stdin closes."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):  # DeepSpeed logs its accelerator on import
        os.dup2(devnull, fd)
    os.close(devnull)
    from deepspeed.launcher import launch, runner  # noqa: F401  the imports the children share

    wake_r, wake_w = os.pipe()
    for fd in (wake_r, wake_w):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    pending = b""
    while True:
        ready = select.select([0, wake_r], [], [])[0]
        if wake_r in ready:
            while os.read(wake_r, 512) == 512:
                pass
            _reap(replies)
        if 0 in ready:
            data = os.read(0, 1 << 16)
            if not data:
                return  # the tuner is gone
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                pid = os.fork()
                if pid == 0:
                    _child(json.loads(line), [replies.fileno(), wake_r, wake_w])
                replies.write(json.dumps({"started": pid}) + "\n")
            _reap(replies)


def _reap(replies) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        replies.write(json.dumps({"pid": pid, "code": os.waitstatus_to_exitcode(status)}) + "\n")


def _child(request: Dict[str, Any], server_fds: List[int]) -> None:
    """What starting `python -u -m deepspeed.launcher.runner argv` would have set up, then the runner; never returns."""
    def setup() -> None:
        for fd in server_fds:
            os.close(fd)
        os.setsid()
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_APPEND | os.O_CREAT),
                                (2, request["stderr"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)):
            opened = os.open(path, flags, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(write_through=True)  # -u
        os.chdir(request["cwd"])

    def run() -> None:
        from deepspeed.launcher import runner

        runner.subprocess = _ForkingLaunches()  # the runner's `subprocess.Popen(launch command)` forks it instead
        runner.main(request["argv"])

    _run_module(RUNNER_MODULE, request["argv"], request["env"], run, setup)


def _run_module(module: str, argv: List[str], env: Dict[str, str], run, setup=None) -> None:
    """In a forked child: the state `python -u -m module argv` would start with, `setup()`, then
    `run()`; exits with the code that process would have had, never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if setup is not None:
            setup()
        os.environ.clear()
        os.environ.update(env)
        sys.argv = [module, *argv]
        run()
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


class _ForkingLaunches:
    """`subprocess` as runner.py sees it in a forked runner: its local launch command becomes a fork."""

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)

    @staticmethod
    def Popen(cmd, *args, **kwargs):
        if list(cmd[:len(LAUNCH_COMMAND)]) == LAUNCH_COMMAND and not args and set(kwargs) <= {"env"}:
            return ForkedLaunch(list(cmd[len(LAUNCH_COMMAND):]), kwargs.get("env") or dict(os.environ))
        return subprocess.Popen(cmd, *args, **kwargs)


def _launch_main() -> None:
    from deepspeed.launcher import launch

    launch.main()


class ForkedLaunch:
    """launch.py forked from the runner (which has imported it), with the part of `subprocess.Popen`
    that runner.py uses (pid, wait, returncode; send_signal for a multi-node pdsh launch, never forked)."""

    def __init__(self, argv: List[str], env: Dict[str, str]):
        self.returncode: Optional[int] = None
        self.pid = os.fork()
        if self.pid == 0:
            _run_module(LAUNCH_MODULE, argv, env, _launch_main)  # never returns: not even an error goes on in the runner's code

    def _reaped(self, flags: int) -> Optional[int]:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, flags)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> Optional[int]:
        return self._reaped(os.WNOHANG)

    def wait(self) -> int:
        return self._reaped(0)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)


if __name__ == "__main__":
    serve()
