"""Is the search's model calibrated where it matters? At the end of a replayed session on a generated
landscape, its throughput model's posterior against the truth, over every configuration of the plan
that fits (each stage x knob set x the ladder's sizes and the best's size):

    python benchmarks/calibration.py [--landscapes 40] [--seed0 0] [--only SEED ...] [--savers] [--jobs 2] [--json OUT]

Per landscape, z = (log of the true value - posterior mean) / posterior sd, and:
- outside: the share of configurations whose true value is outside their 95% interval (|z| > 1.96),
  of all and of the near-best ones (true value within 3% of the best); calibrated, about 5%;
- near-best mean z: above 0, the model places the best region too low;
- the true best's z and sd: a large z means the search had no reason to run it;
- the declared optimum's z: below 0 on average, the model places the configuration it declares too
  high (a model that fits the landscape gives a mean of 0, selection or not).
Then the medians over landscapes, and each session's reach (best true value measured / best) and
declared value (true value / best), so that calibration can be read beside what it did.
"""

import argparse
import json
import math
import multiprocessing
import statistics
import sys
from pathlib import Path
from typing import Any, Dict

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import generator  # noqa: E402
import replay  # noqa: E402

NEAR = 0.97  # near-best: within 3% of the best


def calibration(job: tuple) -> Dict[str, Any]:
    from mlautotune.search.constrained import ladder

    seed, savers = job
    land = generator.make(seed, savers=savers)
    t, best = land["model"], generator.best(land)
    runner = replay.LandscapeRunner(land, seed=seed)
    tuner = replay.run_tuner(land, runner, "model_based", seed, 1)
    model = tuner.strategy.model(list(tuner.ledger.order))
    params, truth = [], []
    for stage in land["plan"]["stages"]:
        for knobs in generator.combos(land, stage):
            top = generator.largest(t, stage, knobs)
            for mbs in sorted(set(ladder(1, top)) | {m for m in [best["params"]["micro_batch"]] if m <= top}):
                p = generator.config(t, stage, mbs, knobs)
                status, metrics, _ = generator.true_point(t, p)
                if status == "ok":
                    params.append(p)
                    truth.append(metrics["throughput"])
    mu, sd = model.predict(params)
    y = np.log(np.array(truth))
    z = (y - mu) / sd
    near = y >= math.log(NEAR * best["value"])
    i = int(np.argmax(y))
    declared = tuner.best()
    declared_z = float("nan")
    if declared:
        (mu_d,), (sd_d,) = model.predict([declared.params])
        declared_z = float((math.log(runner.true_value(declared.params)) - mu_d) / sd_d)
    return {"declared_z": declared_z, "seed": seed, "configurations": len(params), "outside": float(np.mean(np.abs(z) > 1.96)),
            "near": int(near.sum()), "near_outside": float(np.mean(np.abs(z[near]) > 1.96)), "near_mean_z": float(np.mean(z[near])),
            "best_z": float(z[i]), "best_sd": float(sd[i]), "experiments": len(runner.log),
            "reach": max((e["value"] or 0.0) for e in runner.log) / best["value"],
            "declared": (runner.true_value(declared.params) or 0.0) / best["value"] if declared else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--landscapes", type=int, default=40)
    ap.add_argument("--seed0", type=int, default=0)
    ap.add_argument("--only", type=int, nargs="+", help="these seeds alone")
    ap.add_argument("--savers", action="store_true", help="the memory-saver family")
    ap.add_argument("--jobs", type=int, default=1, help="landscapes in parallel (processes)")
    ap.add_argument("--json", metavar="OUT", help="write the per-landscape figures")
    args = ap.parse_args()
    seeds = args.only or list(range(args.seed0, args.seed0 + args.landscapes))
    jobs = [(s, args.savers) for s in seeds]
    out = []
    with multiprocessing.Pool(args.jobs) as pool:
        for r in pool.imap(calibration, jobs):
            out.append(r)
            print(f"seed {r['seed']}: outside 95% {r['outside']:.0%} of {r['configurations']}, near-best {r['near_outside']:.0%} of {r['near']} "
                  f"(mean z {r['near_mean_z']:+.2f}); the best's z {r['best_z']:+.2f} (sd {r['best_sd']:.3f}); "
                  f"reach {r['reach']:.3f}, declared {r['declared']:.3f} in {r['experiments']} experiments", flush=True)
    med = lambda k: statistics.median(r[k] for r in out)  # noqa: E731
    print(f"\n{len(out)} landscapes, medians: outside 95% {med('outside'):.0%}, near-best outside {med('near_outside'):.0%}, "
          f"near-best mean z {med('near_mean_z'):+.2f}, the best's z {med('best_z'):+.2f}; "
          f"the best's |z| > 2 on {sum(abs(r['best_z']) > 2 for r in out)}; reach 99% on {sum(r['reach'] >= 0.99 for r in out)}; "
          f"the declared optimum's z: mean {statistics.mean(r['declared_z'] for r in out):+.2f}, sd {statistics.pstdev(r['declared_z'] for r in out):.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"commands": [" ".join(sys.argv)], "results": out}, indent=1))


if __name__ == "__main__":
    main()
