"""How reproducible one experiment's throughput is: the old fixed window against the adaptive one.

    python benchmarks/noise.py [--repeats 5] [--busy] [--methods fixed,adaptive,pinned] [--stage 1] [--mbs 8] [--json OUT]

Measures one configuration of the bundled workload and config (2 CPU ranks, default ZeRO-1,
micro-batch 8, torch's Adam) `--repeats` times through the product's run_experiment,
interleaving the measurements of --methods:
  fixed     the window start_profile_step..end_profile_step (3..5) as before, torch's default threads;
  adaptive  conf's measure settings (warm-up, target interval, budget) and cores / ranks threads;
  pinned    adaptive, and each rank pinned to its own share of the cores (what a session does by default);
  unforked  pinned, with the ranks started as new interpreters instead of forks of the preloaded
            runner (PYTHONHASHSEED=random, which changes nothing else, is read at a process's start,
            so `runner_process._forkable` starts them as commands).
A method may name another measuring budget than conf's: `pinned@9` is pinned with measure.budget_s=9.
With --busy, every repeat is measured twice more with a CPU-bound process beside the experiment,
and each busy repeat is checked against the quiet median: within 5% of it, or flagged disturbed.
Prints, per method and condition: the throughputs, their CV, the median wall seconds per
experiment, the seconds the adaptive window adds, and how many repeats were flagged disturbed.
With --calibrate, each quiet repeat is preceded by fixed matmuls timed on the ranks' cores (the
machine's own speed, which shares nothing with the experiment), and the CV of throughput over that
speed is printed beside the raw CV: how much of the spread is the machine drifting between repeats.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from mlautotune.inputs.config import MeasureConf
from mlautotune.run.experiment import Experiment, Resources, prepare, run_experiment
from mlautotune.files import read_json
from mlautotune.run.measure import thread_env
from mlautotune.inputs.config import BUNDLED_CONFIG
from mlautotune.workloads import GPT_SCRIPT

RANKS = 2
MASTER_PORT = 39500  # off the default 29500 that sessions on the same machine start from
CLOSE = 0.05  # a busy repeat within 5% of the quiet median needs no flag
BUSY_LOOP = "while True:\n    pass\n"
# The machine's own speed, independent of the experiment: one process per rank's core share, each
# pinned there with one thread, times the same float32 matmuls for CALIBRATION_S; GFLOP/s summed.
CALIBRATION_S = 2.0
CALIBRATION = """
import os, sys, time, torch
os.sched_setaffinity(0, {int(sys.argv[1])})
torch.set_num_threads(1)
a, b = torch.rand(256, 256), torch.rand(256, 256)
n, end = 0, time.perf_counter() + float(sys.argv[2])
while time.perf_counter() < end:
    a @ b
    n += 1
