"""The GPU check: what the CPU runs cannot show, measured in one short run on one GPU.

    bash scripts/gpu_wheels.sh                          # here: the wheels the GPU machine lacks, in .whl/
    python benchmarks/gpu_check.py --out DIR            # there: installs .whl/ into --site, then the steps below
    python benchmarks/gpu_check.py --dry-run --out DIR  # on CPU: the same steps, tiny, the GPU-only parts skipped and named

Steps (benchmarks/gpu.md says what each shows and its target):
1. wheels: `pip install --no-index --no-deps --target SITE .whl/*.whl`; SITE and src/ go first on
   sys.path and on the PYTHONPATH of everything started (the session, the launcher, the ranks).
2. session: a real `mlautotune ... mode=run` tuning session of the bundled GPT (about 350M parameters
   on the GPU, synthetic tokens) over ZeRO 0-3, under memory_limit_per_rank (32 GiB on the GPU: the
   probe caps torch's allocator to it, as on a 32 GB card), then the final training; final/tuned is read
   back from the MLflow parent run. Meanwhile, in this process, an experiment that hangs after
   initialising the accelerator: it must end as `timeout`, with no process left.
3. repeats: the session's best configuration 5 times (2 on CPU): the throughput's CV, and the probe's
   peak memory against torch.cuda.max_memory_allocated read by the script itself (gpu_check_rank.py).
4. sync: the same configuration with measure.synchronize=false: does the window's accelerator sync
   change the figure? (GPU only: on CPU the sync does nothing.)
5. oom: a micro-batch far over the limit: a real CUDA out-of-memory error (on CPU the probe's RSS check), classified `oom`.
Writes DIR/gpu_check.json (every figure) and DIR/gpu_check.md (a short table). Exit 0 when every step
ran and classified as expected (targets met or not, as the table says); 1 when one did not; 2 when it
cannot start (no wheels, no GPU, a package missing).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANK_SCRIPT = Path(__file__).with_name("gpu_check_rank.py")
MAPPINGS = {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size", "gradient_accumulation_steps": "--gradient_accumulation_steps"}
GiB = 2**30
NEEDED = ("deepspeed", "mlflow", "optuna", "hydra", "omegaconf", "hjson", "xgboost", "psutil", "cpuinfo", "pydantic")


@dataclass
class Plan:
    """What each step runs: the GPU's figures, or the dry run's tiny ones."""
    model: list  # gpt.py flags
    precision: dict  # ds_config keys
    memory_limit: str  # memory_limit_per_rank of the session
    trials: int
    repeats: int
    timeout_s: float  # per experiment
    hang_timeout_s: float
    oom_micro_batch: int
    oom_limit_bytes: int
    session_timeout_s: float
    budget_s: float  # the whole check: steps that would start past it are skipped, so that its report is written in time
    measure: dict = field(default_factory=dict)  # measure.* settings changed, in the session and the repeats
    gpu: bool = True


GPU = Plan(model=["--num_layers", "24", "--hidden_size", "1024", "--num_heads", "16", "--seq_len", "1024", "--vocab_size", "50304", "--steps", "100"],
           precision={"bf16": {"enabled": True}}, memory_limit="32GiB", trials=6, repeats=5, timeout_s=150, hang_timeout_s=30,
           oom_micro_batch=64, oom_limit_bytes=32 * GiB, session_timeout_s=300, budget_s=480)
DRY = Plan(model=["--num_layers", "1", "--hidden_size", "32", "--num_heads", "2", "--seq_len", "32", "--vocab_size", "256", "--steps", "40"],
           precision={}, memory_limit="4GiB", trials=2, repeats=2, timeout_s=300, hang_timeout_s=8,
           oom_micro_batch=2, oom_limit_bytes=64 * 2**20, session_timeout_s=900, budget_s=1e9, measure={"budget_s": 1.0}, gpu=False)


def ds_config(plan: Plan) -> dict:
    # No gradient clipping: its norm is read on the host every step, a sync of its own that would hide what the window's sync changes.
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "steps_per_print": 1000,
            # torch's Adam: no op to JIT-compile inside the check's minutes
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01, "torch_adam": True}},
            **plan.precision, "zero_optimization": {"stage": "all"},
            "autotuning": {"enabled": True, "start_profile_step": 3, "end_profile_step": 10, "fast": True, "tuner_type": "model_based",
                           "tuner_num_trials": plan.trials, "tuner_early_stopping": 5, "memory_limit_per_rank": plan.memory_limit,
                           "experiment_timeout": plan.timeout_s, "arg_mappings": MAPPINGS}}


def cannot_start(text: str) -> None:
    print(f"gpu_check: {text}", file=sys.stderr)
    raise SystemExit(2)


def use_paths(paths: list) -> None:
    """First on this process's sys.path and on the PYTHONPATH of everything it starts."""
    sys.path[:0] = paths
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])


