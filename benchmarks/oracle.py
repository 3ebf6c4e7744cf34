"""What the budget can tell at a landscape's noise, for a search that knew where to look.

An oracle is handed the K truly best configurations of a generated landscape (generator.py), not
their order. It spends the budget (50 experiments) on them evenly, each experiment a fresh noisy
draw as the replay gives, and declares the one with the highest mean. Its regret (noise-free,
as generator.py scores the search), averaged over 200 repetitions of the noise and for one draw, is a floor that no
search with that budget can be expected to beat once it has found those K; where the search's
regret is far above it, the budget was spent elsewhere or the declaration went wrong.

    python benchmarks/oracle.py --landscapes 200 --seed0 0 --jobs 2 [--json OUT.json]

Shares nothing with the product: the truth and the noise are generator.py's.
"""

import argparse
import json
import random
import statistics
import sys
from multiprocessing import Pool
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).parent))
import generator  # noqa: E402

BUDGET = 50
SIZES = (3, 10, 25, 50)
REPEATS = 200


def true_values(land: Dict[str, Any]) -> List[float]:
    """Every configuration of the plan that fits, noise-free, best first."""
    return sorted((v for stage in land["plan"]["stages"] for v, _ in generator.fitting(land, stage)), reverse=True)


def regret(top: List[float], noise: float, rng: random.Random, budget: int = BUDGET) -> float:
    """The oracle on these true values (the best first): the budget spread evenly over them, each
    experiment a fresh draw of generator.py's noise; the regret of the highest mean."""
    each = max(1, budget // len(top))
    seen = [statistics.mean(generator.noisy({"throughput": v, "latency": 1.0, "FLOPS_per_gpu": 1.0, "interval_rel": noise}, rng)["throughput"]
                            for _ in range(each)) for v in top]
    return 1 - top[max(range(len(top)), key=seen.__getitem__)] / top[0]


def one(seed: int) -> Dict[str, Any]:
    land = generator.make(seed)
    values, noise = true_values(land), land["traits"]["noise_rel"]
    out: Dict[str, Any] = {"seed": seed, "noise_rel": noise, "within_3pct": sum(v >= 0.97 * values[0] for v in values)}
    for k in SIZES:
        regrets = [regret(values[:k], noise, random.Random(seed * REPEATS + rep)) for rep in range(REPEATS)]  # independent draws on every landscape
        out[f"top{k}"] = statistics.mean(regrets)
        out[f"top{k}_one"] = regrets[0]  # one draw of the noise, as a search gets
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--landscapes", type=int, default=200)
    ap.add_argument("--seed0", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--json", dest="out")
    args = ap.parse_args()
    seeds = list(range(args.seed0, args.seed0 + args.landscapes))
    with Pool(args.jobs) as pool:
        results = pool.map(one, seeds)
    for k in SIZES:
        for key, what in ((f"top{k}", "mean over the noise"), (f"top{k}_one", "one draw of the noise")):
            r = [x[key] for x in results]
            print(f"top {k:2d}, {max(1, BUDGET // k)} experiments each, {what}: regret median {statistics.median(r):.2%} / "
                  f"p95 {generator.quantile(r, 0.95):.2%} / worst {max(r):.2%}; above 2% on {sum(v > 0.02 for v in r)} of {len(r)}")
    print(f"configurations within 3% of the best: median {statistics.median(x['within_3pct'] for x in results)}")
    if args.out:
        command = f"benchmarks/oracle.py --landscapes {args.landscapes} --seed0 {args.seed0}"
        Path(args.out).write_text(json.dumps({"commands": [command], "results": results}, indent=1))


if __name__ == "__main__":
    main()