print(n * 2 * 256 ** 3 / float(sys.argv[2]) / 1e9)
"""


def experiment(spec: str, stage: int, mbs: int, steps: int) -> Experiment:
    method, _, budget = spec.partition("@")
    ds_config = {k: v for k, v in read_json(BUNDLED_CONFIG).items() if k != "autotuning"}
    ds_config.update(train_micro_batch_size_per_gpu=mbs, gradient_accumulation_steps=1, zero_optimization={"stage": stage})
    ds_config["optimizer"]["params"]["torch_adam"] = True  # torch's Adam: no JIT-built op whose (re)build would enter the wall time
    adaptive = method != "fixed"
    env = thread_env("cpu", RANKS, [], pin=method in ("pinned", "unforked")) if adaptive else {}
    if method == "unforked":
        env["PYTHONHASHSEED"] = "random"
    measure = {**asdict(MeasureConf()), "adaptive": adaptive, **({"budget_s": float(budget)} if budget else {})}
    return Experiment(name=f"{spec}_z{stage}_mbs{mbs}", ds_config=ds_config, script=str(GPT_SCRIPT), script_args=["--steps", str(steps)],
                      resources=Resources(num_gpus=RANKS, master_port=MASTER_PORT), params={"stage": stage, "micro_batch": mbs, "gas": 1}, timeout_s=600,
                      measure=measure,
                      env=env)


def measure_once(exp: Experiment, work: Path, busy: bool, calibrate: bool = False) -> dict:
    speed = machine_speed() if calibrate and not busy else None
    hog = subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) if busy else None
    try:
        result = run_experiment(exp, work)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    m = result.metrics
    row = {"status": result.status, "wall_s": result.wall_time_s, "throughput": m.get("throughput"), "interval_rel": m.get("interval_rel"),
           "machine_gflops": speed,
           "disturbed": m.get("disturbed"), "measured_steps": m.get("measured_steps"), "warmup_steps": m.get("warmup_steps"),
           **{k: m.get(k) for k in ("measure_seconds", "target_reached", "step_time_shift", "cpu_wait_share", "thread_wait_share",
                                    "threads_per_rank", "step_times_ms")}}
    print(f"  {exp.name:<22} {'busy ' if busy else 'quiet'} {result.status:<10} {row['throughput'] or 0:8.2f} samples/s  "
          f"+-{100 * (row['interval_rel'] or 0):5.1f}%  steps {row['measured_steps']}  wall {result.wall_time_s:5.1f} s  "
          f"cpu wait {row['thread_wait_share'] or 0:.2f} (all threads {row['cpu_wait_share'] or 0:.2f})"
          f"{'  DISTURBED' if row['disturbed'] else ''}{f'  machine {speed:.1f} GFLOP/s' if speed else ''}", flush=True)
    return row


def machine_speed() -> float:
    """GFLOP/s of the calibration matmuls, one pinned process per core at once (as the ranks run)."""
    cores = sorted(os.sched_getaffinity(0))[:RANKS]
    procs = [subprocess.Popen([sys.executable, "-c", CALIBRATION, str(c), str(CALIBRATION_S)], stdout=subprocess.PIPE, text=True) for c in cores]
    return sum(float(p.communicate()[0]) for p in procs)


def cv(values) -> float:
    return statistics.stdev(values) / statistics.mean(values) if len(values) > 1 else 0.0


def cv_range(cv_: float, n: int, level: float = 0.90) -> tuple:
    """What a CV measured from n repeats allows for the true CV (normal approximation, chi-square quantiles by
    Wilson-Hilferty): with 5 repeats, 0.65x to 2.4x the measured value at 90%."""
    k, z = n - 1, statistics.NormalDist().inv_cdf(0.5 + level / 2)
    chi2 = lambda zz: k * (1 - 2 / (9 * k) + zz * (2 / (9 * k)) ** 0.5) ** 3
    return cv_ * (k / chi2(z)) ** 0.5, cv_ * (k / chi2(-z)) ** 0.5


def summarise(rows: list, quiet_median=None) -> dict:
    ok = [r for r in rows if r["status"] == "ok"]
    tps = [r["throughput"] for r in ok]
    s = {"repeats": len(rows), "ok": len(ok), "throughputs": tps, "median_throughput": statistics.median(tps) if tps else None,
         "cv": cv(tps) if tps else None, "median_wall_s": statistics.median(r["wall_s"] for r in rows),
         "disturbed": sum(bool(r["disturbed"]) for r in ok),
         "median_interval_rel": statistics.median(r["interval_rel"] for r in ok if r["interval_rel"] is not None) if ok else None,
         "median_cpu_wait": statistics.median(r["thread_wait_share"] or 0.0 for r in ok) if ok else None}
    if len(tps) > 1:
        s["cv_90pct_range"] = cv_range(s["cv"], len(tps))
    speeds = [r["machine_gflops"] for r in ok if r.get("machine_gflops")]
    if len(speeds) == len(ok) > 1:  # each throughput over the machine's speed just before it: what is left without the drift
        s["machine_cv"] = cv(speeds)
        s["cv_drift_corrected"] = cv([t / g for t, g in zip(tps, speeds)])
    if quiet_median:
        s["within_5pct_or_flagged"] = sum(abs(r["throughput"] / quiet_median - 1) <= CLOSE or bool(r["disturbed"]) for r in ok)
    return s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--busy", action="store_true", help="also measure with a CPU-bound process beside the experiment")
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--mbs", type=int, default=8)
    p.add_argument("--steps", type=int, default=200, help="the script's optimizer steps (the adaptive window stops the ranks earlier)")
    p.add_argument("--methods", default="fixed,adaptive,pinned", help="which of fixed, adaptive, pinned (adaptive, each rank on its own cores), unforked (pinned, ranks as new interpreters); METHOD@S measures for S seconds (measure.budget_s)")
    p.add_argument("--json", metavar="OUT", help="write the rows and the summary as JSON")
    p.add_argument("--calibrate", action="store_true", help=f"before each quiet repeat, time fixed matmuls ({CALIBRATION_S:g} s, one pinned "
                   "process per rank) for the machine's own speed, and report the CV with that drift divided out")
    args = p.parse_args()

    conditions = [False, True] if args.busy else [False]
    methods = tuple(args.methods.split(","))
    rows = {(m, b): [] for m in methods for b in conditions}
    prepare(experiment(methods[0], args.stage, args.mbs, args.steps).ds_config, print)  # not inside the first repeat's wall time
    load = os.getloadavg()  # other work on the machine: a quiet one is near 0
    with tempfile.TemporaryDirectory(prefix="mlautotune-noise-") as work:
        for i in range(args.repeats):
            print(f"repeat {i + 1}/{args.repeats}", flush=True)
            for busy in conditions:
                for method in methods:  # interleaved, so a slow spell of the machine hits both alike
                    rows[method, busy].append(measure_once(experiment(method, args.stage, args.mbs, args.steps), Path(work), busy, args.calibrate))

    summary = {}
    for method in methods:
        quiet = summarise(rows[method, False])
        summary[method] = {"quiet": quiet}
        if args.busy:
            summary[method]["busy"] = summarise(rows[method, True], quiet["median_throughput"])
    fixed_wall = summary["fixed"]["quiet"]["median_wall_s"] if "fixed" in methods else None
    added = {m: summary[m]["quiet"]["median_wall_s"] - fixed_wall for m in methods if m != "fixed"} if fixed_wall else {}

    print(f"\nZeRO-{args.stage}, micro-batch {args.mbs}, {RANKS} CPU ranks, {args.repeats} repeats per method and condition")
    print(f"load average (1 min) before / after: {load[0]:.2f} / {os.getloadavg()[0]:.2f}")
    print(f"{'method':<9} {'condition':<9} {'median samples/s':>16} {'CV':>6} {'CV 90% range':>13} {'median +-':>9} {'wall s':>7} "
          f"{'cpu wait':>8} {'disturbed':>9}  within 5% or flagged")
    for method in methods:
        for cond, s in summary[method].items():
            within = f"{s['within_5pct_or_flagged']}/{s['ok']}" if "within_5pct_or_flagged" in s else "-"
            lo, hi = s.get("cv_90pct_range", (0.0, 0.0))
            print(f"{method:<9} {cond:<9} {s['median_throughput'] or 0:16.2f} {100 * (s['cv'] or 0):5.1f}% {100 * lo:5.1f}-{100 * hi:4.1f}% "
                  f"{100 * (s['median_interval_rel'] or 0):8.1f}% {s['median_wall_s']:7.1f} {s['median_cpu_wait'] or 0:8.2f} "
                  f"{s['disturbed']:>5}/{s['ok']:<3}  {within}")
    for method in methods:
        q = summary[method]["quiet"]
        if "machine_cv" in q:
            print(f"{method}: the machine's own speed (calibration matmuls) varied by CV {100 * q['machine_cv']:.1f}%; throughput / machine speed: "
                  f"CV {100 * q['cv_drift_corrected']:.1f}% (raw {100 * q['cv']:.1f}%)")
    for m, a in added.items():
        print(f"added seconds per experiment ({m} - fixed, quiet medians): {a:+.1f} s ({100 * a / fixed_wall:+.0f}%)")
    if args.json:
        out = {"args": vars(args), "measure": asdict(MeasureConf()), "summary": summary, "added_s": added, "load_before_after": [load[0], os.getloadavg()[0]],
               "rows": {f"{m}/{'busy' if b else 'quiet'}": r for (m, b), r in rows.items()}}
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
