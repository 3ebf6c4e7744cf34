"""Warm start on generated landscapes: pairs of a landscape and a perturbed copy.

    python benchmarks/warm_pairs.py [--pairs 60] [--seed0 0] [--kinds speed,memory,gpus] [--processes 1]
                                    [--json OUT.json] [--only SEED [--kind K] [--trace]]
    python benchmarks/warm_pairs.py --table OUT.json [MORE.json ...] [--json MERGED.json]

A pair: landscape A = generator.make(seed) and B = perturb(seed, kind), drawn from A's traits with
its own seeded rng (nothing read from the product):
- speed: the same hardware; the compute throughput, memory bandwidth, link and network bandwidths,
  latencies and the knobs' costs each scaled by its own factor, 10-30% up or down;
- memory: another of the generator's device memory sizes;
- gpus: another of its GPU counts (a fixed global batch stays the user's: gas follows).
B is drawn again until some stage fits micro-batch 1 (a kind with no such B on a seed is skipped).

The product's search (model_based, 1 worker, replay.py's adapter) runs cold on A; its measured runs
become the warm start of a search on B (same hardware for "speed" only), with the same search seed
and measurement noise as a cold search on B. Both B searches are scored by replay.score against B's
noise-free best (generator.best): experiments to 99% (never = infinity) and the declared optimum's
regret. Seeds run in order, every kind on each seed; --pairs counts pairs, kinds taking turns.
"""

import argparse
import json
import math
import multiprocessing
import random
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import generator  # noqa: E402

KINDS = ("speed", "memory", "gpus")
SPEED_TRAITS = ("peak_flops", "hbm_bytes_s", "link_bytes_s", "network_bytes_s", "hop_s", "network_hop_s", "launch_s", "hook_s",
                "grad_hook_s", "bucket_s", "sm_steal", "overlap_efficiency")
REDRAWS = 20


class NoPerturbation(LookupError):
    """No B of this kind on this seed lets some stage fit micro-batch 1."""


def valid(t: Dict[str, Any]) -> bool:
    """Some stage fits micro-batch 1 within the micro-batch cap."""
    return generator.cap(t) >= 1 and any(generator.fits(t, generator.config(t, s, 1)) for s in range(4))


def perturb(seed: int, kind: str) -> Dict[str, Any]:
    """Landscape B of `kind` from A = generator.make(seed); its `traits` carry `perturbed`, what changed."""
    a = generator.make(seed)["traits"]
    rng = random.Random(f"perturb-{kind}-{seed}")
    if kind == "speed":
        for _ in range(REDRAWS):
            factors = {k: 1 + rng.choice((-1, 1)) * rng.uniform(0.1, 0.3) for k in SPEED_TRAITS if a.get(k) is not None}
            t = {**a, **{k: a[k] * f for k, f in factors.items()}}
            t["overlap_efficiency"] = min(0.99, t["overlap_efficiency"])
            if valid(t):
                return _landscape(seed, kind, t, {"factors": factors})
    elif kind in ("memory", "gpus"):
        trait = "gpu_memory_gb" if kind == "memory" else "gpus"
        options = [v for v in ([16, 24, 32, 40, 48, 80] if kind == "memory" else [8, 16, 24, 32, 48, 64]) if v != a[trait]]
        rng.shuffle(options)
        for v in options:
            t = {**a, trait: v}
            if kind == "gpus" and (v > 8) != (a["gpus"] > 8):  # a network between nodes appears or goes
                t["network_bytes_s"], t["network_hop_s"] = (rng.uniform(6e9, 50e9), rng.uniform(10e-6, 30e-6)) if v > 8 else (None, None)
            if valid(t):
                return _landscape(seed, kind, t, {"from": a[trait], "to": v})
    else:
        raise ValueError(f"kind {kind!r}: one of {', '.join(KINDS)}")
    raise NoPerturbation(f"seed {seed}: no {kind} perturbation lets a stage fit micro-batch 1")


def _landscape(seed: int, kind: str, t: Dict[str, Any], change: Dict[str, Any]) -> Dict[str, Any]:
    t = {**t, "perturbed": {"kind": kind, **change}}
    land = generator.landscape(seed, t, 1)
    land["name"] = f"gen_{seed}_{kind}"
    return land


def change_text(land: Dict[str, Any]) -> str:
    p = land["traits"]["perturbed"]
    if p["kind"] == "speed":
        f = p["factors"]
        return "speed " + " ".join(f"{k.removesuffix('_s').removesuffix('_bytes')} x{v:.2f}" for k, v in f.items())
    return f"{p['kind']} {p['from']} -> {p['to']}{'GB' if p['kind'] == 'memory' else ''}"


