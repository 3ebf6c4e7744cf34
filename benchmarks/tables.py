"""Markdown tables from `replay.py --json` records.

    python benchmarks/tables.py /tmp/replay.json      # one table per landscape, then the targets

"never" counts as a miss everywhere: a median takes it as infinity (so the median itself is
"never" when half the seeds or more never got there), and each cell says how many seeds never did.
"""

import json
import math
import statistics
import sys
from typing import Any, Dict, List, Optional

STRATEGIES = ("model_based", "gridsearch", "random", "deepspeed_baseline")
INF = math.inf


def median(values: List[Optional[float]]) -> float:
    return statistics.median([INF if v is None else v for v in values]) if values else INF


def steps(values: List[Optional[int]]) -> str:
    """Median experiments to a level, never = infinity, with the seeds that never reached it."""
    m = median(values)
    text = "never" if m == INF else f"{m:g}"
    never = sum(v is None for v in values)
    return f"{text} ({never}/{len(values)} never)" if never else text


def rows(records: List[Dict[str, Any]], landscape: str, strategy: str, workers: int = 1) -> List[Dict[str, Any]]:
    return [r for r in records if r["landscape"] == landscape and r["strategy"] == strategy and r.get("workers", 1) == workers]


def landscape_table(records: List[Dict[str, Any]], landscape: str) -> str:
    out = [f"\n### {landscape}\n", "| strategy | experiments to 95% | experiments to 99% | final regret (median / worst) | experiments | failures | wall hours | wall hours to 99% |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for strategy in STRATEGIES:
        rs = rows(records, landscape, strategy)
        if not rs:
            continue
        wall99 = median([r["wall_hours_to99"] for r in rs])
        out.append(f"| {strategy} | {steps([r['to95'] for r in rs])} | {steps([r['to99'] for r in rs])} | "
                   f"{median([r['regret'] for r in rs]):.1%} / {max(r['regret'] for r in rs):.1%} | {median([r['experiments'] for r in rs]):g} | "
                   f"{median([r.get('failures', 0) for r in rs]):g} | {median([r['wall_hours'] for r in rs]):.2f} | {'never' if wall99 == INF else f'{wall99:.2f}'} |")
    return "\n".join(out)


def ratio(a: float, b: float) -> float:
    """model_based / baseline experiments to 99%: a miss of model_based is infinity, a miss of the baseline alone 0."""
    if a == INF:
        return INF
    return 0.0 if b == INF else a / b


def targets(records: List[Dict[str, Any]]) -> str:
    landscapes = list(dict.fromkeys(r["landscape"] for r in records))
    out = ["\n### Targets\n", "| landscape | model_based to 99% | baseline to 99% | ratio | model_based worst regret | model_based experiments after reaching 99% (median / worst) |",
           "|---|---:|---:|---:|---:|---:|"]
    ratios, worst, after = [], [], []
    for name in landscapes:
        mb, ds = rows(records, name, "model_based"), rows(records, name, "deepspeed_baseline")
        if not mb:
            continue
        a, b = median([r["to99"] for r in mb]), median([r["to99"] for r in ds]) if ds else INF
        r = ratio(a, b) if ds else None
        if r is not None:
            ratios.append(r)
        worst.append(max(x["regret"] for x in mb))
        found = [x["after99"] for x in mb if x["after99"] is not None]
        after += found
        after_text = f"{statistics.median(found):g} / {max(found)}" if found else "n/a (never reached)"
        out.append(f"| {name} | {steps([x['to99'] for x in mb])} | {steps([x['to99'] for x in ds]) if ds else 'n/a'} | "
                   f"{'n/a' if r is None else ('never' if r == INF else f'{r:.2f}')} | {worst[-1]:.1%} | {after_text} |")
    med = statistics.median(ratios) if ratios else None
    out.append("")
    out.append(f"- model_based / baseline experiments to 99%, median over {len(ratios)} landscapes: "
               f"{'n/a' if med is None else ('never' if med == INF else f'{med:.2f}')} (target <= 0.33; never counted as a miss)")
    out.append(f"- model_based worst final regret: {max(worst):.1%} (target <= 3% on every landscape and seed)" if worst else "- no model_based runs")
    out.append(f"- model_based experiments after reaching 99% (seeds that reached it): median {statistics.median(after):g}, worst {max(after)} (target <= 5)"
               if after else "- model_based never reached 99%")
    return "\n".join(out)


def hours(h: float) -> str:
    return "never" if h == INF else f"{h:.2f}"


def workers_cell(rs: List[Dict[str, Any]]) -> str:
    if not rs:
        return "sequential: 1 worker only"
    h = median([r["wall_hours_to99"] for r in rs])
    return steps([r["to99"] for r in rs]) if h == INF else f"{hours(h)} ({steps([r['to99'] for r in rs])})"


def workers_table(records: List[Dict[str, Any]]) -> str:
    """Wall hours to 99% (median over seeds, never = infinity) and experiments to 99% against the
    number of workers, per landscape and strategy; then, per strategy, the median over landscapes
    of wall hours to 99% with the most workers over those with 1 (a miss with the most workers is
    infinity, a miss with 1 alone 0)."""
    counts = sorted({r.get("workers", 1) for r in records})
    landscapes = list(dict.fromkeys(r["landscape"] for r in records))
    out = ["\n### Wall hours to 99% against the number of workers (simulated)\n",
           "| landscape | strategy | " + " | ".join(f"{n} worker{'s' * (n > 1)}: wall hours to 99% (experiments)" for n in counts) + " |",
           "|---|---|" + "---:|" * len(counts)]
    ratios: Dict[str, List[float]] = {}
    for name in landscapes:
        for strategy in STRATEGIES:
            cells = {n: rows(records, name, strategy, n) for n in counts}
            if not any(cells.values()):
                continue
            out.append(f"| {name} | {strategy} | " + " | ".join(workers_cell(rs) for rs in cells.values()) + " |")
            if len(counts) > 1 and cells[counts[0]] and cells[counts[-1]]:
                ratios.setdefault(strategy, []).append(ratio(median([r["wall_hours_to99"] for r in cells[counts[-1]]]),
                                                             median([r["wall_hours_to99"] for r in cells[counts[0]]])))
    out.append("")
    for strategy, rs in ratios.items():
        med = statistics.median(rs)
        out.append(f"- {strategy}: wall hours to 99% with {counts[-1]} workers / with {counts[0]}, median over {len(rs)} landscapes: "
                   f"{'never' if med == INF else f'{med:.2f}'}" + (" (target <= 0.35; never counted as a miss)" if strategy == "model_based" else ""))
    if "deepspeed_baseline" not in ratios and any(r["strategy"] == "deepspeed_baseline" for r in records):
        out.append("- deepspeed_baseline: sequential (each experiment waits for the one before it), so it runs with 1 worker only")
    return "\n".join(out)


def main(path: str) -> None:
    records = json.loads(open(path).read())
    for name in dict.fromkeys(r["landscape"] for r in records):
        print(landscape_table(records, name))
    print(targets(records))
    if len({r.get("workers", 1) for r in records}) > 1:
        print(workers_table(records))


if __name__ == "__main__":
    main(sys.argv[1])
