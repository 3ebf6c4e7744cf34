"""The process that runs DeepSpeed's launcher (`deepspeed.launcher.runner`) for one experiment.

`python -m deepspeed.launcher.runner ...` spends ~4 s importing torch and DeepSpeed before it reads
its arguments, and the `python -u -m deepspeed.launcher.launch ...` it starts on the node spends
~6 s more: half of a small experiment on CPU. On the CPU accelerator the runner runs instead in a
fork of a server process that imported both once (`python -m mlautotune.run.runner_process`, started
with the session): the same `runner.main(argv)` on the same arguments, environment, working
folder, output files and new process group as the command, without the import. A single-node
runner starts its launch.py the same way, as a fork of itself running `launch.main()` with the
command's arguments and environment (`Forked`); remote launches (pdsh, MPI, Slurm) are
started as commands. In a tuning experiment (`fork_ranks`) launch.py starts its ranks the same
way: a rank's `python -u -m mlautotune.run.probe ...` becomes a fork of launch.py running the probe,
with the path, threads and random state a new interpreter would have (`_rank_main`), which saves
the ranks' own import of torch and DeepSpeed (~6 s of a 10-16 s experiment). A rank whose
environment differs from the server's in what is read only when a process starts (LD_PRELOAD, the
allocator's and OpenMP's variables, PYTHON*, ...: `_forkable`) is started as a command, and so is
the final training, which runs the user's script to its own end. The server reports each child's
exit code; it ends when the tuner does (its requests pipe closes).

Device runtimes (CUDA and the others) are not fork-safe, so on an accelerator the command is
started as a new process; there an experiment's minutes make the 10 s small.
"""

import atexit
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

from mlautotune.run.measure import resident_file_pages
from mlautotune.run.ops import accelerator_name

RUNNER_MODULE = "deepspeed.launcher.runner"
RUNNER_COMMAND = [sys.executable, "-u", "-m", RUNNER_MODULE]
LAUNCH_MODULE = "deepspeed.launcher.launch"
LAUNCH_COMMAND = [sys.executable, "-u", "-m", LAUNCH_MODULE]  # as runner.py builds it for the local node
RANK_MODULE = "mlautotune.run.probe"
RANK_COMMAND = [sys.executable, "-u", "-m", RANK_MODULE]  # as launch.py builds a rank's command with --module
# read when a process starts (the loader, the allocator, OpenMP and MKL at their load, the interpreter):
# a rank whose value differs from the server's cannot be a fork of it
START_VARIABLES = ("LD_", "PYTHON", "MALLOC", "KMP_", "GOMP_", "OMP_", "MKL_", "DNNL_", "ONEDNN_", "TORCH_", "DS_ACCELERATOR")
SET_BY_IMPORT = {"KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK"}  # os.environ.setdefault in scikit-learn's import (DeepSpeed imports it): a new rank sets them too
SET_IN_FORK = {"PYTHONPATH", "PYTHONUNBUFFERED", "OMP_NUM_THREADS", "TORCH_EXTENSIONS_DIR"}  # see _rank_main
START_TIMEOUT_S = 120.0  # the server's import included

_server: Optional["Server"] = None
_server_lock = threading.Lock()


