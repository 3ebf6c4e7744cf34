"""Replay benchmark: the product search (mlautotune.search.Tuner, with only its runner swapped for
a landscape lookup) against each landscape, for every tuner type.

    python benchmarks/replay.py [--seeds 3] [landscape.json ...]

Per strategy: experiments to reach 95% / 99% of the landscape's best, the final regret
(1 - true value of the declared optimum / best), experiments run and wall time spent (failures
included). Medians over seeds. `deepspeed_baseline` is benchmarks/ds_baseline.py, DeepSpeed's own
algorithm as the facts file describes it, against the same landscapes.
"""

import argparse
import logging
import statistics
import sys
from pathlib import Path

import optuna

sys.path.insert(0, str(Path(__file__).parent))
from landscape import LandscapeRunner, interpolation, load, make_experiment, plan_of  # noqa: E402
from mlautotune.search import SearchSettings, Tuner  # noqa: E402

HERE = Path(__file__).parent
STRATEGIES = ("model_based", "gridsearch", "random", "deepspeed_baseline")


def model_for(land):
    if land["source"] != "synthetic":
        return interpolation(land)
    import synthetic

    return lambda params: synthetic.evaluate(synthetic.MODELS[land["name"]], params)


def replay(land, strategy, seed):
    runner = LandscapeRunner(land, model_for(land))
    if strategy == "deepspeed_baseline":
        import ds_baseline

        calls, best = ds_baseline.run(runner, plan_of(land), land["world_size"], land["memory_limit_bytes"], seed)
        return calls, (runner.value(best) or 0.0) if best else 0.0, runner
    calls = []

    def run(exp):
        result = runner(exp)
        calls.append((dict(exp.params), result))
        return result

    settings = SearchSettings(metric="throughput", tuner_type=strategy, seed=seed, early_stopping=5, num_trials=50, remeasure=0,
                              memory_limit_bytes=land["memory_limit_bytes"], world_size=land["world_size"], device=land["device"])
    study = optuna.create_study(direction="maximize")
    outcome = Tuner(plan_of(land), settings, study, make_experiment, run).tune()
    found = runner.value(outcome.best.params) if outcome.best else 0.0
    return calls, found, runner


def summarise(land, rows):
    best = max(max(p["metrics"]["throughput"] for p in land["points"] if p["status"] == "ok"), *(r["found"] for r in rows))
    out = []
    for r in rows:
        values, first = [], {}
        so_far = 0.0
        for i, (params, result) in enumerate(r["calls"], 1):
            if result.status == "ok":
                so_far = max(so_far, result.metrics["throughput"])
            for level in (0.95, 0.99):
                if level not in first and so_far >= level * best:
                    first[level] = i
        out.append({"to95": first.get(0.95), "to99": first.get(0.99), "regret": 1 - r["found"] / best, "experiments": len(r["calls"]), "wall_h": r["wall"] / 3600})
    return out


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("landscapes", nargs="*", default=sorted(str(p) for p in (HERE / "landscapes").glob("*.json")))
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("mlautotune").setLevel(logging.ERROR)
    targets = []
    for path in args.landscapes:
        land = load(path)
        print(f"\n### {land['name']}\n")
        print("| strategy | experiments to 95% | experiments to 99% | final regret | experiments | wall time (h) |")
        print("|---|---:|---:|---:|---:|---:|")
        per_strategy = {}
        for strategy in STRATEGIES:
            rows = []
            for seed in range(args.seeds):
                calls, found, runner = replay(land, strategy, seed)
                rows.append({"calls": calls, "found": found, "wall": runner.wall_time_s})
            s = per_strategy[strategy] = summarise(land, rows)
            print(f"| {strategy} | {fmt(median([x['to95'] for x in s]))} | {fmt(median([x['to99'] for x in s]))} | "
                  f"{median([x['regret'] for x in s]):.1%} | {median([x['experiments'] for x in s]):.0f} | {median([x['wall_h'] for x in s]):.2f} |")
        mb, ds = per_strategy["model_based"], per_strategy["deepspeed_baseline"]
        targets.append((land["name"], median([x["to99"] for x in mb]), median([x["to99"] for x in ds]), max(x["regret"] for x in mb)))
    print("\n### Targets\n")
    print("| landscape | model_based to 99% | baseline to 99% | model_based / baseline | model_based worst final regret |")
    print("|---|---:|---:|---:|---:|")
    for name, a, b, worst in targets:
        ratio = f"{a / b:.2f}" if a is not None and b is not None else "undefined"
        print(f"| {name} | {fmt(a)} | {fmt(b)} | {ratio} | {worst:.1%} |")
    ratios = [a / b for _, a, b, _ in targets if a is not None and b is not None]
    print(f"\nmodel_based reaches 99% on {sum(t[1] is not None for t in targets)} of {len(targets)} landscapes, the baseline on "
          f"{sum(t[2] is not None for t in targets)}; median ratio where both do: {f'{statistics.median(ratios):.2f}' if ratios else 'n/a (no landscape where both do)'} "
          f"(target: at most 0.5); worst model_based final regret: {max(t[3] for t in targets):.1%} (target: at most 3%)")


def fmt(v, f="{:.0f}"):
    return "never" if v is None else f.format(v)


if __name__ == "__main__":
    main()
