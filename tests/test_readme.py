"""Every command of the README, run as written.

What runs: every ```bash block of README.md (```text and other blocks are illustrations and are
skipped), each as one bash script (its lines share variables, loops and env files; a line ending in
a backslash continues on the next; `# ...` comments are dropped), in README order, in one copy of
the repository (its git-tracked files, with `.venv` a link to this test's virtualenv), so a block
may use what an earlier one left (a session's results, the MLflow store). The first command that
fails stops its block and fails the test, named, with the block's output. The commands compile no
DeepSpeed op: setup built them once, and the test fails if one was built again while it ran.

What the test changes, and why (none of it changes what a command does):
- the budget: every `tuner_num_trials=N` on a command line, and every `"tuner_num_trials"` in the
  copy's JSON files, becomes 1 (README_NUM_TRIALS), and a ds_config in the copy without one gets it:
  the commands run whole sessions, one experiment each, and the test must stay short;
- servers (`mlflow ui`, `mlflow server`, `optuna-dashboard`) run until their port answers over HTTP,
  then are stopped; their `--port` becomes a free one (other processes on the machine may hold it).

The skip rule (SKIPPED): the parts of a line that set up or test the environment, which the test
itself runs inside of: `bash scripts/setup.sh`, `bash scripts/test.sh`, `. .venv/bin/activate`
(the copy's `.venv` is this environment, and the commands run with its bin/ first on PATH, named by
its own path: through the link, DeepSpeed's sources have other paths than those its ops were built
from, and torch would compile them again in the first experiment) and
`pip install ...`. A command whose program such a skipped install would provide, and that this
environment lacks (`optuna-dashboard` when it is not installed), is skipped and named in the test's
output.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import List, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_NUM_TRIALS = 1
SKIPPED = (re.compile(r"^bash scripts/(setup|test)\.sh\b"), re.compile(r"^(\.|source) \.venv/bin/activate$"), re.compile(r"^(python -m )?pip install\b"))
SERVERS = {"mlflow ui": 5000, "mlflow server": 5000, "optuna-dashboard": 8080}  # program -> its default port


def bash_blocks(markdown: str) -> List[List[str]]:
    """The ```bash blocks, each as its command lines: continuations joined, comments and blank lines dropped."""
    blocks, block, pending = [], None, ""
    for line in markdown.splitlines():
        fence = re.match(r"^\s*```\s*(\S*)", line)
        if fence:
            if block is None:
                block = [] if fence.group(1) == "bash" else False
            else:
                if block:
                    blocks.append(block)
                block = None
            continue
        if block is None or block is False:
            continue
        line = pending + line.strip()
        if line.endswith("\\"):
            pending = line[:-1].rstrip() + " "
            continue
        pending = ""
        command = strip_comment(line).strip()
        if command:
            block.append(command)
    return blocks


