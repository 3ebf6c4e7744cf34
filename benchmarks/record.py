"""Record a landscape: run a tuning plan's whole grid on a real workload through the product's own
session and runner (DeepSpeed launcher, probe, memory limit), one experiment at a time.

    python benchmarks/record.py OUT.json --micro-batches 1,2,4,8,16,32 [--repeats N] [--name NAME] [--keep DIR] -- HYDRA_OVERRIDES...

    e.g. python benchmarks/record.py benchmarks/landscapes/cpu_gpt-0.9M_fast.json --micro-batches 1,2,4,8,16,24,32,48 \
             -- config=benchmarks/configs/cpu_gpt-0.9M_fast.json launcher.num_gpus=2

The overrides are the `mlautotune` command line's (config=, script=, script_args=, launcher.*,
space.*). For each stage of the plan, each micro-batch of --micro-batches (ascending) and, in full
mode, each combination of the stage's knobs (fast mode: DeepSpeed's defaults), one experiment runs.
A stage stops at the first micro-batch where nothing fits: larger ones are OOMs by definition.
Points are saved after every experiment, and a rerun skips the points already in OUT.json, so an
interrupted recording resumes.

`--repeats N`: every point that ran is measured N times in all, in N passes over the grid (so a
slow spell of the machine spreads over many points instead of one point's repeats). The point keeps
each measurement in `draws`, and its metrics are their medians (`landscape.settle`): the replay
scores against those and hands out the draws as measurements. A rerun with a larger N adds the
missing repeats.

`--contenders WITHIN --contender-repeats M`: then the points whose median lies within WITHIN (a
fraction, e.g. 0.1) of the best median are measured again, in passes over them, until each has M
draws; the set is recomputed after every pass from the medians so far, so a point that climbs into
it is measured too. Five draws a point leave a median uncertain by about 1.25 x the draw spread /
sqrt(5), ~3% here, coarser than the 1% the 99% target asks; M = 40 brings it to ~1.2% where it
matters (the configurations that may be the best), for a fraction of the time 40 draws of every
point would take. A rerun resumes here too.
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

sys.path.insert(0, str(Path(__file__).parent))
from landscape import key, load, save, settle, signed_metric  # noqa: E402
from mlautotune.run.experiment import prepare  # noqa: E402
from mlautotune.inputs.config import register_configs  # noqa: E402
from mlautotune.search import base_params, product  # noqa: E402
from mlautotune.session import open_session  # noqa: E402
from mlautotune.inputs.space import tuned_knobs  # noqa: E402

CONF = Path(__file__).resolve().parent.parent / "src" / "mlautotune" / "conf"


def grid(plan, stage: int, mbs: int):
    base = base_params(plan, stage, mbs)
    if plan.fast:
        return [base]
    return [{**base, **combo} for combo in product(tuned_knobs(plan, stage))]


def contenders(land: dict, within: float) -> list:
    """The ok points whose median is within `within` of the best median (the metric's direction)."""
    metric, sign = signed_metric(land)
    ok = [p for p in land["points"] if p["status"] == "ok" and "draws" in p]
    if not ok:
        return []
    best = max(sign * p["metrics"][metric] for p in ok)
    return [p for p in ok if sign * p["metrics"][metric] >= best - abs(best) * within]


def header(session, name: str, argv) -> dict:
    plan = session.plan
    return {
        "name": name,
        "description": f"recorded from {session.script.name} {' '.join(session.script_args)} on the development machine "
        f"({os.cpu_count()} cores, {session.world_size} {session.device} ranks), {'fast' if plan.fast else 'full'} mode",
        "source": "recorded",
        "command": "python benchmarks/record.py " + " ".join(argv),
        "world_size": session.world_size,
        "memory_limit_bytes": session.memory_limit_bytes,
        "metric": session.at.metric,
        "device": session.device,
        "plan": {
            "stages": plan.stages, "micro_batch": {"mode": plan.micro_batch.mode, "values": list(plan.micro_batch.values)},
            "gas": plan.gas, "fast": plan.fast, "max_train_batch_size": plan.max_train_batch_size,
            "knobs": {s: tuned_knobs(plan, s) for s in plan.stages}, "base_config": plan.base_config,
        },
        "points": [],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--micro-batches", required=True, help="ascending micro-batch sizes to record, comma-separated")
    ap.add_argument("--repeats", type=int, default=1, help="measurements per point (default 1)")
    ap.add_argument("--contenders", type=float, metavar="WITHIN", help="measure the points within this fraction of the best median again (see above)")
    ap.add_argument("--contender-repeats", type=int, default=40, metavar="M", help="draws per contender (default 40)")
    ap.add_argument("--name", help="landscape name (default: OUT's file name)")
    ap.add_argument("--keep", type=Path, metavar="DIR", help="keep the experiment folders here (default: a temporary folder, removed at the end)")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:split])
    args.overrides = argv[split + 1:]
    micro_batches = sorted({int(x) for x in args.micro_batches.split(",")})
    register_configs()
    with tempfile.TemporaryDirectory(prefix="mlautotune-record-") as tmp:
        record(args, micro_batches, args.keep or Path(tmp))  # the experiment folders; the landscape keeps the numbers


