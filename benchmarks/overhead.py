"""The experiment runner's cost over a bare `deepspeed` run, and where an experiment's wall time goes.

    python benchmarks/overhead.py [--repeats 3] [--stage 2] [--mbs 4] [--gas 1] [--json OUT]

Runs the bundled workload for end_profile_step optimizer steps, alternately (a) bare, as
`deepspeed --num_gpus 2 gpt.py --deepspeed_config ds.json --steps N`, and (b) through
run_experiment (launcher + probe + measurement). Prints the median wall times, their ratio, and
a breakdown of (b) from the timestamps the probe records in each rank's rank<N>.json. --json keeps
every run's wall time and phases, and the load average before and after (`tables.py` reads it).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mlautotune.run.experiment import Experiment, Resources, run_experiment
from mlautotune.files import read_json
from mlautotune.workloads import GPT_SCRIPT as WORKLOAD

# (label, from event, to event) on the slowest rank's timeline; "launch" is when the runner started the launcher.
PHASES = [
    ("launcher start-up (runner.py + launch.py, until the rank's python starts)", "launch", "probe_start"),
    ("imports in the rank (torch, deepspeed)", "probe_start", "script_start"),
    ("script until deepspeed.initialize (args, model)", "script_start", "initialize_start"),
    ("process-group init (deepspeed.comm.init_distributed)", "pg_init_start", "pg_init_end"),
    ("rest of engine init (optimizer, ZeRO, op loading)", "pg_init_end", "initialize_end"),
    ("warm-up steps", "initialize_end", "window_start"),
    ("... of which the flops-profiled forward", "first_forward", "flops_profiled"),
    ("measured window", "window_start", "window_end"),
    ("combine the ranks (all_gather), write metrics.json", "window_end", "combined"),
    ("ranks exit, runner notices and kills the group", "combined", "end"),
]


def bare_run(ds_config: dict, steps: int, work: Path) -> float:
    cfg = work / "bare_ds_config.json"
    cfg.write_text(json.dumps(ds_config))
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", str(WORKLOAD),
           "--deepspeed_config", str(cfg), "--steps", str(steps)]
    t0 = time.time()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.time() - t0


def probed_run(ds_config: dict, steps: int, name: str, work: Path):
    exp = Experiment(name=name, ds_config=ds_config, script=str(WORKLOAD), script_args=[], resources=Resources(num_gpus=2),
                     params={}, start_profile_step=3, end_profile_step=steps, timeout_s=600)
    result = run_experiment(exp, work)
    assert result.status == "ok", result.reason
    ranks = [read_json(p) for p in Path(result.exp_dir).glob("rank*.json")]
    events = {k: max(r["timeline"][k] for r in ranks) for k in ranks[0]["timeline"]}  # the slowest rank
    events["launch"] = ranks[0]["timeline"]["launch"]
    events["end"] = events["launch"] + result.wall_time_s
    return result, events


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--gas", type=int, default=1)
    p.add_argument("--steps", type=int, default=5, help="optimizer steps; the probe's window is steps 3..steps")
    p.add_argument("--json", metavar="OUT", help="write every run's wall time and phases as JSON")
    args = p.parse_args()
    ds_config = {"train_micro_batch_size_per_gpu": args.mbs, "gradient_accumulation_steps": args.gas, "steps_per_print": 1000,
                 "optimizer": {"type": "Adam", "params": {"lr": 3e-4}}, "zero_optimization": {"stage": args.stage}}
    steps = args.steps

    bare, probed, breakdowns = [], [], []
    load = os.getloadavg()[0]  # other work on the machine: a quiet one is near 0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for i in range(args.repeats):  # alternate, so drift in the machine's speed hits both alike
            bare.append(bare_run(ds_config, steps, work))
            result, events = probed_run(ds_config, steps, f"run{i}", work)
            probed.append(result.wall_time_s)
            breakdowns.append({label: events[b] - events[a] for label, a, b in PHASES})

    b, r = statistics.median(bare), statistics.median(probed)
    print(f"z{args.stage} mbs {args.mbs} gas {args.gas}, {steps} optimizer steps, 2 CPU ranks, {args.repeats} runs each\n")
    print(f"| run | wall time (median of {args.repeats}) | all runs |\n|---|---|---|")
    print(f"| bare `deepspeed --num_gpus 2 gpt.py --steps {steps}` | {b:.1f} s | {', '.join(f'{x:.1f}' for x in bare)} |")
    print(f"| `run_experiment` (launcher + probe) | {r:.1f} s | {', '.join(f'{x:.1f}' for x in probed)} |")
    print(f"\nratio runner / bare: {r / b:.2f}\n")
    print(f"| phase of one experiment | median s | share |\n|---|---|---|")
    for label, _, _ in PHASES:
        s = statistics.median(d[label] for d in breakdowns)
        print(f"| {label} | {s:.2f} | {s / r:.1%} |")
    if args.json:
        out = {"args": vars(args), "bare_s": bare, "runner_s": probed, "phases_s": breakdowns, "load_before_after": [load, os.getloadavg()[0]]}
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