def strip_comment(line: str) -> str:
    """The line without a trailing `# ...` comment (a # inside quotes stays)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def runnable(command: str) -> str:
    """The command without its skipped parts (SKIPPED), '' if nothing is left."""
    parts = [p.strip() for p in command.split("&&")]
    return " && ".join(p for p in parts if p and not any(rule.search(p) for rule in SKIPPED))


def with_budget(command: str) -> str:
    return re.sub(r"tuner_num_trials=\d+", f"tuner_num_trials={README_NUM_TRIALS}", command)


def server_of(command: str) -> Tuple[str, int]:
    """(program, default port) when the command starts a server, else ('', 0)."""
    for program, port in SERVERS.items():
        if re.search(rf"(^|[\s/]){re.escape(program)}\b", command):
            return program, port
    return "", 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def budget_the_configs(repo: Path) -> None:
    """tuner_num_trials 2 in every ds_config of the copy (a JSON file with an autotuning section)."""
    for path in repo.rglob("*.json"):
        try:
            data = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(data, dict) and isinstance(data.get("autotuning"), dict):
            data["autotuning"]["tuner_num_trials"] = README_NUM_TRIALS
            path.write_text(json.dumps(data, indent=2) + "\n")


def copy_of_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_symlink() or src.is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, repo / name, follow_symlinks=False)
    (repo / ".venv").symlink_to(Path(sys.prefix))
    budget_the_configs(repo)
    return repo


def serve(command: str, port: int, repo: Path, env: dict) -> str:
    """Start the server, wait until its port answers, stop it; '' when it answered, else its output."""
    command = re.sub(r"--port[ =]\d+", f"--port {port}", command) if "--port" in command else f"{command} --port {port}"
    proc = subprocess.Popen(["bash", "-c", command], cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 600  # mlflow ui takes minutes to start on a loaded machine
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5)
                return ""
            except OSError:
                time.sleep(1)
        return f"did not answer on port {port}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def script_of(block: List[str], path: str) -> Tuple[str, List[str], List[str]]:
    """A block as one bash script (its lines share variables, loops and `.` of env files; the first
    command that fails stops it and is named), its servers (run apart), and the lines skipped because
    their program is not installed here."""
    lines, servers, skipped = [], [], []
    for written in block:
        command = with_budget(runnable(written))
        if not command:
            continue
        program = command.split()[0]
        if re.fullmatch(r"[A-Za-z][\w.-]*", program) and program not in SHELL_WORDS and shutil.which(program, path=path) is None:
            skipped.append(f"{written} ({program} is not installed here: a skipped install provides it)")
        elif server_of(command)[0]:
            servers.append(command)
        else:
            lines.append(command)
    script = "set -eE\ntrap 'echo \"README command failed: $BASH_COMMAND\" >&2' ERR\n" + "\n".join(lines) + "\n"
    return (script if lines else ""), servers, skipped


SHELL_WORDS = {"for", "do", "done", "while", "if", "then", "fi", "else", "wait", "cd", "export", "echo", "set", "true", "test"}


def test_the_parser_reads_bash_blocks_and_skips_the_rest():
    text = "\n".join([
        "```bash", "bash scripts/setup.sh && . .venv/bin/activate && mlautotune plan   # a comment", "bash scripts/test.sh",
        "mlautotune config=x.json \\", "    autotuning.tuner_num_trials=8", "echo 'a # b'", "```",
        "```text", "mlautotune never-run", "```", "```json", "{}", "```",
        "```bash", ".venv/bin/mlflow ui --port 5000", "no-such-program-here --x", "```",
    ])
    blocks = bash_blocks(text)
    assert blocks == [["bash scripts/setup.sh && . .venv/bin/activate && mlautotune plan", "bash scripts/test.sh",
                       "mlautotune config=x.json autotuning.tuner_num_trials=8", "echo 'a # b'"],
                      [".venv/bin/mlflow ui --port 5000", "no-such-program-here --x"]]
    path = f"{Path(sys.prefix) / 'bin'}{os.pathsep}{os.environ['PATH']}"  # as the README's commands run: this environment's bin/ first
    script, servers, skipped = script_of(blocks[0], path)
    assert script.splitlines()[2:] == ["mlautotune plan", f"mlautotune config=x.json autotuning.tuner_num_trials={README_NUM_TRIALS}", "echo 'a # b'"]
    assert not servers and not skipped
    script, servers, skipped = script_of(blocks[1], path)
    assert script == "" and servers == [".venv/bin/mlflow ui --port 5000"] and skipped[0].startswith("no-such-program-here")


@pytest.mark.e2e
def test_every_command_of_the_readme_runs(tmp_path):
    repo = copy_of_repo(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}  # the README's defaults: MLflow's own
    env.update(PATH=f"{Path(sys.prefix) / 'bin'}{os.pathsep}{env['PATH']}", PYTHONPATH=str(repo / "src"))
    built = built_ops()
    blocks = bash_blocks((ROOT / "README.md").read_text())
    assert blocks, "README.md has no ```bash block"
    failures, skipped = [], []
    for i, block in enumerate(blocks):
        script, servers, missing = script_of(block, env["PATH"])
        skipped += missing
        if script:
            (tmp_path / f"block{i}.sh").write_text(script)
            done = subprocess.run(["bash", str(tmp_path / f"block{i}.sh")], cwd=repo, env=env, capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                failures.append(f"block {i + 1} exited {done.returncode}:\n{script}\n{(done.stdout + done.stderr)[-4000:]}")
        for command in servers:
            problem = serve(command, free_port(), repo, env)
            if problem:
                failures.append(f"$ {command}\n{problem}")
    print("skipped: " + "; ".join(skipped) if skipped else "skipped: none")
    assert not failures, "\n\n".join(failures)
    rebuilt = sorted(name for name, stamp in built_ops().items() if built.get(name) != stamp)
    assert not rebuilt, f"the README's commands compiled DeepSpeed ops that setup had built: {rebuilt}"


def built_ops() -> dict:
    """Each op library in torch's extension cache (the one the commands use) -> its modification time."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.glob("**/*.so")}
