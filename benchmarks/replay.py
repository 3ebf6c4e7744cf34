"""Replay benchmark: the product's search, with only its runner swapped for a landscape lookup,
and a model of DeepSpeed's own autotuner (ds_baseline.py), against landscapes.

    python benchmarks/replay.py [LANDSCAPE.json ...] [--seeds 5] [--workers 1,2,4] [--json OUT.json] [--trace]

Without landscapes, every file in benchmarks/landscapes/. The product runs with its own defaults
(conf/: tuner_num_trials 50, search.stop_probability 0.05, ...), once per tuner type
(model_based, gridsearch, random) and seed. On GPU-like landscapes every measurement, each
re-measurement included, is a fresh noisy draw (seeded); on recorded CPU landscapes it is one of
the point's recorded draws (seeded), or its one recorded value if it was measured once.

Scored against the noise-free value (`true_<metric>`; on CPU landscapes the median of a point's draws):
- to95 / to99: the experiments run until one of them is within 95% / 99% of the landscape's best
  (null: never);
- regret: 1 - true value of the declared optimum / best (1.0 when nothing is declared);
- experiments (launches, failures and re-measurements included), wall hours (the same), and the
  wall hours until 99% was reached.
--json writes one record per landscape x strategy x seed (x workers); the tables (tables.py) count
"never" as a miss: medians take it as infinity, and each cell says how many seeds never got there.

--workers N[,N...]: the product's tuner runs as N workers on one study in simulated wall-clock time
(parallel.py); each record has `workers`, and its wall hours are simulated finish times. The
DeepSpeed baseline is sequential (each experiment is chosen from the one before it), so it runs
with 1 worker only.
"""

import argparse
import json
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).parent))
import ds_baseline  # noqa: E402
import parallel  # noqa: E402
import tables  # noqa: E402
from landscape import LandscapeRunner, load, noisy  # noqa: E402

HERE = Path(__file__).parent
STRATEGIES = ("model_based", "gridsearch", "random", "deepspeed_baseline")


def run_product(land: Dict[str, Any], runner: LandscapeRunner, tuner_type: str, seed: int, workers: int = 1,
                earlier: Any = None) -> Optional[Dict[str, Any]]:
    """The adapter to the product: run its search with its defaults on the landscape, with `workers`
    tuners on one study in simulated time (parallel.py); the declared optimum's params. `earlier`:
    a warm start (`earlier_of`)."""
    best = run_tuner(land, runner, tuner_type, seed, workers, earlier).best()
    return dict(best.params) if best else None


def run_tuner(land: Dict[str, Any], runner: LandscapeRunner, tuner_type: str, seed: int, workers: int = 1, earlier: Any = None) -> Any:
    """run_product's search; the first tuner at its end (its `best()` is the declared optimum, its
    `ledger.order` the measured runs)."""
    import optuna

    from mlautotune.inputs.config import AutotuningConf, SearchConf
    from mlautotune.run.experiment import Experiment, Resources, Result
    from mlautotune.search import SearchSettings, Tuner
    from mlautotune.inputs.space import MicroBatchRule, TuningPlan

    p, at, search = land["plan"], AutotuningConf(), SearchConf()
    plan = TuningPlan(stages=list(p["stages"]), knobs={int(s): v for s, v in p["knobs"].items()},
                      micro_batch=MicroBatchRule(p["micro_batch"]["mode"], tuple(p["micro_batch"]["values"])), gas=p["gas"],
                      max_train_batch_size=p.get("max_train_batch_size"), mp_size=1, fast=p["fast"], base_config=p.get("base_config", {}),
                      data_parallel=land["world_size"], checkpointing=bool(p.get("checkpointing")), offload_device=p.get("offload_device"))
    settings = SearchSettings(metric=land.get("metric", at.metric), tuner_type=tuner_type, seed=seed, num_trials=at.tuner_num_trials,
                              stop_probability=search.stop_probability, memory_limit_bytes=land["memory_limit_bytes"],
                              world_size=land["world_size"], device=land["device"],
                              host_memory_bytes=land.get("host_memory_bytes"), local_ranks=min(8, land["world_size"]))

    def make_experiment(params):
        from mlautotune.inputs.space import experiment_name

        knobs = {k: v for k, v in params.items() if k not in ("stage", "micro_batch", "gas")}
        return Experiment(experiment_name(params["stage"], params["gas"], params["micro_batch"], knobs), {}, "replay", [], Resources(), dict(params))

    def run(exp):
        status, metrics, wall = runner.measure(exp.params)
        return Result(exp.name, status, metrics, "" if status == "ok" else f"{status} (landscape)", wall)

    def make_tuner(storage):
        study = optuna.create_study(storage=storage, study_name="replay", direction="maximize", load_if_exists=True)
        return Tuner(plan, replace(settings, alone=workers == 1), study, make_experiment, run, earlier=earlier)

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("mlautotune").setLevel(logging.ERROR)
    return parallel.simulate(make_tuner, optuna.storages.InMemoryStorage(), workers, runner)


def replay_session(land: Dict[str, Any], seed: int, earlier: Any = None):
    """One model_based search with 1 worker, as a session the next one can start from: (runner with
    its log, declared optimum's params or None, the session's measured runs for `earlier_of`)."""
    runner = LandscapeRunner(land, seed=seed)
    tuner = run_tuner(land, runner, "model_based", seed, 1, earlier)
    best = tuner.best()
    return runner, dict(best.params) if best else None, list(tuner.ledger.order)


