"""Side by side with DeepSpeed's own autotuner: `deepspeed --autotuning tune` (the installed package)
and `python -m mlautotune`, one after the other, on the same script, ds_config and space (fast mode,
ZeRO stages 0-3, max_train_batch_size 64 (micro-batch <= 64; each experiment's gradient accumulation fills
64 samples, DeepSpeed's rule and mlautotune's), one CPU rank), then both picks re-measured by the same long
measurement through mlautotune's runner, alternately.

    python benchmarks/versus_deepspeed.py --out /tmp/versus [--workloads bundled,edge] [--repeats 3] [--timeout 3600]

Workloads: src/mlautotune/workloads/gpt.py through gpt_any_config.py (gpt.py opens --deepspeed_config
as a file; DeepSpeed's autotuner passes base64 JSON there), for both tools:
- bundled: its default size (2 layers, hidden 128, seq 128, 0.94M parameters); no memory limit, so
  both tools can go up to micro-batch 64.
- edge: 4 layers, hidden 256, seq 128, with mlautotune's memory_limit_per_rank=1.2GiB, which puts the
  micro-batch edge inside the space (~24 for stages 0-2, ~16 for stage 3 on the development machine).
  DeepSpeed's autotuner cannot be given that limit on CPU: its memory model reads total_memory(),
  all of host RAM, and it only sees a failure when the kernel kills a process or stderr says
  "error". Its nearest equivalent is a micro-batch cap: DeepSpeed gets max_train_micro_batch_size_per_gpu =
  the largest micro-batch mlautotune ran under the limit (so mlautotune runs first on this
  workload), with the same max_train_batch_size as mlautotune. That hands DeepSpeed the edge for
  free, which flatters it.

What DeepSpeed's autotuner needs on CPU, all provided here: one rank (`--num_gpus 1`), MLFLOW_RUN_ID
set when mlflow is installed (defect 1; a run is created in a file store under --out), the
`tabulate` package (pip install tabulate), `deepspeed` on PATH (it launches each experiment with
it), a free --master_port range (it uses --master_port + experiment id; 29500 may be taken). Without
pdsh, its cleanup after each experiment prints a FileNotFoundError traceback from the experiment's
thread (defect 2); the experiment has finished by then, so tuning goes on.

Reported per workload and tool: experiments launched (DeepSpeed's model-info run included;
mlautotune's re-measurements included), tuning wall time, the pick, and the pick's throughput
re-measured by the same long window (--window optimizer steps after 5 warm-up steps, --repeats
times, alternating the two picks), median and spread. Writes --out/versus.json.
"""

import argparse
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from mlautotune.run import ops
from mlautotune.run.experiment import Experiment, Resources, run_experiment
from mlautotune.run.lifeline import SHM_DIR as SHM, release_shared_memory

