"""How finely a recorded landscape's truth tells its best configuration from the others.

    python benchmarks/resolution.py [LANDSCAPE.json ...] [--resamples 2000] [--json OUT]

A recorded point's "true" value is the median of its few draws (landscape.settle), so it is itself
uncertain. This resamples every point's ok draws with replacement (a bootstrap), takes the medians
again and looks at which configuration comes out best, and how far the recorded best's median moves.
Per landscape:
- draws: recorded draws per point (median);
- draw spread: the relative standard deviation of one draw (median over the points);
- best's error: the bootstrap standard error of the recorded best's median, relative to it;
- best wins: the share of resamples in which the recorded best is still the best;
- within 99%: the share in which it is within 1% of the resample's best;
- rivals: the configurations that come out best in at least 5% of the resamples.
A truth whose best wins in few resamples cannot score a 99% target: which configuration is within 1%
of the best depends on the draws recorded, not on the search. GPU-like landscapes have noise-free
values (`true_<metric>`): nothing to resample.
"""

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).parent))
from landscape import load, ok_draws, signed_metric  # noqa: E402

HERE = Path(__file__).parent
RIVAL = 0.05


def resolve(land: Dict[str, Any], resamples: int = 2000, seed: int = 0) -> Optional[Dict[str, Any]]:
    """The bootstrap figures of one recorded landscape (its points with two ok draws or more); None
    when no point has two (recorded once, or GPU-like: noise-free values and no draws)."""
    metric, sign = signed_metric(land)
    draws = {json.dumps(p["params"], sort_keys=True): [sign * d["metrics"][metric] for d in ok_draws(p)] for p in land["points"]}
    draws = {k: v for k, v in draws.items() if len(v) >= 2}
    if not draws:
        return None
    medians = {k: statistics.median(v) for k, v in draws.items()}
    best = max(medians, key=medians.get)
    rng = random.Random(seed)
    wins: Dict[str, int] = {}
    within, best_values = 0, []
    for _ in range(resamples):
        again = {k: statistics.median(rng.choices(v, k=len(v))) for k, v in draws.items()}
        top = max(again, key=again.get)
        wins[top] = wins.get(top, 0) + 1
        within += again[best] >= again[top] - 0.01 * abs(again[top])
        best_values.append(again[best])
    return {
        "landscape": land.get("name"), "points": len(draws), "draws": statistics.median(len(v) for v in draws.values()),
        "draw_spread": statistics.median(statistics.stdev(v) / abs(statistics.fmean(v)) for v in draws.values()),
        "best": json.loads(best), "best_error": statistics.stdev(best_values) / abs(medians[best]),
        "best_wins": wins.get(best, 0) / resamples, "best_within_99": within / resamples,
        "rivals": [{"params": json.loads(k), "wins": n / resamples, "median_vs_best": medians[k] / medians[best]}
                   for k, n in sorted(wins.items(), key=lambda kv: -kv[1]) if n / resamples >= RIVAL],
    }


def table(rows: List[Dict[str, Any]]) -> str:
    out = ["| landscape | points | draws | draw spread | best's error | best wins | best within 99% | rivals (wins, median vs best) |",
           "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        rivals = "; ".join(f"{_short(x['params'])} ({x['wins']:.0%}, {x['median_vs_best']:.3f})" for x in r["rivals"])
        out.append(f"| {r['landscape']} | {r['points']} | {r['draws']:g} | {r['draw_spread']:.1%} | {r['best_error']:.1%} | "
                   f"{r['best_wins']:.0%} | {r['best_within_99']:.0%} | {rivals} |")
    return "\n".join(out)


def _short(params: Dict[str, Any]) -> str:
    knobs = " ".join(f"{k}={v}" for k, v in params.items() if k not in ("stage", "micro_batch", "gas"))
    return f"z{params['stage']} mb{params['micro_batch']}" + (f" {knobs}" if knobs else "")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("landscapes", nargs="*", default=sorted(str(p) for p in (HERE / "landscapes").glob("*.json")))
    ap.add_argument("--resamples", type=int, default=2000)
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    rows = []
    for path in args.landscapes:
        land = load(Path(path))
        land.setdefault("name", Path(path).stem)
        row = resolve(land, args.resamples)
        if row is None:
            print(f"{land['name']}: noise-free or recorded once, nothing to resample")
        else:
            rows.append(row)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