def start(cmd: List[str], stdout: str, stderr: str, env: Dict[str, str], fork_ranks: bool = False,
          accelerator: Optional[str] = None) -> "Process":
    """Start `cmd` in a new process group, stdin from /dev/null and its output appended to the two
    files; the runner command as a fork of the preloaded server on CPU, and with `fork_ranks` (a
    tuning experiment, which the probe ends after its window) its local ranks as forks too.
    `accelerator`: DeepSpeed's accelerator name (default: this process's); any but "cpu" gets a new process."""
    forks = (accelerator or accelerator_name()) == "cpu"
    server = _cpu_server() if forks and cmd[:len(RUNNER_COMMAND)] == RUNNER_COMMAND else None
    if server is not None:
        pid = server.fork({"argv": cmd[len(RUNNER_COMMAND):], "stdout": stdout, "stderr": stderr, "env": env, "cwd": os.getcwd(),
                           "fork_ranks": fork_ranks})
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
    global _SERVER_ENV, _SERVER_FILE_PAGES, _BASE_PATH
    own = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    _BASE_PATH = [p for p in sys.path[1:] if os.path.abspath(p) not in own]  # without the server's folder and PYTHONPATH
    from deepspeed.launcher import launch, runner  # noqa: F401  the imports the children share

    _SERVER_ENV = dict(os.environ)
    _SERVER_FILE_PAGES = resident_file_pages()

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

        runner.subprocess = _Forking(LAUNCH_COMMAND, lambda: _launch_main(request.get("fork_ranks", False)))  # launch.py: a fork
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


class _Forking:
    """`subprocess` as runner.py or launch.py sees it in a fork: `command ...` becomes a fork of this
    process running `run()` on the arguments and environment it was given (or a command as before)."""

    def __init__(self, command: List[str], run, forkable=lambda env: True):
        self.command, self.run, self.forkable = command, run, forkable

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)

    def Popen(self, cmd, *args, **kwargs):
        env = kwargs.get("env") or dict(os.environ)
        if list(cmd[:len(self.command)]) == self.command and not args and set(kwargs) <= {"env"} and self.forkable(env):
            return Forked(self.command[-1], list(cmd[len(self.command):]), env, self.run)
        return subprocess.Popen(cmd, *args, **kwargs)


def _launch_main(fork_ranks: bool) -> None:
    from deepspeed.launcher import launch

    if fork_ranks:
        launch.subprocess = _Forking(RANK_COMMAND, _rank_main, _forkable)
    launch.main()


_SERVER_ENV: Dict[str, str] = {}  # the server's environment after its import (serve)
_SERVER_FILE_PAGES: Dict[str, int] = {}  # and its resident file pages then, as a new rank's after the same import
_BASE_PATH: List[str] = []  # its sys.path without what the folder and PYTHONPATH added


def _forkable(env: Dict[str, str]) -> bool:
    """A rank with this environment can be a fork of the server: nothing read at a process's start differs."""
    return not [k for k in set(env) | set(_SERVER_ENV) if k.startswith(START_VARIABLES) and k not in SET_IN_FORK
                and env.get(k) != _SERVER_ENV.get(k) and not (k in SET_BY_IMPORT and k not in env)]


def _rank_main() -> None:
    """A rank, as `python -u -m mlautotune.run.probe argv` would start: sys.path from its folder and
    PYTHONPATH, torch's threads from OMP_NUM_THREADS (OpenMP read the server's at its load), numpy's
    global random state reseeded (Python's own is, at every fork); at the end what an interpreter's
    exit runs: its non-daemon threads joined and the atexit functions. Its peak RSS counts the library
    pages a new interpreter would have (probe.PARENT_FILE_PAGES)."""
    sys.path[:] = [os.getcwd(), *(os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p), *_BASE_PATH]
    import numpy
    import torch

    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    numpy.random.seed()
    from mlautotune.run import probe

    probe.PARENT_FILE_PAGES = _SERVER_FILE_PAGES
    try:
        probe.main(sys.argv[1:])
    finally:
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()


class Forked:
    """`module argv` in a fork of this process (which has imported what it needs), with the part of
    `subprocess.Popen` that runner.py and launch.py use: pid, poll, wait, returncode; send_signal
    (runner.py's, for a multi-node pdsh launch, which is never forked)."""

    def __init__(self, module: str, argv: List[str], env: Dict[str, str], run):
        self.returncode: Optional[int] = None
        self.pid = os.fork()
        if self.pid == 0:
            _run_module(module, argv, env, run)  # never returns: not even an error goes on in the parent's code

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
