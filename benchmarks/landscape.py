"""Landscapes for the replay benchmark: files of measured (or modelled) points, and a runner that
"runs" an experiment by looking it up.

A landscape file is JSON: a header (name, description, source, world_size, memory_limit_bytes,
metric, the plan: stages, micro_batch rule, gas, knobs per stage, fast) and `points`, each
{"params": {...}, "status": ..., "metrics": {...}, "wall_time_s": ...}. Lookup is by exact params.
Points that are not in the file (a micro-batch between two recorded ones) are answered by the
landscape's own model when it has one (synthetic landscapes: synthetic.evaluate), else as an OOM.
"""

import json
from pathlib import Path
from typing import Any, Dict

from mlautotune.experiment import Experiment, Resources, Result
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
