"""Session outputs: summary.txt, ds_config_optimal.json, cmd_optimal.txt, trials.csv, plots, session.json.

The files are DeepSpeed's (same names, same summary table) plus a provenance block. Every file is
written atomically. An interrupted session writes them for the best so far, marked partial; a
session with no successful experiment writes no optimal config at all.
"""

import datetime
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Optional

from mlautotune.files import atomic_write_json, atomic_write_text
from mlautotune.search import METRIC_KEYS, Measured, Outcome, experiments_in
from mlautotune.track.estimate import Estimate

PROVENANCE_KEY = "mlautotune"
STATUSES = ("ok", "oom", "timeout", "failed", "incomplete")


def summary_table(outcome: Outcome, stages: List[int]) -> str:
    rows = []
    for s in stages:
        ms = [m for m in outcome.measured if m.params.get("stage") == s]
        if not ms:
            continue
        best = outcome.stage_best.get(s)
        rows.append((f"z{s}", len(ms), _fmt(best), best.result.name if best else "-"))
    best = outcome.best
    rows.append(("global", len(outcome.measured), _fmt(best), best.result.name if best else "-"))
    head = ("tuning_space", "num_experiments", "best_metric_val", "best_exp_name")
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(4)]
    line = lambda r: "| " + " | ".join(str(v).ljust(w) if i in (0, 3) else str(v).rjust(w) for i, (v, w) in enumerate(zip(r, widths))) + " |"
    sep = "| " + " | ".join(":" + "-" * (w - 1) if i in (0, 3) else "-" * (w - 1) + ":" for i, w in enumerate(widths)) + " |"
    return "\n".join([line(head), sep, *(line(r) for r in rows)])


def _fmt(m: Optional[Measured]) -> str:
    return f"{m.final_value:.6g}" if m is not None and m.final_value is not None else "0"


def session_metrics(outcome: Outcome, metric: str, wall_time_s: float, launches: Optional[List[Dict[str, Any]]] = None) -> Dict[str, float]:
    """The parent run's metrics: per-stage bests, the global best, experiments by status, disturbed
    measurements, wall time."""
    out: Dict[str, float] = {}
    for s, m in outcome.stage_best.items():
        out[f"z{s}_best_{metric}"] = m.final_value
    if outcome.best is not None:
        out[f"best_{metric}"] = outcome.best.final_value
        out["best_interval_rel"] = outcome.best.interval
    counts = Counter(m.result.status for m in outcome.measured)
    for status in STATUSES:
        out[f"num_{status}"] = counts.get(status, 0)
    first = next((m for m in outcome.measured if m.value is not None), None)
    if outcome.best is not None and first is not None and first.value:
        ratio = outcome.best.final_value / first.value
        out["speedup_over_first"] = 1 / ratio if metric == "latency" else ratio
    out.update({k: float(v) for k, v in best_params(outcome).items() if isinstance(v, (int, float))})
    out["num_experiments"] = len(outcome.measured)
    out["num_launched_this_run"] = outcome.experiments
    d = disturbance(launches if launches is not None else launch_results(outcome))
    out["num_disturbed"], out["disturbed_share"] = d["disturbed"], d["share"]
    out["tuning_wall_time_s"] = wall_time_s
    return out


MOSTLY_DISTURBED = 0.5  # above this share of disturbed measurements, the session ends with a warning about its ranking


def launch_results(outcome: Outcome, study: Any = None) -> List[Dict[str, Any]]:
    """Every launch's result, re-measurements included: from the study when there is one (a
    configuration's re-measurements keep only their values in the outcome)."""
    if study is None:
        return [m.result.to_dict() for m in outcome.measured]
    return [t.user_attrs["result"] for t in study.get_trials(deepcopy=False) if "result" in t.user_attrs and "duplicate_of" not in t.user_attrs]