# ---- the pairs ------------------------------------------------------------------------------
def session(land: Dict[str, Any], seed: int, start: str, earlier: Any = None) -> Tuple[Dict[str, Any], Any]:
    """One search on `land`: the run as replay.score takes it, and the warm start a later session would
    take from it (its measured runs and declared optimum)."""
    import replay

    runner, found, runs = replay.replay_session(land, seed, earlier)
    run = {"landscape": land["name"], "strategy": "model_based", "start": start, "seed": seed, "workers": 1, "log": runner.log,
           "found": runner.true_value(found)}
    return run, lambda kind: replay.earlier_of(runs, land["name"], kind == "speed", found, same_ranks=kind == "memory",
                                                world_size=land["world_size"])


def run_pairs(seed: int, a: Dict[str, Any], bs: List[Dict[str, Any]], trace: bool = False) -> Dict[str, Any]:
    """Cold on A, then per B: warm from A's runs and cold, both scored against B's best."""
    import replay

    cold_a, warm_start = session(a, seed, "cold")
    out: Dict[str, Any] = {"seed": seed, "name": a["name"], "traits": a["traits"],
                           "a": replay.score([cold_a], generator.best(a)["value"])[0], "pairs": []}
    for b in bs:
        kind = b["traits"]["perturbed"]["kind"]
        best = generator.best(b)
        warm, _ = session(b, seed, "warm", warm_start(kind))
        cold, _ = session(b, seed, "cold")
        records = replay.score([cold, warm], best["value"])
        for r, start in zip(records, ("cold", "warm")):
            r.update(start=start, kind=kind)
        out["pairs"].append({"kind": kind, "change": change_text(b), "perturbed": b["traits"]["perturbed"], "best": best["value"],
                             "best_params": best["params"], "records": records,
                             **({"trace": replay.trace(warm, best["value"])} if trace else {})})
    return out


def evaluate(job: Tuple[int, List[str], bool]) -> Dict[str, Any]:
    seed, kinds, trace = job
    bs, skipped = [], []
    for kind in kinds:
        try:
            bs.append(perturb(seed, kind))
        except NoPerturbation:
            skipped.append(kind)
    out = run_pairs(seed, generator.make(seed), bs, trace)
    out["skipped"] = skipped
    return out


def to99(r: Dict[str, Any]) -> str:
    return "never" if r["to99"] is None else str(r["to99"])


def lines(result: Dict[str, Any]) -> List[str]:
    out = []
    for p in result["pairs"]:
        cold, warm = p["records"]
        out.append(f"seed {result['seed']} {p['kind']} [{p['change']}]: cold to99 {to99(cold)} regret {cold['regret']:.1%} "
                   f"({cold['experiments']} exp); warm to99 {to99(warm)} regret {warm['regret']:.1%} ({warm['experiments']} exp)")
    out += [f"seed {result['seed']} {k}: no valid perturbation, skipped" for k in result.get("skipped", [])]
    return out


# ---- the figures ----------------------------------------------------------------------------
def inf(v: Optional[int]) -> float:
    return math.inf if v is None else float(v)


def ratio(warm: float, cold: float) -> float:
    """warm / cold experiments to 99%: warm never is infinity, cold never alone 0 (as tables.ratio)."""
    if warm == math.inf:
        return math.inf
    return 0.0 if cold == math.inf else warm / cold


def fmt(v: float) -> str:
    return "never" if v == math.inf else f"{v:g}"


def row(name: str, pairs: List[Tuple[Dict[str, Any], Dict[str, Any]]]) -> Tuple[str, bool]:
    """A table row of (cold, warm) records, and whether the done-when target holds on them."""
    cold, warm = [c for c, _ in pairs], [w for _, w in pairs]
    med = {k: statistics.median(inf(r["to99"]) for r in rs) for k, rs in (("cold", cold), ("warm", warm))}
    never = {k: sum(r["to99"] is None for r in rs) for k, rs in (("cold", cold), ("warm", warm))}
    ratios = [ratio(inf(w["to99"]), inf(c["to99"])) for c, w in pairs]
    both = [w["to99"] / c["to99"] for c, w in pairs if c["to99"] and w["to99"]]
    fewer, more = sum(inf(w["to99"]) < inf(c["to99"]) for c, w in pairs), sum(inf(w["to99"]) > inf(c["to99"]) for c, w in pairs)
    rc, rw = [r["regret"] for r in cold], [r["regret"] for r in warm]
    lower, higher = sum(w["regret"] < c["regret"] for c, w in pairs), sum(w["regret"] > c["regret"] for c, w in pairs)
    exps = {k: statistics.median(r["experiments"] for r in rs) for k, rs in (("cold", cold), ("warm", warm))}
    met = (med["warm"] <= med["cold"] / 3 and statistics.median(rw) <= statistics.median(rc)
           and generator.quantile(rw, 0.95) <= generator.quantile(rc, 0.95))

    def regret(rs):
        return f"{statistics.median(rs):.1%} / {generator.quantile(rs, 0.95):.1%} / {max(rs):.1%}"

    text = (f"| {name} | {len(pairs)} | {fmt(med['cold'])} ({never['cold']} never) | {fmt(med['warm'])} ({never['warm']} never) | "
            f"{fmt(statistics.median(ratios)) if statistics.median(ratios) == math.inf else f'{statistics.median(ratios):.2f}'} "
            f"({f'{statistics.median(both):.2f}' if both else 'n/a'} over {len(both)}) | "
            f"{fewer} / {more} (p = {generator.sign_test(fewer, more):.2g}) | {regret(rc)} | {regret(rw)} | "
            f"{lower} / {higher} (p = {generator.sign_test(lower, higher):.2g}) | {exps['cold']:g} / {exps['warm']:g} | "
            f"{'met' if met else 'NOT met'} |")
    return text, met


