"""Landscapes for the replay benchmark: files of measured (or modelled) points, and a runner that
"runs" an experiment by looking it up.

A landscape file is JSON: a header (name, description, source, world_size, memory_limit_bytes,
metric, the plan: stages, micro_batch rule, gas, knobs per stage, fast) and `points`, each
{"params": {...}, "status": ..., "metrics": {...}, "wall_time_s": ...}. Lookup is by exact params.
Points that are not in the file (a micro-batch between two recorded ones) are answered by the
landscape's own model when it has one (synthetic landscapes: synthetic.evaluate). Recorded
landscapes use `interpolation`: step time, peak memory and wall time linear in the micro-batch
between the two recorded neighbours with the same stage and knobs (extrapolated from the last two
beyond the largest that ran), OOM at or above a recorded OOM or where the peak passes the limit.
"""

import json
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

from mlautotune.experiment import Experiment, Resources, Result
from mlautotune.samplers.cost_model import knobs_of
from mlautotune.space import MicroBatchRule, TuningPlan


def key(params: Dict[str, Any]) -> str:
    return json.dumps({k: params[k] for k in sorted(params)}, sort_keys=True)


def load(path: Path) -> Dict[str, Any]:
    return json.loads(Path(path).read_text())


def save(path: Path, landscape: Dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(landscape, separators=(",", ":")))


def plan_of(landscape: Dict[str, Any]) -> TuningPlan:
    p = landscape["plan"]
    return TuningPlan(
        stages=list(p["stages"]),
        knobs={int(s): v for s, v in p["knobs"].items()},
        micro_batch=MicroBatchRule(p["micro_batch"]["mode"], tuple(p["micro_batch"]["values"])),
        gas=p["gas"],
        max_train_batch_size=p.get("max_train_batch_size"),
        mp_size=1,
        fast=p["fast"],
        base_config=p.get("base_config", {}),
    )


def make_experiment(params: Dict[str, Any]) -> Experiment:
    name = f"z{params['stage']}_gas{params['gas']}_tmbspg{params['micro_batch']}"
    return Experiment(name, {}, "replay", [], Resources(), dict(params))


class LandscapeRunner:
    def __init__(self, landscape: Dict[str, Any], model=None):
        self.points = {key(p["params"]): p for p in landscape["points"]}
        self.model = model  # params -> (status, metrics, wall_time_s), for points between recorded ones
        self.calls = 0
        self.wall_time_s = 0.0
        self.startup_s = landscape.get("startup_s", 60.0)

    def __call__(self, exp: Experiment) -> Result:
        self.calls += 1
        point = self.points.get(key(exp.params))
        if point is None and self.model is not None:
            status, metrics, wall = self.model(exp.params)
            point = self.points[key(exp.params)] = {"params": dict(exp.params), "status": status, "metrics": metrics, "wall_time_s": wall}
        if point is None:
            self.wall_time_s += self.startup_s
            return Result(exp.name, "oom", {}, "beyond the recorded grid", self.startup_s)
        self.wall_time_s += point["wall_time_s"]
        return Result(exp.name, point["status"], dict(point["metrics"]), point.get("reason", ""), point["wall_time_s"])

    def value(self, params: Dict[str, Any], metric_key: str = "throughput"):
        point = self.points.get(key(params))
        return point["metrics"].get(metric_key) if point and point["status"] == "ok" else None


def interpolation(landscape: Dict[str, Any]) -> Callable[[Dict[str, Any]], Tuple[str, Dict[str, Any], float]]:
    """params -> (status, metrics, wall_time_s) for a micro-batch between recorded ones (see the module doc)."""
    limit = landscape["memory_limit_bytes"]
    world = landscape["world_size"]
    groups: Dict[str, List[Dict[str, Any]]] = {}
    for p in landscape["points"]:
        groups.setdefault(key(knobs_of(p["params"])), []).append(p)

    def answer(params: Dict[str, Any]):
        mbs = params["micro_batch"]
        group = groups.get(key(knobs_of(params)), [])
        ok = sorted((p for p in group if p["status"] == "ok"), key=lambda p: p["params"]["micro_batch"])
        ooms = [p["params"]["micro_batch"] for p in group if p["status"] == "oom"]
        startup = min((p["wall_time_s"] for p in group), default=landscape.get("startup_s", 60.0))
        if not ok or (ooms and mbs >= min(ooms)):
            return "oom", {}, startup
        below = [p for p in ok if p["params"]["micro_batch"] < mbs]
        above = [p for p in ok if p["params"]["micro_batch"] > mbs]
        if below and above:
            a, b = below[-1], above[0]
        elif len(ok) >= 2:
            a, b = (ok[0], ok[1]) if above else (ok[-2], ok[-1])  # extrapolate from the nearest two
        else:
            a = b = ok[0]
        ma, mb = a["params"]["micro_batch"], b["params"]["micro_batch"]
        t = (mbs - ma) / (mb - ma) if mb != ma else 0.0

        def line(x, y):
            return x + t * (y - x)

        peak = line(a["metrics"]["peak_memory_bytes"], b["metrics"]["peak_memory_bytes"])
        if peak > limit:
            return "oom", {"peak_memory_bytes": peak}, startup
        step_s = max(1e-6, line(a["metrics"]["latency"], b["metrics"]["latency"]) / 1000.0)
        tbs = mbs * params["gas"] * world
        flops_per_sample = a["metrics"].get("FLOPS_per_gpu", 0.0) * a["metrics"]["latency"] / 1000.0 / (ma * params["gas"])
        metrics = {
            **a["metrics"], "throughput": tbs / step_s, "latency": step_s * 1000.0, "step_time_median_ms": step_s * 1000.0,
            "FLOPS_per_gpu": flops_per_sample * mbs * params["gas"] / step_s, "peak_memory_bytes": peak, "train_batch_size": tbs,
            "step_time_spread": max(a["metrics"].get("step_time_spread", 0.0), b["metrics"].get("step_time_spread", 0.0)),
        }
        return "ok", metrics, line(a["wall_time_s"], b["wall_time_s"])

    return answer