def disturbance(launches: List[Dict[str, Any]]) -> Dict[str, Any]:
    """How many successful measurements the probe found disturbed, their share, and the cause: the
    ranks' training threads waiting for a CPU (other processes on the cores), or a shift of the step
    time within the window (load that came and went)."""
    ok = [r.get("metrics") or {} for r in launches if r.get("status") == "ok"]
    hit = [m for m in ok if m.get("disturbed")]
    waits = sorted(float(m.get("cpu_wait_share") or 0.0) for m in hit)
    shifts = sorted(float(m.get("step_time_shift") or 0.0) for m in hit)
    cause = ""
    if hit:
        wait, shift = waits[len(waits) // 2], shifts[len(shifts) // 2]
        cause = (f"the ranks' training threads waited for a CPU {wait:.0%} of the window (median): other processes were using the cores"
                 if wait >= shift else f"the step time shifted by {shift:.0%} within the window (median): other load came and went")
    return {"disturbed": len(hit), "measured": len(ok), "share": len(hit) / len(ok) if ok else 0.0, "cause": cause}


def disturbance_text(d: Dict[str, Any]) -> str:
    """The summary's warning about disturbed measurements ('' when there were none)."""
    if not d["disturbed"]:
        return ""
    text = f"Warning: {d['disturbed']} of {d['measured']} measurements ({d['share']:.0%}) were disturbed: {d['cause']}."
    if d["share"] > MOSTLY_DISTURBED:
        text += (" Most of this session's figures are slower and less certain than the configurations are, and the ranking may be wrong."
                 " Tune on a machine that runs nothing else (stop other jobs), or with fewer ranks than free cores, and run the session again.")
    else:
        text += " The search measured the disturbed ones again where they mattered; their intervals include what the disturbance may have cost."
    return text


def budget_text(outcome: Outcome) -> str:
    """The label of a session the budget stopped while its search still had something worth measuring."""
    if not outcome.budget_stopped:
        return ""
    name, why = (outcome.left + ["", ""])[:2]
    return (f"STOPPED BY THE BUDGET: the search was not finished. Next it would have measured {name} ({why}). This optimum is the best of what "
            "the budget allowed. To go on, raise tuner_num_trials (autotuning.tuner_num_trials=N, or in the ds_config's autotuning section) "
            "and run the same command again: the experiments already measured are reused.")


def best_params(outcome: Outcome) -> Dict[str, Any]:
    """The winner's configuration under `best.` names: stage, micro_batch, gas and its knobs."""
    return {f"best.{k}": v for k, v in (outcome.best.params.items() if outcome.best else ())}


TRIALS_COLUMNS = ("experiment", "trial", "status", "stage", "micro_batch", "gas", "knobs", "throughput", "latency", "FLOPS_per_gpu",
                  "measurements", "values", "disturbed", "peak_memory_bytes", "interval_rel", "wall_time_s", "reason")


def trials_rows(outcome: Outcome, metric: str = "throughput") -> List[Dict[str, Any]]:
    """One readable row per configuration. The tuned metric's column is the configuration's value, the
    median of its measurements (what the summary and the search use); `values` lists them, the first
    one first; the other metrics are those of its first measurement."""
    rows = []
    for m in outcome.measured:
        r = m.result
        knobs = {k: v for k, v in m.params.items() if k not in ("stage", "micro_batch", "gas")}
        figures = {k: r.metrics.get(k) for k in ("throughput", "latency", "FLOPS_per_gpu", "peak_memory_bytes")}
        if m.final_value is not None:
            figures[METRIC_KEYS[metric]] = m.final_value
        rows.append({
            "experiment": r.name, "trial": m.trial_number, "status": r.status, "stage": m.params.get("stage"),
            "micro_batch": m.params.get("micro_batch"), "gas": m.params.get("gas"),
            "knobs": " ".join(f"{k}={v}" for k, v in sorted(knobs.items())), **figures,
            "measurements": (1 + len(m.repeats)) if m.value is not None else 0,
            "values": " ".join(f"{v:.6g}" for v in ([m.value, *m.repeats] if m.value is not None else [])),
            "disturbed": bool(r.metrics.get("disturbed")), "interval_rel": m.interval if m.value is not None else r.metrics.get("interval_rel"),
            "wall_time_s": round(r.wall_time_s, 1), "reason": _last_line(r.reason),
        })
    return rows


def write_trials_csv(path: Path, outcome: Outcome, metric: str = "throughput") -> None:
    import csv
    import io

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=TRIALS_COLUMNS)
    writer.writeheader()
    writer.writerows(trials_rows(outcome, metric))
    atomic_write_text(path, buf.getvalue())


MAX_TIES_SHOWN = 5
REPORT_FILES = ("summary.txt", "ds_config_optimal.json", "cmd_optimal.txt", "trials.csv", "session.json")


def report_artifacts(results_dir: Path) -> List[Path]:
    """The session outputs that exist, for the parent run's artifacts."""
    return [results_dir / n for n in REPORT_FILES if (results_dir / n).exists()] + [results_dir / "plots"]