def summary(results: List[Dict[str, Any]]) -> str:
    pairs = [(p["kind"], tuple(p["records"])) for res in results for p in res["pairs"]]
    if not pairs:
        return "no pairs"
    seeds = sorted(r["seed"] for r in results)
    skipped = [f"seed {r['seed']} {k}" for r in results for k in r.get("skipped", [])]
    out = [f"\n### Warm start: {len(pairs)} pairs on {len(seeds)} generated landscapes (seeds {seeds[0]}..{seeds[-1]}), model_based, 1 worker\n",
           "| kind | pairs | to 99% cold (median) | to 99% warm (median) | warm / cold to 99% (median; where both reached) "
           "| warm fewer / more to 99% (sign test) | regret cold median / p95 / worst | regret warm median / p95 / worst "
           "| warm lower / higher regret (sign test) | experiments cold / warm (median) | target |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    kinds = list(dict.fromkeys(k for k, _ in pairs))
    for kind in kinds + ["all"]:
        out.append(row(kind, [p for k, p in pairs if kind in (k, "all")])[0])
    out += ["", "Target (per row): median experiments to 99% warm <= 1/3 of cold (never = infinity), and the warm regret's median "
            "and p95 no higher than cold's.",
            "- ratio: warm never is infinity, cold never alone 0; replay one pair alone with "
            "`python benchmarks/warm_pairs.py --only SEED --kind KIND --trace`"]
    if skipped:
        out.append(f"- skipped (no valid perturbation): {', '.join(skipped)}")
    return "\n".join(out)


# ---- the command ----------------------------------------------------------------------------
def jobs_of(args: argparse.Namespace) -> List[Tuple[int, List[str], bool]]:
    kinds = [args.kind] if args.kind else args.kinds.split(",")
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        sys.exit(f"warm_pairs.py: unknown kind {', '.join(bad)}; use {', '.join(KINDS)}")
    if args.only is not None:
        return [(args.only, kinds, args.trace)]
    seeds = math.ceil(args.pairs / len(kinds))
    wanted = [(args.seed0 + i // len(kinds), kinds[i % len(kinds)]) for i in range(args.pairs)]
    return [(s, [k for ss, k in wanted if ss == s], args.trace) for s in range(args.seed0, args.seed0 + seeds)]


def write(path: Optional[str], commands: List[str], results: List[Dict[str, Any]]) -> None:
    if path:
        Path(path).write_text(json.dumps({"commands": commands, "results": sorted(results, key=lambda r: r["seed"])}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=60, help="pairs in all; kinds take turns on each seed")
    ap.add_argument("--seed0", type=int, default=0, help="the first landscape's seed")
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated subset of " + ", ".join(KINDS))
    ap.add_argument("--processes", type=int, default=1, help="seeds run in parallel (processes)")
    ap.add_argument("--json", metavar="OUT", help="write the results (after every seed)")
    ap.add_argument("--only", type=int, help="run this seed's pairs alone")
    ap.add_argument("--kind", help="with --only: this kind alone")
    ap.add_argument("--trace", action="store_true", help="print every experiment of the warm run (replay.trace)")
    ap.add_argument("--table", nargs="+", metavar="RECORD", help="print the figures of records written by --json (merged by seed)")
    args = ap.parse_args()
    if args.table:
        records = [json.loads(Path(p).read_text()) for p in args.table]
        merged = {r["seed"]: r for record in records for r in record["results"]}
        print(summary([merged[s] for s in sorted(merged)]))
        write(args.json, [c for record in records for c in record["commands"]], list(merged.values()))
        return
    results: List[Dict[str, Any]] = []
    command = " ".join(["python", *sys.argv])
    with multiprocessing.Pool(args.processes) if args.processes > 1 else generator._Serial() as pool:
        for result in pool.imap(evaluate, jobs_of(args)):
            results.append(result)
            for p in result["pairs"]:
                if "trace" in p:
                    print(p.pop("trace"))
            print("\n".join(lines(result)), flush=True)
            write(args.json, [command], results)
    print(summary(results), flush=True)


if __name__ == "__main__":
    main()