def earlier_of(runs: List[Any], session: str, same_hardware: bool, optimum: Optional[Dict[str, Any]] = None, same_ranks: bool = False,
               world_size: Optional[int] = None) -> Any:
    """The product's warm start from one earlier session's measured runs (replay_session's), numbered
    -1, -2, ... as earlier runs are; `optimum`: the params that session declared; `same_ranks`: the
    same accelerator and world size, another memory size; `world_size`: that session's, recorded on
    its successful runs as the probe records it. Every landscape's device is a GPU: the same accelerator."""
    from mlautotune.search.warm import Earlier

    def numbered(i: int, m: Any) -> Any:
        metrics = {**m.result.metrics, "world_size": world_size} if m.ok and world_size else m.result.metrics
        return replace(m, trial_number=-1 - i, result=replace(m.result, metrics=metrics))

    optima = [m.result.name for m in runs if optimum is not None and m.params == optimum][:1]
    return Earlier(sessions=[session], runs=[numbered(i, m) for i, m in enumerate(runs)], same_hardware=same_hardware,
                   same_ranks=same_hardware or same_ranks, optima=optima, same_accelerator=True)


def replay(land: Dict[str, Any], strategy: str, seed: int, workers: int = 1):
    """One search on one landscape: (runner with its log, declared optimum's params or None)."""
    runner = LandscapeRunner(land, seed=seed)
    if strategy == "deepspeed_baseline":  # sequential: each step needs the result of the one before
        return runner, ds_baseline.run(runner.measure, land, seed=seed)
    return runner, run_product(land, runner, strategy, seed, workers)


def score(runs: List[Dict[str, Any]], grid_best: float) -> List[Dict[str, Any]]:
    """Records for the runs of one landscape, against the best true value seen anywhere."""
    best = max([grid_best] + [e["value"] for r in runs for e in r["log"] if e["value"] is not None])
    records = []
    for r in runs:
        reached: Dict[float, int] = {}
        so_far, wall, wall99 = 0.0, 0.0, None
        for i, (e, end) in enumerate(zip(r["log"], parallel.finish_times(r["log"])), 1):
            so_far = max(so_far, e["value"] or 0.0)
            wall = max(wall, end)
            for level in (0.95, 0.99):
                if level not in reached and so_far >= level * best:
                    reached[level] = i
                    if level == 0.99:
                        wall99 = wall
        n = len(r["log"])
        records.append({
            "landscape": r["landscape"], "strategy": r["strategy"], "seed": r["seed"], "workers": r.get("workers", 1),
            "to95": reached.get(0.95), "to99": reached.get(0.99), "regret": 1 - (r["found"] or 0.0) / best,
            "experiments": n, "wall_hours": wall / 3600, "wall_hours_to99": None if wall99 is None else wall99 / 3600,
            "failures": sum(e["status"] != "ok" for e in r["log"]), "after99": None if 0.99 not in reached else n - reached[0.99],
        })
    return records


def trace(run: Dict[str, Any], best: float) -> str:
    """One replayed search, an experiment a line: what ran, what the search saw and the truth, both
    as fractions of the landscape's best; then the declared optimum's truth."""
    def frac(v):
        return "-" if v is None else f"{v / best:.3f}"

    lines = [f"# {run['landscape']} {run['strategy']} seed {run['seed']} workers {run['workers']}"]
    for i, e in enumerate(run["log"], 1):
        params = " ".join(f"{k}={v}" for k, v in e["params"].items())
        lines.append(f"{i:3d} {e['status']:4s} seen {frac(e.get('observed'))} true {frac(e['value'])}  {params}"
                     + (f"  ({e['why']})" if e.get("why") else ""))
    declared = " ".join(f"{k}={v}" for k, v in (run.get("declared") or {}).items())
    lines.append(f"declared: true {frac(run['found'])}  {declared}".rstrip())
    return "\n".join(lines)


def grid_best(land: Dict[str, Any]) -> float:
    ok = [p["metrics"] for p in land["points"] if p["status"] == "ok"]
    return max(m.get("true_throughput", m["throughput"]) for m in ok)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("landscapes", nargs="*", default=sorted(str(p) for p in (HERE / "landscapes").glob("*.json")))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--json", metavar="OUT", help="write one record per landscape x strategy x seed")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset of " + ", ".join(STRATEGIES))
    ap.add_argument("--workers", default="1", help="comma-separated worker counts, e.g. 1,2,4 (simulated wall-clock time; "
                    "the deepspeed baseline is sequential and runs with 1 only)")
    ap.add_argument("--trace", action="store_true", help="print every replayed experiment: params, the value the search saw, the true value")
    args = ap.parse_args()
    counts = [int(n) for n in args.workers.split(",")]
    records = []
    for path in args.landscapes:
        land = load(path)
        runs = []
        for strategy in args.strategies.split(","):
            for workers in ([1] if strategy == "deepspeed_baseline" else counts):
                for seed in range(args.seeds):
                    runner, found = replay(land, strategy, seed, workers)
                    runs.append({"landscape": land["name"], "strategy": strategy, "seed": seed, "workers": workers, "log": runner.log,
                                 "found": runner.true_value(found), "declared": found})
                    if args.trace:
                        print(trace(runs[-1], grid_best(land)), flush=True)
        records += score(runs, grid_best(land))
        print(tables.landscape_table(records, land["name"]), flush=True)
        if not noisy(land):
            print(f"\n(recorded landscape: {land.get('repeats', 1)} recorded measurement(s) per point; its value is their median, and each "
                  "measurement in the replay is one of them)")
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    print(tables.targets(records))
    if len(counts) > 1:
        print(tables.workers_table(records))


if __name__ == "__main__":
    main()