def record(args: argparse.Namespace, micro_batches: list, scratch: Path) -> None:
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        cfg = compose(config_name="config", overrides=[f"autotuning.results_dir={scratch}", f"autotuning.exps_dir={scratch}/exps", *args.overrides])
    session = open_session(cfg)
    prepare(session.ds_config, print)  # not inside the first experiment's wall time
    land = load(args.out) if args.out.exists() else header(session, args.name or args.out.stem, sys.argv[1:])
    done = {key(p["params"]): p for p in land["points"]}
    started = time.monotonic()
    ran = 0

    def run(params: dict) -> dict:
        nonlocal ran
        result = session.run(session.make_experiment(params))
        ran += 1
        print(
            f"[{time.monotonic() - started:6.0f}s] {result.name}: {result.status} "
            f"{result.metrics.get('throughput', 0):8.1f} samples/s  peak {result.metrics.get('peak_memory_bytes', 0) / 2**20:7.0f} MiB  "
            f"wall {result.wall_time_s:.1f} s",
            flush=True,
        )
        draw = {"status": result.status, "metrics": result.metrics, "wall_time_s": result.wall_time_s}
        return {**draw, "reason": result.reason.strip()[-300:]} if result.status != "ok" else draw

    def measure_again(point: dict) -> None:
        point["draws"].append(run(point["params"]))
        settle(point)
        save(args.out, land)

    for stage in session.plan.stages:
        for mbs in micro_batches:
            fitted = False
            for params in grid(session.plan, stage, mbs):
                point = done.get(key(params))
                if point is None:
                    point = {"params": params, **run(params)}
                    land["points"].append(point)
                    done[key(params)] = point
                    save(args.out, land)
                fitted |= point["status"] == "ok"
            if not fitted:
                break
    if args.repeats > 1:
        land["repeats"] = max(land.get("repeats", 1), args.repeats)
    for repeat in range(2, args.repeats + 1):  # passes over the points that ran
        for point in land["points"]:
            if point["status"] != "ok":
                continue
            point.setdefault("draws", [{k: point[k] for k in ("status", "metrics", "wall_time_s")}])
            if len(point["draws"]) < repeat:
                measure_again(point)
    if args.contenders is not None:
        land["contenders"] = {"within": args.contenders, "repeats": args.contender_repeats}
        while (short := [p for p in contenders(land, args.contenders) if len(p["draws"]) < args.contender_repeats]):
            for point in short:  # one pass: each contender once, so a slow spell spreads over all of them
                measure_again(point)
    print(f"{args.out}: {len(land['points'])} points ({ran} run now, {len(session.plan.stages) * len(micro_batches)} stage x micro-batch cells at most)")

if __name__ == "__main__":
    main()