def write_reports(
    results_dir: Path,
    outcome: Outcome,
    *,
    stages: List[int],
    metric: str,
    status: str,  # complete | partial | failed
    wall_time_s: float,
    session: str,
    optimal_ds_config: Optional[Dict[str, Any]],
    optimal_cmd: Optional[str],
    study: Any = None,
    estimate: Optional[Estimate] = None,
) -> Dict[str, Any]:
    """Write every output file; return the session record (also saved as session.json). `estimate`:
    the full run's (track/estimate.py), a block of summary.txt and the parent's estimate.* metrics."""
    results_dir.mkdir(parents=True, exist_ok=True)
    best = outcome.best
    header = {
        "complete": "",
        "partial": "PARTIAL RESULT: the session was interrupted; this is the best so far, not the optimum.\n\n",
        "failed": "NO RESULT: no experiment succeeded, so there is no optimal configuration.\n\n",
    }[status]
    launches = launch_results(outcome, study)
    disturbed = disturbance(launches)
    stopped = budget_text(outcome) if status == "complete" else ""
    if disturbed["share"] > MOSTLY_DISTURBED:
        header += "MOSTLY DISTURBED: " + disturbance_text(disturbed).removeprefix("Warning: ") + "\n\n"
    if stopped:
        header += stopped + "\n\n"
    lines = [header + summary_table(outcome, stages), ""]
    total = experiments_in(outcome.measured)
    repeats = total - len(outcome.measured)
    of = f", {len(outcome.measured)} configurations and {repeats} re-measurement{'s' * (repeats != 1)}" if repeats else ""
    ended = "stopped by the budget after" if stopped else "completed in"
    lines.append(f"Tuning {ended} {datetime.timedelta(seconds=round(wall_time_s, 3))}. Total number of experiments: {total}{of}.")
    warm = (getattr(study, "user_attrs", None) or {}).get("warm_start")
    if warm:
        lines.append(f"Warm start: from the earlier session{'s' * (len(warm['sessions']) != 1)} {', '.join(warm['sessions'])} of the same model"
                     f" ({warm.get('relation') or ('same' if warm.get('same_hardware') else 'other') + ' hardware'}"
                     f"{'; found in the MLflow store' if warm.get('store') else ''}).")
    if best is not None:
        runs = 1 + len(best.repeats)
        lines.append(f"Optimum: {best.result.name}  {metric}={best.final_value:.6g} (+-{best.interval:.1%}, 95% interval, over {runs} measurement{'s' if runs > 1 else ''})")
        if outcome.ties:  # the measurements cannot rank these against the optimum: the user may prefer one (less memory, a smaller stage)
            lines.append("Within the measurement interval of it, so as good as far as these measurements tell: "
                         + ", ".join(f"{m.result.name} {m.final_value:.6g} (+-{m.interval:.1%})" for m in outcome.ties[:MAX_TIES_SHOWN])
                         + (f" and {len(outcome.ties) - MAX_TIES_SHOWN} more (trials.csv)" if len(outcome.ties) > MAX_TIES_SHOWN else ""))
    if best is not None and estimate is not None:
        lines += estimate.lines
    lines += [f"Note: {n}" for n in outcome.notes]
    if disturbed["disturbed"]:
        lines.append(disturbance_text(disturbed))
    failures = [m for m in outcome.measured if m.result.status != "ok"]
    if failures:
        lines.append("")
        lines.append("Failed experiments:")
        lines += [f"  {m.result.name}: {m.result.status}: {_last_line(m.result.reason)}" for m in failures]
    atomic_write_text(results_dir / "summary.txt", "\n".join(lines) + "\n")

    if best is not None and optimal_ds_config is not None and status != "failed":
        provenance = {"status": status, "search": search_label(outcome), "session": session, "experiment": best.result.name, "metric": metric,
                      "value": best.final_value, "interval_rel": best.interval, "measurements": len(best.values)}
        atomic_write_json(results_dir / "ds_config_optimal.json", {**optimal_ds_config, PROVENANCE_KEY: provenance})
        atomic_write_text(results_dir / "cmd_optimal.txt", (optimal_cmd or "") + "\n")
    else:
        for name in ("ds_config_optimal.json", "cmd_optimal.txt"):
            (results_dir / name).unlink(missing_ok=True)

    write_trials_csv(results_dir / "trials.csv", outcome, metric)
    plot_session(results_dir / "plots", outcome, metric)

    record = {
        "status": status,
        "session": session,
        "metrics": {**session_metrics(outcome, metric, wall_time_s, launches), **(estimate.metrics if estimate else {})},
        "tags": {"status": status, "best_experiment": best.result.name if best else "", "metric": metric, "search": search_label(outcome),
                 **({"disturbed": f"{disturbed['disturbed']} of {disturbed['measured']} measurements" + (f": {disturbed['cause']}" if disturbed["cause"] else "")}
                    if disturbed["measured"] else {}),
                 **({"search_left": " ".join(outcome.left)} if outcome.budget_stopped else {}),
                 **({"estimate": estimate.tag} if estimate and best is not None else {})},
        "params": best_params(outcome),
        "ties": [m.result.name for m in outcome.ties],
    }
    atomic_write_json(results_dir / "session.json", record)
    return record