def install_wheels(wheels: Path, site: Path) -> int:
    found = sorted(wheels.glob("*.whl"))
    if not found:
        cannot_start(f"no wheels in {wheels}. Run `bash scripts/gpu_wheels.sh` on a machine with a package index, and carry {wheels}.")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade",
                    "--target", str(site), *map(str, found)], check=True)
    return len(found)


def check_imports() -> None:
    import importlib

    missing = []
    for name in NEEDED:
        try:
            importlib.import_module(name)
        except ImportError as e:
            missing.append(f"{name} ({e})")
    if missing:
        cannot_start(f"these packages do not import: {', '.join(missing)}. Add their wheels to scripts/gpu_wheels.sh and run it again.")


def leftovers(folder: str) -> list:
    """Live processes whose command line names `folder` or that hold a file under it open (a forked rank)."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline", "status", "pid"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and (any(folder in part for part in p.info["cmdline"] or [])
                                                             or any(f.path.startswith(folder) for f in p.open_files())):
                found.append(p.info["pid"])
        except psutil.Error:
            pass
    return found


def experiment(plan: Plan, name: str, params: dict, config: dict, script_args: list, **fields):
    from mlautotune.inputs.config import MeasureConf, Resources
    from mlautotune.run.experiment import Experiment

    measure = {**asdict(MeasureConf()), **plan.measure}
    return Experiment(name=name, ds_config=config, script=str(RANK_SCRIPT), script_args=list(script_args), resources=Resources(num_gpus=1),
                      params=dict(params), arg_mappings=dict(MAPPINGS), start_profile_step=3, end_profile_step=10, timeout_s=plan.timeout_s,
                      measure=measure, **fields)


def run_session(plan: Plan, work: Path, config_path: Path, tracking_uri: str) -> dict:
    from mlautotune.workloads import GPT_SCRIPT

    argv = [sys.executable, "-m", "mlautotune", f"config={config_path}", f"script={GPT_SCRIPT}", f"script_args={' '.join(plan.model)}",
            "mode=run", "launcher.num_gpus=1", f"autotuning.results_dir={work / 'results'}",
            f"autotuning.exps_dir={work / 'exps'}", f"tracking.tracking_uri={tracking_uri}", *(f"measure.{k}={v}" for k, v in plan.measure.items())]
    started = time.time()
    try:
        proc = subprocess.run(argv, cwd=work, capture_output=True, text=True, timeout=plan.session_timeout_s)
        returncode, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        returncode, output = None, f"{e.stdout or ''}{e.stderr or ''}\nthe session ran past {plan.session_timeout_s} s"
    (work / "session.log").write_text(output if isinstance(output, str) else str(output))
    out = {"returncode": returncode, "wall_s": time.time() - started, "last_lines": output.strip().splitlines()[-8:]}

    from mlflow.tracking import MlflowClient

    from mlautotune.track.report import PROVENANCE_KEY

    try:
        client = MlflowClient(tracking_uri)
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    except Exception as e:  # the store cannot be read (a package missing there): the report says so, the other steps still run
        out.update(tracking_error=f"{type(e).__name__}: {e}", experiments=[], stages=[], oom_edge_found=False, final_over_tuned=None, best=None)
        return out
    parent = next((r for r in runs if r.data.tags.get("mlautotune.role") == "session"), None)
    children = [r for r in runs if r.data.tags.get("experiment") and r.data.tags.get("mlautotune.role") != "final_training"]
    out["experiments"] = sorted((r.data.tags.get("experiment"), r.data.tags.get("status")) for r in children)
    out["stages"] = sorted({int(r.data.params["stage"]) for r in children if "stage" in r.data.params})
    out["oom_edge_found"] = any(status == "oom" for _, status in out["experiments"])
    out["final_over_tuned"] = parent.data.metrics.get("final_over_tuned") if parent else None
    optimal = work / "results" / "ds_config_optimal.json"
    out["best"] = json.loads(optimal.read_text())[PROVENANCE_KEY]["experiment"] if optimal.exists() else None
    return out


def run_hang(plan: Plan, exps: Path, out: dict) -> None:
    from mlautotune.run.experiment import run_experiment

    exp = experiment(plan, "hang", {"stage": 0, "micro_batch": 1, "gas": 1}, {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}},
                     ["--hang"], memory_limit_bytes=None)
    exp.timeout_s = plan.hang_timeout_s
    result = run_experiment(exp, exps)
    out.update(status=result.status, reason=result.reason.splitlines()[0] if result.reason else "", wall_s=result.wall_time_s,
               processes_left=leftovers(result.exp_dir))


def repeat_config(work: Path, best: str) -> tuple:
    """(params, concrete ds_config, the user's script args) of the session's best experiment."""
    exp_json = json.loads((work / "results" / best / "exp.json").read_text())
    return exp_json["params"], json.loads(Path(exp_json["ds_config"]).read_text()), exp_json["user_script_args"]


def run_repeats(plan: Plan, exps: Path, params: dict, config: dict, script_args: list, deadline: float) -> dict:
    from mlautotune.run.experiment import run_experiment

    runs = []
    for i in range(plan.repeats):
        if runs and time.time() + max(r["wall_s"] for r in runs) > deadline:
            break  # out of time: fewer repeats, said by the number of runs
        exp = experiment(plan, f"repeat{i + 1}", params, config, script_args, memory_limit_bytes=parse_limit(plan.memory_limit))
        exp.env["GPU_CHECK_PEAK_DIR"] = str(exps / exp.name)
        r = run_experiment(exp, exps)
        peak_file = exps / exp.name / "peak0.json"
        independent = json.loads(peak_file.read_text())["max_memory_allocated"] if peak_file.exists() else None
        runs.append({"status": r.status, "throughput": r.metrics.get("throughput"), "interval_rel": r.metrics.get("interval_rel"),
                     "peak_memory_bytes": r.metrics.get("peak_memory_bytes"), "max_memory_allocated": independent,
                     "step_time_median_ms": r.metrics.get("step_time_median_ms"), "measure_seconds": r.metrics.get("measure_seconds"),
                     "wall_s": r.wall_time_s, "reason": r.reason[-300:]})
    tps = [r["throughput"] for r in runs if r["throughput"]]
    out = {"runs": runs, "throughput_median": statistics.median(tps) if tps else None,
           "cv": statistics.stdev(tps) / statistics.fmean(tps) if len(tps) >= 2 else None}
    pairs = [(r["peak_memory_bytes"], r["max_memory_allocated"]) for r in runs if r["peak_memory_bytes"] and r["max_memory_allocated"]]
    out["peak_over_max_allocated"] = [p / m for p, m in pairs] if pairs else None
    return out


def run_sync_off(plan: Plan, exps: Path, params: dict, config: dict, script_args: list, with_sync: dict) -> dict:
    from mlautotune.run.experiment import run_experiment

    exp = experiment(plan, "no_sync", params, config, script_args, memory_limit_bytes=parse_limit(plan.memory_limit))
    exp.measure["synchronize"] = False
    r = run_experiment(exp, exps)
    out = {"status": r.status, "throughput": r.metrics.get("throughput"), "step_time_median_ms": r.metrics.get("step_time_median_ms"),
           "measure_seconds": r.metrics.get("measure_seconds"), "step_time_spread": r.metrics.get("step_time_spread")}
    if out["throughput"] and with_sync.get("throughput_median"):
        out["over_with_sync"] = out["throughput"] / with_sync["throughput_median"]
        noise = max(2 * (with_sync.get("cv") or 0.0), 0.01)
        out["sync_matters"] = abs(out["over_with_sync"] - 1.0) > noise
    return out


def run_oom(plan: Plan, exps: Path, script_args: list) -> dict:
    from mlautotune.run.experiment import run_experiment

    config = {"train_micro_batch_size_per_gpu": plan.oom_micro_batch, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "torch_adam": True}}, **plan.precision, "zero_optimization": {"stage": 0}}
    exp = experiment(plan, "oom", {"stage": 0, "micro_batch": plan.oom_micro_batch, "gas": 1}, config, script_args,
                     memory_limit_bytes=plan.oom_limit_bytes)
    r = run_experiment(exp, exps)
    stderr = Path(r.exp_dir, "stderr.log").read_text(errors="replace").splitlines()
    return {"status": r.status, "reason": r.reason[-500:], "real_cuda_oom": "CUDA out of memory" in r.reason, "wall_s": r.wall_time_s,
            "stderr_tail": [line for line in stderr if "memory" in line.lower()][-5:]}


def parse_limit(text: str) -> int:
    from mlautotune.inputs.config import parse_bytes

    return parse_bytes(text)


def verdicts(report: dict, plan: Plan) -> tuple:
    """(checks: did each step run and classify as it must, targets: the figures against their targets)."""
    s, h, o, r = report["session"], report["hang"], report["oom"], report["repeats"]
    checks = {
        "session completed (mode=run)": s["returncode"] == 0,
        "hang classified timeout": h.get("status") == "timeout",
        "no process left after the timeout": h.get("processes_left") == [],
        "forced OOM classified oom": o["status"] == "oom",
        "repeats all ok": all(x["status"] == "ok" for x in r["runs"]),
    }
    sync = report.get("sync") or {}
    targets = {
        "throughput CV < 1%": (r["cv"] is not None and r["cv"] < 0.01, r["cv"]),
        "final/tuned within +-5%": (s["final_over_tuned"] is not None and abs(s["final_over_tuned"] - 1) <= 0.05, s["final_over_tuned"]),
    }
    if plan.gpu:
        checks["forced OOM was a real CUDA OOM"] = o["real_cuda_oom"]
        targets["experiments in every ZeRO stage"] = (s["stages"] == [0, 1, 2, 3], s["stages"])
        ratios = r["peak_over_max_allocated"] or []
        targets["probe peak = max_memory_allocated (+-2%)"] = (bool(ratios) and all(abs(x - 1) <= 0.02 for x in ratios), ratios)
        targets["the window's sync matters"] = (bool(sync.get("sync_matters")), sync.get("over_with_sync"))
        targets["memory edge inside the space (an OOM in the session)"] = (s["oom_edge_found"], s["oom_edge_found"])
    return checks, targets


def table(report: dict, checks: dict, targets: dict) -> str:
    lines = [f"# GPU check ({report['device']})", "", "| check | result |", "|---|---|"]
    lines += [f"| {k} | {'yes' if v else 'NO'} |" for k, v in checks.items()]
    lines += ["", "| target | met | value |", "|---|---|---|"]
    fmt = lambda v: f"{v:.4f}" if isinstance(v, float) else (", ".join(f"{x:.4f}" for x in v) if isinstance(v, list) else str(v))
    lines += [f"| {k} | {'yes' if met else 'no'} | {fmt(v)} |" for k, (met, v) in targets.items()]
    if report["skipped"]:
        lines += ["", "Skipped (GPU only): " + "; ".join(report["skipped"])]
    lines += ["", "Wall time per step (s): " + ", ".join(f"{k} {v:.0f}" for k, v in report["step_seconds"].items())]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for gpu_check.json and gpu_check.md")
    p.add_argument("--dry-run", action="store_true", help="on CPU: the same steps with a tiny model, the GPU-only parts skipped")
    p.add_argument("--wheels", default=str(ROOT / ".whl"), help="the wheels scripts/gpu_wheels.sh made")
    p.add_argument("--site", default=None, help="where the wheels are installed (default: a new temporary folder)")
    p.add_argument("--work", default=None, help="the session's and the experiments' folder (default: a new temporary folder)")
    args = p.parse_args(argv)
    plan = DRY if args.dry_run else GPU
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu_check-")).absolute()
    work.mkdir(parents=True, exist_ok=True)
    report = {"dry_run": args.dry_run, "skipped": [], "step_seconds": {}}
    clock = time.time()
    deadline = clock + plan.budget_s

    paths = [str(ROOT / "src")]
    if plan.gpu:
        site = Path(args.site or tempfile.mkdtemp(prefix="gpu_check_site-"))
        report["wheels_installed"] = install_wheels(Path(args.wheels), site)
        paths.insert(0, str(site))
    else:
        report["skipped"].append("installing the cp312 wheels (the dry run uses this environment's packages)")
    use_paths(paths)
    check_imports()
    import torch

    if plan.gpu and not torch.cuda.is_available():
        cannot_start("no CUDA device here. On CPU run `python benchmarks/gpu_check.py --dry-run --out DIR`.")
    report["device"] = torch.cuda.get_device_name(0) if plan.gpu else "CPU (dry run)"
    report["torch"] = torch.__version__
    report["step_seconds"]["wheels"] = time.time() - clock

    from mlautotune.run.experiment import prepare

    config_path = work / "ds_config.json"
    config_path.write_text(json.dumps(ds_config(plan), indent=1))
    exps = work / "checks"
    exps.mkdir(exist_ok=True)
    prepare({"optimizer": ds_config(plan)["optimizer"]}, print)

    clock = time.time()
    report["hang"] = {}
    hang = threading.Thread(target=run_hang, args=(plan, exps, report["hang"]), name="hang")
    hang.start()  # beside the session: it only sleeps
    report["session"] = run_session(plan, work, config_path, f"sqlite:///{work / 'mlflow.db'}")
    hang.join()
    report["step_seconds"]["session + hang"] = time.time() - clock

    clock = time.time()
    best = report["session"]["best"]
    if best:
        params, config, script_args = repeat_config(work, best)
    else:  # no optimum: the repeats still run, on the smallest configuration
        params, config, script_args = {"stage": 0, "micro_batch": 1, "gas": 1}, {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}}, plan.model
    report["repeated"] = {"experiment": best, "params": params}
    report["repeats"] = run_repeats(plan, exps, params, config, script_args, deadline - 60)
    report["step_seconds"]["repeats"] = time.time() - clock
    if not plan.gpu:
        report["skipped"].append("the probe's peak against torch.cuda.max_memory_allocated (no device memory on CPU)")

    clock = time.time()
    if plan.gpu and time.time() > deadline - 50:
        report["skipped"].append("the window without the accelerator sync: out of time")
    elif plan.gpu:
        report["sync"] = run_sync_off(plan, exps, params, config, script_args, report["repeats"])
        report["step_seconds"]["sync off"] = time.time() - clock
    else:
        report["skipped"].append("the window without the accelerator sync (a no-op on CPU)")

    clock = time.time()
    report["oom"] = run_oom(plan, exps, plan.model) if time.time() < deadline - 30 else {"status": "not run: out of time", "real_cuda_oom": False}
    report["step_seconds"]["oom"] = time.time() - clock
    if not plan.gpu:
        report["skipped"].append("a real CUDA out-of-memory error (on CPU the probe's RSS check ends the run)")

    checks, targets = verdicts(report, plan)
    report["checks"], report["targets"] = checks, {k: {"met": met, "value": v} for k, (met, v) in targets.items()}
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    text = table(report, checks, targets)
    (out_dir / "gpu_check.md").write_text(text)
    print(text)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
