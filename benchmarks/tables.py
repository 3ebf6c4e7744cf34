"""Every benchmark table of README.md and benchmarks/README.md, from the records in benchmarks/.

    python benchmarks/tables.py                      # all of them, each under the README section it goes in
    python benchmarks/tables.py /tmp/replay.json     # the replay tables of any `replay.py --json` record

The records: results/fixed8_w1.json (the search and the DeepSpeed baseline on the eight fixed
landscapes, 10 seeds, 1 worker), results/replay_w1_60seeds.json (the step-rule search the search
replaced, and the DeepSpeed baseline, 60 seeds, 1 worker: the fixed eight's comparison baseline),
results/noise_*.json (noise.py),
results/overhead.json (overhead.py), results/versus_deepspeed.json (versus_deepspeed.py) and the
recorded landscapes in landscapes/ (resolution.py's table).

"never" counts as a miss everywhere: a median takes it as infinity (so the median itself is
"never" when half the seeds or more never got there), and each cell says how many seeds never did.
"""

import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))

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
    out = [f"\n#### {landscape}\n", "| strategy | experiments to 95% | experiments to 99% | final regret (median / worst) | experiments | failures | wall hours | wall hours to 99% |",
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


def strategies_table(records: List[Dict[str, Any]], shown: tuple = ("model_based", "deepspeed_baseline")) -> str:
    """landscape_table's rows of the `shown` strategies for every landscape in one table (the 1-worker
    runs), then a line for each other strategy over all landscapes."""
    out = ["| landscape | strategy | experiments to 95% | experiments to 99% | final regret (median / worst) | experiments | failures | wall hours | wall hours to 99% |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in dict.fromkeys(r["landscape"] for r in records):
        out += [f"| {name} {row}" for row in landscape_table(records, name).splitlines()[5:] if row.split(" | ")[0][2:] in shown]
    out.append("")
    one = [r for r in records if r.get("workers", 1) == 1]

    def totals(strategy: str) -> str:
        rs = [r for r in one if r["strategy"] == strategy]
        return (f"reaches 99% in {sum(r['to99'] is not None for r in rs)} of {len(rs)} runs, {sum(r['experiments'] for r in rs)} experiments "
                f"in all, worst regret {max(r['regret'] for r in rs):.1%}")

    for strategy in STRATEGIES:
        if strategy not in shown and any(r["strategy"] == strategy for r in one):
            out.append(f"- {strategy}: {totals(strategy)} (model_based: {totals('model_based')})")
    return "\n".join(out)


def ratio(a: float, b: float) -> float:
    """model_based / baseline experiments to 99%: a miss of model_based is infinity, a miss of the baseline alone 0."""
    if a == INF:
        return INF
    return 0.0 if b == INF else a / b


def target_figures(records: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The three search targets: model_based / baseline experiments to 99% (median over landscapes),
    the worst final regret, and the experiments run after reaching 99% (median and worst)."""
    text = targets(records)
    return {"ratio": _figure(text, "model_based / baseline"), "worst_regret": _figure(text, "model_based worst final regret"),
            "after99": _figure(text, "model_based experiments after reaching 99%")}


def _figure(text: str, start: str) -> str:
    line = next(x for x in text.splitlines() if x.startswith("- " + start))
    return line.split(": ", 1)[1].split(" (target")[0]


def targets(records: List[Dict[str, Any]]) -> str:
    landscapes = list(dict.fromkeys(r["landscape"] for r in records))
    out = ["\n#### Targets\n", "| landscape | model_based to 99% | baseline to 99% | ratio | model_based worst regret | model_based experiments after reaching 99% (median / worst) |",
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
    out = ["\n#### Wall hours to 99% against the number of workers (simulated)\n",
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


def replay_tables(records: List[Dict[str, Any]]) -> str:
    out = [landscape_table(records, name) for name in dict.fromkeys(r["landscape"] for r in records)]
    out.append(targets(records))
    if len({r.get("workers", 1) for r in records}) > 1:
        out.append(workers_table(records))
    return "\n".join(out)


def workers_ratio(records: List[Dict[str, Any]]) -> str:
    """model_based's wall hours to 99% with the most workers over those with 1, median over landscapes."""
    line = next(x for x in workers_table(records).splitlines() if x.startswith("- model_based:"))
    return line.split(": ")[-1].split(" (target")[0]


def load(name: str) -> Any:
    return json.loads((RESULTS / name).read_text())


def pct(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def noise_table(record: Dict[str, Any]) -> str:
    """noise.py --json: per method and condition, the median throughput and the spread over repeats."""
    out = ["| method | condition | repeats | median samples/s | CV over repeats (90% range) | median interval | median wall s | flagged disturbed |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    for method, conditions in record["summary"].items():
        for cond, s in conditions.items():
            lo, hi = s.get("cv_90pct_range", (None, None))
            out.append(f"| {method} | {cond} | {s['repeats']} | {s['median_throughput']:.1f} | {pct(s['cv'])} ({pct(lo)}-{pct(hi)}) | "
                       f"+-{pct(s['median_interval_rel'])} | {s['median_wall_s']:.1f} | {s['disturbed']}/{s['ok']} |")
    return "\n".join(out)


def window_length_table(record: Dict[str, Any]) -> str:
    out = ["| run | micro-batch | script steps | median samples/s | CV over repeats | median interval | median wall s | flagged disturbed |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, run in record["runs"].items():
        s = run["summary"]["pinned"]["quiet"]
        out.append(f"| {name} | {run['args']['mbs']} | {run['args']['steps']} | {s['median_throughput']:.1f} | {pct(s['cv'])} | "
                   f"+-{pct(s['median_interval_rel'])} | {s['median_wall_s']:.1f} | {s['disturbed']}/{s['ok']} |")
    return "\n".join(out)


def overhead_table(record: Dict[str, Any]) -> str:
    bare, runner = statistics.median(record["bare_s"]), statistics.median(record["runner_s"])
    out = [f"| run | wall time (median of {len(record['bare_s'])}) | all runs |", "|---|---:|---|",
           f"| bare `deepspeed --num_gpus 2 gpt.py --steps {record['args']['steps']}` | {bare:.1f} s | {', '.join(f'{x:.1f}' for x in record['bare_s'])} |",
           f"| `run_experiment` (launcher + probe) | {runner:.1f} s | {', '.join(f'{x:.1f}' for x in record['runner_s'])} |",
           "", f"- ratio runner / bare: **{runner / bare:.2f}**; load average before / after: {record['load_before_after'][0]:.1f} / {record['load_before_after'][1]:.1f}",
           "", "| phase of one experiment (slowest rank) | median s | share |", "|---|---:|---:|"]
    for label in record["phases_s"][0]:
        x = statistics.median(d[label] for d in record["phases_s"])
        out.append(f"| {label} | {x:.2f} | {x / runner:.1%} |")
    return "\n".join(out)


def overhead_ratio(record: Dict[str, Any]) -> float:
    return statistics.median(record["runner_s"]) / statistics.median(record["bare_s"])


def describe_pick(config: Optional[Dict[str, Any]]) -> str:
    if not config:
        return "none"
    return f"z{config.get('zero_optimization', {}).get('stage')} mbs {config.get('train_micro_batch_size_per_gpu')} gas {config.get('gradient_accumulation_steps')}"


def versus_table(record: Dict[str, Any]) -> str:
    out = ["| workload | tool | experiments | tuning wall time (s) | pick | pick re-measured, samples/s (median, spread) |",
           "|---|---|---:|---:|---|---:|"]
    for workload, run in record.items():
        for tool in ("deepspeed", "mlautotune"):
            r, m = run[tool], run["remeasured"].get(tool, {})
            out.append(f"| {workload} | {tool} | {r['experiments']} | {r['wall_s']:.0f} | {describe_pick(r['pick'])} | "
                       f"{m['median']:.1f} ({m['spread']:.1%}) |")
    out.append("")
    for workload, ratio_ in versus_ratios(record).items():
        out.append(f"- {workload}: mlautotune / DeepSpeed tuning wall time {ratio_:.2f} (target <= 0.5)")
    return "\n".join(out)


def versus_ratios(record: Dict[str, Any]) -> Dict[str, float]:
    return {w: run["mlautotune"]["wall_s"] / run["deepspeed"]["wall_s"] for w, run in record.items()}


def short(knob: str) -> str:
    """A knob's initials: reduce_bucket_size -> rbs, stage3_prefetch_bucket_size -> spbs."""
    return "".join(part[0] if not part[0].isdigit() else part for part in knob.replace("stage3", "s3").split("_"))


def knob_value(v: Any) -> str:
    """True -> 1, 50000000 -> 5e7."""
    if isinstance(v, bool) or v in ("True", "False"):
        return str(int(v in (True, "True")))
    return f"{float(v):.0e}".replace("e+0", "e").replace("e+", "e") if float(v) >= 1e4 else f"{float(v):g}"


def landscapes_table() -> str:
    """Each landscape's size and best point (recorded: the median of its draws; GPU-like: noise-free)."""
    from landscape import load as load_landscape, signed_metric

    out = ["| landscape | source | points (ok / OOM) | best point | its value |", "|---|---|---:|---|---:|"]
    for path in sorted((HERE / "landscapes").glob("*.json")):
        land = load_landscape(path)
        metric, sign = signed_metric(land)
        field = f"true_{metric}" if land.get("generator") == "gpu_model" else metric
        ok = [p for p in land["points"] if p["status"] == "ok"]
        best = max(ok, key=lambda p: sign * p["metrics"][field])
        knobs = " ".join(f"{short(k)}={knob_value(v)}" for k, v in best["params"].items() if k not in ("stage", "micro_batch", "gas"))
        out.append(f"| {path.stem} | {land.get('source')} | {len(ok)} / {len(land['points']) - len(ok)} | "
                   f"z{best['params']['stage']} mb{best['params']['micro_batch']}{' ' + knobs if knobs else ''} | {best['metrics'][field]:.1f} |")
    return "\n".join(out)


def resolution_table() -> str:
    import resolution
    from landscape import load as load_landscape

    rows = []
    for path in sorted((HERE / "landscapes").glob("cpu_*.json")):
        land = load_landscape(path)
        land.setdefault("name", path.stem)
        rows.append(resolution.resolve(land))
    text = resolution.table([r for r in rows if r])
    return re.sub(r"(\w+)=(\w+)", lambda m: f"{short(m.group(1))}={knob_value(m.group(2))}", text)


FIXED8 = "fixed8_w1.json"  # the search and the DeepSpeed baseline on the eight fixed landscapes, 10 seeds, 1 worker
RULES, RULES_SEEDS = "replay_w1_60seeds.json", range(10)  # the baseline: the step-rule search the search replaced, the same seeds


def records_of(data: Any) -> List[Dict[str, Any]]:
    """A replay record's rows: `replay.py --json` writes a list; a kept record wraps it with its commands."""
    return data["records"] if isinstance(data, dict) else data


def rules_baseline() -> List[Dict[str, Any]]:
    """The step-rule search's 1-worker runs on seeds 0-9 (its model_based rows in results/replay_w1_60seeds.json)."""
    return [r for r in load(RULES) if r["strategy"] == "model_based" and r.get("workers", 1) == 1 and r["seed"] in RULES_SEEDS]


def fixed8_table(search: List[Dict[str, Any]], rules: List[Dict[str, Any]]) -> str:
    """The fixed eight landscapes with the search (results/fixed8_w1.json) and with the baseline, the
    step-rule search it replaced (rules_baseline): per landscape, both rows, the seeds that reached 99%,
    and whether the search is no worse on regret (its median and its worst at most the rules')."""
    search = [r for r in search if r["strategy"] == "model_based"]
    out = ["| landscape | search | reached 99% | experiments to 99% | final regret (median / worst) | experiments (median) | no worse on regret |",
           "|---|---|---:|---:|---:|---:|---|"]
    worse = []
    for name in dict.fromkeys(r["landscape"] for r in search):
        by = {"search": [r for r in search if r["landscape"] == name], "rules": [r for r in rules if r["landscape"] == name]}
        (mv, wv), (mr, wr) = [(median([r["regret"] for r in by[s]]), max(r["regret"] for r in by[s])) for s in ("search", "rules")]
        verdict = "yes" if mv <= mr + 1e-9 and wv <= wr + 1e-9 else "no: " + ", ".join(
            f"{what} {a:.2%} vs {b:.2%}" for what, a, b in (("median", mv, mr), ("worst", wv, wr)) if a > b + 1e-9)
        if verdict != "yes":
            worse.append(name)
        for s, label in (("search", "the search"), ("rules", "baseline: step rules")):
            rs = by[s]
            out.append(f"| {name} | {label} | {sum(r['to99'] is not None for r in rs)}/{len(rs)} | {steps([r['to99'] for r in rs])} | "
                       f"{median([r['regret'] for r in rs]):.1%} / {max(r['regret'] for r in rs):.1%} | "
                       f"{median([r['experiments'] for r in rs]):g} | {verdict if s == 'search' else ''} |")
    n = len({r["landscape"] for r in search})
    total = {s: sum(r["experiments"] for r in rs) for s, rs in (("search", search), ("rules", rules))}
    reached = {s: sum(r["to99"] is not None for r in rs) for s, rs in (("search", search), ("rules", rules))}
    out += ["", f"- no worse on regret on {n - len(worse)} of {n} landscapes" + (f"; worse on {', '.join(worse)}" if worse else ""),
            f"- reached 99%: the search {reached['search']} of {len(search)} runs, step rules {reached['rules']} of {len(rules)}",
            f"- experiments in all: the search {total['search']}, step rules {total['rules']} ({total['search'] / total['rules']:.1f}x)"]
    return "\n".join(out)


GENERATED_W1, GENERATED_W4 = "generator_200_w1.json", "generator_200_w4.json"  # the search's records on generated landscapes


def generated_rows(link: str) -> List[tuple]:
    """The issue's targets on generated landscapes, from the records (1 worker: every strategy; 4 workers: model_based)."""
    import generator

    if not (RESULTS / GENERATED_W1).exists():
        return []
    results = load(GENERATED_W1)["results"]
    w4 = {r["seed"]: r for r in load(GENERATED_W4)["results"]} if (RESULTS / GENERATED_W4).exists() else {}
    records = [x for r in results for x in r["records"]] + [x for r in w4.values() for x in r["records"]]
    by: Dict[tuple, Dict[int, Dict[str, Any]]] = {}
    for x in records:
        by.setdefault((x["strategy"], x["workers"]), {})[x["seed"]] = x
    mb = list(by[("model_based", 1)].values())
    regrets = [x["regret"] for x in mb]
    n, where = len(mb), f"{link}#generated-landscapes"
    rows = [(f"Generated landscapes ({n}): share where model_based reaches 99% of the best", f"{sum(x['to99'] is not None for x in mb) / n:.0%}",
             ">= 95%", where),
            (f"Generated landscapes ({n}): final regret p95 / worst", f"{generator.quantile(regrets, 0.95):.1%} / {max(regrets):.1%}", "<= 2% / 5%", where),
            (f"Generated landscapes ({n}): experiments to 99%, model_based / DeepSpeed model (median of ratios)",
             generator.cell_ratio(generator.ds_ratio(mb, by.get(("deepspeed_baseline", 1), {}))), "<= 0.5", where)]
    if ("model_based", 4) in by:
        one = {s: x for s, x in by[("model_based", 1)].items() if s in by[("model_based", 4)]}
        w = generator.workers_ratio({("model_based", 1): one, ("model_based", 4): by[("model_based", 4)]}, "model_based")
        rows.append((f"Generated landscapes ({w[1]}): wall hours to 99%, 4 workers / 1 worker (median)", generator.cell_ratio(w[0]), "<= 0.35", where))
    return rows


def headline() -> str:
    """README.md's table: one line per benchmark, today's figure and its target."""
    t10 = target_figures(records_of(load(FIXED8)))
    noise = load("noise_fixed_vs_pinned.json")["summary"]["pinned"]
    versus = versus_ratios(load("versus_deepspeed.json"))
    link = "benchmarks/README.md"
    rows = generated_rows(link) + [("Search replay, fixed landscapes: model_based / DeepSpeed-baseline experiments to 99% of the best (10 seeds)",
             t10["ratio"], "<= 0.33", f"{link}#search-replay"),
            ("Search replay, fixed landscapes: worst final regret (10 seeds)", t10["worst_regret"], "<= 3%", f"{link}#search-replay"),
            ("Search replay, fixed landscapes: experiments run after reaching 99% (10 seeds)", t10["after99"], "<= 5", f"{link}#search-replay"),
            ("Tuning time against `deepspeed --autotuning tune` (bundled; edge)", "; ".join(f"{v:.2f}" for v in versus.values()), "<= 0.5",
             f"{link}#side-by-side-with-deepspeeds-autotuner"),
            ("Measurement noise: CV of one configuration over 5 repeats, quiet", pct(noise["quiet"]["cv"]), "<= 3%", f"{link}#measurement-noise"),
            ("Measurement noise: repeats beside a CPU hog flagged `disturbed`", f"{noise['busy']['disturbed']}/{noise['busy']['ok']}", "all",
             f"{link}#measurement-noise")]
    if (RESULTS / "overhead.json").exists():
        rows.append(("Runner overhead: one experiment's wall time through mlautotune / a bare `deepspeed` run",
                     f"{overhead_ratio(load('overhead.json')):.2f}", "-", f"{link}#runner-overhead"))
    out = ["| benchmark | today | target | page |", "|---|---:|---:|---|"]
    out += [f"| {name} | {value} | {target} | [details]({page}) |" for name, value, target, page in rows]
    return "\n".join(out)


def ratio_by_seed_groups(records: List[Dict[str, Any]], size: int = 5) -> str:
    """The target ratio over consecutive groups of `size` seeds: how much fewer seeds would move it."""
    seeds = sorted({r["seed"] for r in records})
    groups = [set(seeds[i:i + size]) for i in range(0, len(seeds), size)]
    ratios = [target_figures([r for r in records if r["seed"] in g])["ratio"] for g in groups]
    return f"- the same ratio over seeds {size} at a time ({', '.join(f'{min(g)}-{max(g)}' for g in groups)}): {', '.join(ratios)}"


def only_model_based(table: str) -> str:
    """A workers table with the other strategies' rows left out (their summary lines kept)."""
    keep = [x for x in table.splitlines() if not x.startswith(("| ", "####")) or " | model_based | " in x or x.startswith("| landscape")]
    return "\n".join(keep).strip()


def summary_lines(table: str) -> str:
    return "\n".join(x for x in table.splitlines() if x.startswith("- "))


def all_tables() -> str:
    sections = [("README.md, Benchmarks", headline())]
    if (RESULTS / "overhead.json").exists():
        sections.append(("benchmarks/README.md, Runner overhead (results/overhead.json)", overhead_table(load("overhead.json"))))
    fixed8 = records_of(load(FIXED8))
    sections += [
        ("benchmarks/README.md, Landscapes (landscapes/)", landscapes_table()),
        ("benchmarks/README.md, How finely the CPU truths tell the best (landscapes/cpu_*.json)", resolution_table()),
        ("benchmarks/README.md, Search replay, 10 seeds, 1 worker (results/fixed8_w1.json; baseline: results/replay_w1_60seeds.json)",
         fixed8_table(fixed8, rules_baseline()) + "\n" + targets(fixed8)),
        ("benchmarks/README.md, Measurement noise (results/noise_fixed_vs_pinned.json)", noise_table(load("noise_fixed_vs_pinned.json"))),
        ("benchmarks/README.md, Measurement noise, window budget (results/noise_budget_4.5s_vs_9s.json)", noise_table(load("noise_budget_4.5s_vs_9s.json"))),
        ("benchmarks/README.md, Measurement noise, script length (results/noise_window_length.json)", window_length_table(load("noise_window_length.json"))),
        ("benchmarks/README.md, Side by side with DeepSpeed (results/versus_deepspeed.json)", versus_table(load("versus_deepspeed.json"))),
    ]
    return "\n\n".join(f"<!-- {title} -->\n{body.strip()}" for title, body in sections)


def main(argv: List[str]) -> None:
    print(replay_tables(records_of(json.loads(Path(argv[0]).read_text()))) if argv else all_tables())


if __name__ == "__main__":
    main(sys.argv[1:])