def search_label(outcome: Outcome) -> str:
    return "stopped_by_budget" if outcome.budget_stopped else "finished"


def _last_line(text: str) -> str:
    lines = [l for l in (text or "").strip().splitlines() if l.strip()]
    return lines[-1][:200] if lines else ""


def plot_session(plots_dir: Path, outcome: Outcome, metric: str) -> List[Path]:
    """Three PNGs: metric vs micro-batch per stage (OOM edges marked), history, best-so-far."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots_dir.mkdir(parents=True, exist_ok=True)
    ylabel = {"throughput": "throughput (samples/s)", "latency": "latency (ms / step)", "FLOPS": "FLOPS per GPU"}[metric]
    colors = plt.get_cmap("tab10")
    stages = sorted({m.params.get("stage") for m in outcome.measured})
    paths = []

    fig, ax = plt.subplots(figsize=(8, 5))
    for s in stages:
        ms = [m for m in outcome.measured if m.params.get("stage") == s]
        ok = sorted((m.params["micro_batch"], m.final_value) for m in ms if m.value is not None)
        if ok:
            best_per_mbs: Dict[int, float] = {}
            for x, y in ok:
                best_per_mbs[x] = max(best_per_mbs.get(x, y), y) if metric != "latency" else min(best_per_mbs.get(x, y), y)
            xs = sorted(best_per_mbs)
            ax.plot(xs, [best_per_mbs[x] for x in xs], "-o", color=colors(s), label=f"ZeRO {s}")
        ooms = sorted(m.params["micro_batch"] for m in ms if m.result.status == "oom")
        if ooms:
            ax.axvline(ooms[0], color=colors(s), linestyle="--", alpha=0.7)
            ax.plot(ooms, [0] * len(ooms), "x", color=colors(s), markersize=10, label=f"ZeRO {s} OOM (edge at {ooms[0]})")
    if outcome.best is not None:
        b = outcome.best
        ax.plot([b.params["micro_batch"]], [b.final_value], "*", color="gold", markersize=18, markeredgecolor="black", label=f"optimum {b.result.name}")
    ax.set(xlabel="micro-batch size per GPU", ylabel=ylabel, title=f"{metric} vs micro-batch size, per ZeRO stage")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # nothing ran: no legend (matplotlib would warn the user about it)
        ax.legend(fontsize=8)
    paths.append(_save(fig, plots_dir / f"{metric}_vs_micro_batch.png"))

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, m in enumerate(outcome.measured, 1):
        s = m.params.get("stage", 0)
        if m.value is not None:
            ax.plot(i, m.final_value, "o", color=colors(s))
        else:
            ax.plot(i, 0, "x", color="red")
    best_so_far = _best_so_far(outcome, metric)
    ax.step(range(1, len(best_so_far) + 1), best_so_far, where="post", color="black", alpha=0.6, label="best so far")
    for s in stages:
        ax.plot([], [], "o", color=colors(s), label=f"ZeRO {s}")
    ax.plot([], [], "x", color="red", label="failed / OOM")
    ax.set(xlabel="configuration, in the order measured", ylabel=f"{ylabel}, median of its measurements", title="Optimisation history")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(_save(fig, plots_dir / "history.png"))

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.step(range(1, len(best_so_far) + 1), best_so_far, where="post", color="tab:green")
    ax.set(xlabel="experiments run", ylabel=f"best {metric} so far", title="Best so far against experiments")
    ax.grid(alpha=0.3)
    paths.append(_save(fig, plots_dir / "best_so_far.png"))
    return paths


def _best_so_far(outcome: Outcome, metric: str) -> List[float]:
    """The best configuration's value (the median of its measurements) after each configuration: it ends
    at the optimum of the summary."""
    best, out = None, []
    for m in outcome.measured:
        v = m.final_value
        if v is not None and (best is None or (v > best if metric != "latency" else v < best)):
            best = v
        out.append(best if best is not None else float("nan"))
    return out


def _save(fig, path: Path) -> Path:
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.tight_layout()
    fig.savefig(tmp, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    tmp.replace(path)
    return path


def metric_key(metric: str) -> str:
    return METRIC_KEYS[metric]