VENV_BIN = Path(sys.executable).parent
SCRIPT = Path(__file__).with_name("gpt_any_config.py")  # gpt.py, also reading the base64 config DeepSpeed's autotuner passes
ARG_MAPPINGS = {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size", "gradient_accumulation_steps": "--gradient_accumulation_steps"}
WORKLOADS = {
    "bundled": {"args": [], "memory_limit": None},
    "edge": {"args": ["--num_layers", "4", "--hidden_size", "256", "--seq_len", "128"], "memory_limit": "1.2GiB"},
}
MAX_MBS = 64


def ds_config(max_train_batch_size: int, max_micro_batch: Optional[int] = None) -> Dict[str, Any]:
    """One ds_config for both tools: DeepSpeed's own keys only (mlautotune's extras go on its command line);
    `max_micro_batch`: DeepSpeed's max_train_micro_batch_size_per_gpu (the edge mlautotune found)."""
    cap = {} if max_micro_batch is None else {"max_train_micro_batch_size_per_gpu": max_micro_batch}
    return {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": 3e-4}},
        "zero_optimization": {"stage": "all"},
        "autotuning": {"enabled": True, "fast": True, "metric": "throughput", "max_train_batch_size": max_train_batch_size,
                       "start_profile_step": 3, "end_profile_step": 5, "arg_mappings": ARG_MAPPINGS, **cap},
    }


def run_tool(cmd: List[str], cwd: Path, env: Dict[str, str], timeout: float) -> Dict[str, Any]:
    """Run one tuner in its own process group; on timeout end that group (ours only)."""
    cwd.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(cwd / "stdout.log", "w") as out, open(cwd / "stderr.log", "w") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            code, timed_out = proc.returncode, True
            locks = sorted(Path.home().glob(".cache/torch_extensions/*/*/lock"))
            if locks:  # a rank killed while JIT-building an op leaves torch's lock behind, and every later build waits on it
                print(f"warning: torch extension locks exist after ending {cmd[0]}: {', '.join(map(str, locks))}; "
                      "if no build is running, remove them, or the next experiments wait for ever", file=sys.stderr)
    return {"cmd": cmd, "returncode": code, "timed_out": timed_out, "wall_s": time.time() - t0}


def experiments_in(results_dir: Path) -> List[Path]:
    """Experiment folders (each holds the cmd.txt of one launch)."""
    return sorted(p.parent for p in results_dir.glob("*/cmd.txt"))


def pick(results_dir: Path) -> Optional[Dict[str, Any]]:
    path = results_dir / "ds_config_optimal.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    for key in ("autotuning", "mlautotune"):
        config.pop(key, None)
    return config


def mlflow_run(out: Path) -> Dict[str, str]:
    """A parent run for DeepSpeed's autotuner (it reads MLFLOW_RUN_ID and crashes without it)."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{(out / 'mlflow.db').absolute()}"
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("versus_deepspeed") or client.get_experiment(client.create_experiment("versus_deepspeed"))
    run = client.create_run(exp.experiment_id, run_name="deepspeed-autotuning")
    return {"MLFLOW_TRACKING_URI": uri, "MLFLOW_RUN_ID": run.info.run_id}


def free_port_range(n: int = 64) -> int:
    """A base port with n free ports after it: DeepSpeed's autotuner uses --master_port + experiment id."""
    for _ in range(200):
        base = random.randrange(30000, 60000 - n)
        try:
            for port in range(base, base + n):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port range")


def run_deepspeed(work: Path, args: List[str], micro_cap: Optional[int], timeout: float) -> Dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    (work / "ds.json").write_text(json.dumps(ds_config(MAX_MBS, micro_cap), indent=1))
    env = {**os.environ, **mlflow_run(work)}
    base = free_port_range()
    cmd = [str(VENV_BIN / "deepspeed"), "--autotuning", "tune", "--num_gpus", "1", "--master_port", str(base), str(SCRIPT), "--deepspeed_config", "ds.json", *args]
    out = run_tool(cmd, work, env, timeout)
    leaked = sum(1 for p in range(base, base + 64) for _ in SHM.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{p}_*"))
    for p in range(base, base + 64):  # its experiments never unlink their CPU all-reduce buffers (66 MiB each)
        release_shared_memory(p)
    results = work / "autotuning_results"
    return {**out, "experiments": len(experiments_in(results)), "pick": pick(results), "shm_buffers_left": leaked}


def run_mlautotune(work: Path, args: List[str], cap: int, memory_limit: Optional[str], timeout: float) -> Dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    (work / "ds.json").write_text(json.dumps(ds_config(cap), indent=1))
    cmd = [sys.executable, "-m", "mlautotune", "config=ds.json", f"script={SCRIPT}", "script_args=" + " ".join(args), "launcher.num_gpus=1",
           f"tracking.tracking_uri=sqlite:///{(work / 'mlflow.db').absolute()}"]
    if memory_limit:
        cmd.append(f"autotuning.memory_limit_per_rank={memory_limit}")
    out = run_tool(cmd, work, dict(os.environ), timeout)
    results = work / "autotuning_results"
    found = experiments_in(results)
    largest_ok = max((json.loads((p / "ds_config.json").read_text()).get("train_micro_batch_size_per_gpu", 0)
                      for p in found if (p / "metrics.json").is_file() and (p / "ds_config.json").is_file()), default=None)
    return {**out, "experiments": len(found), "pick": pick(results), "largest_ok_micro_batch": largest_ok}


def remeasure(picks: Dict[str, Dict[str, Any]], args: List[str], work: Path, window: int, repeats: int) -> Dict[str, Any]:
    """Each pick measured `repeats` times by mlautotune's runner with the same long window, alternately."""
    values: Dict[str, List[float]] = {tool: [] for tool in picks}
    for i in range(repeats):
        for tool, config in picks.items():
            exp = Experiment(name=f"{tool}_pick_{i}", ds_config=config, script=str(SCRIPT), script_args=[*args, "--steps", str(window + 10)],
                             resources=Resources(num_gpus=1, master_port=free_port_range()), params={}, arg_mappings=ARG_MAPPINGS, start_profile_step=5,
                             end_profile_step=5 + window, timeout_s=1800)
            result = run_experiment(exp, work)
            if result.status == "ok":
                values[tool].append(float(result.metrics["throughput"]))
    return {tool: {"throughputs": v, "median": statistics.median(v) if v else None,
                   "spread": (max(v) - min(v)) / statistics.median(v) if len(v) > 1 else None} for tool, v in values.items()}


def describe(config: Optional[Dict[str, Any]]) -> str:
    if not config:
        return "none"
    return f"z{config.get('zero_optimization', {}).get('stage')} mbs {config.get('train_micro_batch_size_per_gpu')} gas {config.get('gradient_accumulation_steps')}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--workloads", default="bundled,edge")
    ap.add_argument("--repeats", type=int, default=3, help="long re-measurements of each pick")
    ap.add_argument("--window", type=int, default=30, help="optimizer steps in the re-measurement window")
    ap.add_argument("--timeout", type=float, default=3 * 3600, help="seconds per tuning run; its process group is ended after it")
    args = ap.parse_args()
    if shutil.which("deepspeed", path=str(VENV_BIN)) is None:
        sys.exit(f"no deepspeed launcher in {VENV_BIN}")
    # Both tools (and the re-measurements) run with the virtualenv's bin first on PATH: the same ninja
    # for DeepSpeed's JIT ops. Two ninja versions (pip's, the system's) each rebuild what the other
    # built, ~60 s inside the first experiment of each tool.
    os.environ["PATH"] = f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    ops.ensure_built(ds_config(MAX_MBS), print)  # neither tool's first experiment builds them
    report = {}
    for name in args.workloads.split(","):
        w, base = WORKLOADS[name], args.out.absolute() / name
        if w["memory_limit"]:  # mlautotune first: its largest runnable micro-batch caps DeepSpeed's space
            ml = run_mlautotune(base / "mlautotune", w["args"], MAX_MBS, w["memory_limit"], args.timeout)
            ds = run_deepspeed(base / "deepspeed", w["args"], ml["largest_ok_micro_batch"] or MAX_MBS, args.timeout)
        else:
            ds = run_deepspeed(base / "deepspeed", w["args"], None, args.timeout)
            ml = run_mlautotune(base / "mlautotune", w["args"], MAX_MBS, None, args.timeout)
        picks = {tool: r["pick"] for tool, r in (("deepspeed", ds), ("mlautotune", ml)) if r["pick"]}
        long = remeasure(picks, w["args"], base / "remeasure", args.window, args.repeats) if picks else {}
        report[name] = {"deepspeed": ds, "mlautotune": ml, "remeasured": long}
        print(f"\n### {name}\n\n| tool | experiments | tuning wall time (s) | pick | re-measured samples/s (median, spread) |\n|---|---:|---:|---|---:|")
        for tool, r in (("deepspeed", ds), ("mlautotune", ml)):
            m = long.get(tool, {})
            value = f"{m['median']:.1f} ({m['spread']:.1%})" if m.get("median") and m.get("spread") is not None else (f"{m['median']:.1f}" if m.get("median") else "n/a")
            flag = " (timed out)" if r["timed_out"] else ("" if r["returncode"] == 0 else f" (exit {r['returncode']})")
            print(f"| {tool} | {r['experiments']} | {r['wall_s']:.0f}{flag} | {describe(r['pick'])} | {value} |")
        if ds["wall_s"] and not ds["timed_out"]:
            print(f"\nmlautotune / DeepSpeed tuning wall time: {ml['wall_s'] / ds['wall_s']:.2f} (target <= 0.5)")
        (args.out / "versus.json").write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
