"""Landscapes for the replay benchmark: files of measured (or modelled) points, and a runner that
"runs" an experiment by looking it up. Nothing here imports the product.

A landscape file is JSON: a header (name, description, source, world_size, memory_limit_bytes,
metric, the plan: stages, micro_batch rule, gas, knobs per stage, fast) and `points`, each
{"params": {...}, "status": ..., "metrics": {...}, "wall_time_s": ...}.

Two kinds:
- GPU-like (`"generator"`: the module that models it, benchmarks/gpu_model.py for the fixed
  landscapes, benchmarks/generator.py for the seeded family; each has `true_point(model, params)`
  and `noisy(metrics, rng)`): the header carries the model and its noise. Every measurement,
  re-measurements included, is a fresh noisy draw, seeded by the runner's seed, the
  configuration and how often it was measured before (common random numbers: the k-th
  measurement of a configuration draws the same noise whatever was measured before it); the
  noise-free values are `true_<metric>`. Points outside the stored grid (another micro-batch or
  gas; every point, for the generator's landscapes, which store none) come from the model.
- recorded on CPU (benchmarks/record.py): no noise model. A point recorded once returns its
  value again at every re-measurement, and that value counts as the "true" one. A point recorded
  several times (`record.py --repeats N`) keeps every measurement in `draws`; its `metrics` are
  their medians, the "true" values. Each measurement of it is then one of its recorded draws,
  chosen the same way: the machine's own noise, window intervals, disturbed flags and an OOM near
  the memory edge included.
  A micro-batch between recorded ones is interpolated (`interpolation`): step time, peak memory
  and wall time linear in the micro-batch between the two recorded neighbours with the same
  stage and knobs (extrapolated from the last two beyond the largest that ran), OOM at or above a
  recorded OOM or where the peak passes the limit. A gas other than the recorded one keeps the
  samples/s of the recorded gas (the step takes gas times as long). Its noise is a draw of the
  nearest recorded micro-batch's, as a ratio to that point's median.
"""

import importlib
import json
import math
import random
import statistics
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

Answer = Tuple[str, Dict[str, Any], float]  # status, metrics, wall time in s


def key(params: Dict[str, Any]) -> str:
    return json.dumps({k: params[k] for k in sorted(params)}, sort_keys=True)


def load(path: Path) -> Dict[str, Any]:
    landscape = json.loads(Path(path).read_text())
    for point in landscape.get("points", []):
        settle(point)
    return landscape


SETTLED = ("throughput", "latency", "step_time_median_ms", "FLOPS_per_gpu", "peak_memory_bytes")  # medians over the draws
WINDOW = ("interval_rel", "step_time_spread", "step_time_shift", "disturbed", "target_reached", "measured_steps", "warmup_steps",
          "measure_seconds")  # what a draw says about its own measurement


def ok_draws(point: Dict[str, Any]) -> List[Dict[str, Any]]:
    return [d for d in point.get("draws", []) if d["status"] == "ok"]


def settle(point: Dict[str, Any]) -> None:
    """A point recorded several times: its metrics and wall time become the medians over its ok draws
    (the values the replay scores against, as it does a point recorded once)."""
    draws = ok_draws(point)
    if point["status"] != "ok" or len(draws) < 2:
        return
    metrics = dict(draws[0]["metrics"])
    for k in SETTLED:
        if all(k in d["metrics"] for d in draws):
            metrics[k] = statistics.median(d["metrics"][k] for d in draws)
    point["metrics"] = metrics
    point["wall_time_s"] = statistics.median(d["wall_time_s"] for d in draws)


def save(path: Path, landscape: Dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(landscape, separators=(",", ":")))


def knobs_of(params: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in params.items() if k != "micro_batch"}


def signed_metric(landscape: Dict[str, Any]) -> Tuple[str, float]:
    """The landscape's metric, and the sign that makes higher better (latency: -1)."""
    metric = landscape.get("metric", "throughput")
    return metric, -1.0 if metric == "latency" else 1.0


MODELS = ("gpu_model", "generator")  # the modules in benchmarks/ that model a landscape


def noisy(landscape: Dict[str, Any]) -> bool:
    return landscape.get("generator") in MODELS


def model_of(landscape: Dict[str, Any]) -> Any:
    return importlib.import_module(landscape["generator"])


def truth(landscape: Dict[str, Any]) -> Callable[[Dict[str, Any]], Answer]:
    """params -> (status, noise-free metrics, wall time): the landscape's model, else its points."""
    if noisy(landscape):
        model = model_of(landscape)
        return lambda params: model.true_point(landscape["model"], params)
    points = {key(p["params"]): p for p in landscape["points"]}
    between = interpolation(landscape)

    def answer(params: Dict[str, Any]) -> Answer:
        p = points.get(key(params))
        return (p["status"], dict(p["metrics"]), p["wall_time_s"]) if p else between(params)

    return answer


class LandscapeRunner:
    """Runs experiments on a landscape: `measure(params)` returns (status, metrics, wall time) and
    logs the call (its true value and the value the search saw); `true_value(params)` is the
    noise-free metric (None unless ok)."""

    def __init__(self, landscape: Dict[str, Any], seed: int = 0):
        self.landscape = landscape
        self.truth = truth(landscape)
        self.seed = seed
        self.times: Dict[str, int] = {}  # how often each configuration was measured
        self.log: List[Dict[str, Any]] = []  # one entry per measurement, in order
        self.wall_time_s = 0.0
        self.clock: Optional[float] = None  # simulated time the current measurement ends (parallel.py), if simulated
        self.why: Optional[str] = None  # why the search chose the current measurement (parallel.py), if known

    def noise(self, params: Dict[str, Any]) -> random.Random:
        """The noise of this measurement: the k-th measurement of a configuration draws the same noise
        in every replay with this seed, whatever was measured before it (common random numbers), so two
        searches compared on one seed differ by what they chose, not by draws reshuffled."""
        k = self.times[key(params)] = self.times.get(key(params), 0) + 1
        return random.Random(f"noise-{self.seed}-{key(params)}-{k}")

    def measure(self, params: Dict[str, Any]) -> Answer:
        status, metrics, wall = self.truth(params)
        rng = self.noise(params)
        if noisy(self.landscape) and status == "ok":
            metrics = model_of(self.landscape).noisy(metrics, rng)
        elif status == "ok":
            status, metrics = self.recorded_draw(params, metrics, rng)
        self.wall_time_s += wall
        self.log.append({"params": dict(params), "status": status, "value": self.true_value(params) if status == "ok" else None,
                         "observed": metrics.get("throughput") if status == "ok" else None, "wall_time_s": wall,
                         **({} if self.clock is None else {"end_s": self.clock}), **({} if self.why is None else {"why": self.why})})
        return status, metrics, wall

    def recorded_draw(self, params: Dict[str, Any], metrics: Dict[str, Any], rng: random.Random) -> Tuple[str, Dict[str, Any]]:
        """One of the recorded draws of the point, an OOM near the memory edge included; between recorded
        sizes, an ok draw of the nearest recorded micro-batch with these knobs (and gas), as a ratio to
        that point's median."""
        same = [p for p in self.landscape["points"] if knobs_of(p["params"]) == knobs_of(params) and p["status"] == "ok"]
        near = min(same, default=None, key=lambda p: (abs(math.log(p["params"]["micro_batch"] / params["micro_batch"])), p["params"]["micro_batch"]))
        if near is None or len(ok_draws(near)) < 2:
            return "ok", metrics  # recorded once: its value every time
        draw = rng.choice(near["draws"] if near["params"] == params else ok_draws(near))
        if draw["status"] != "ok":
            return draw["status"], draw["metrics"]
        draw = draw["metrics"]
        ratio = draw["throughput"] / near["metrics"]["throughput"]
        scaled = {k: metrics[k] * ratio for k in ("throughput", "FLOPS_per_gpu") if k in metrics}
        scaled.update({k: metrics[k] / ratio for k in ("latency", "step_time_median_ms") if k in metrics})
        window = {k: draw[k] for k in WINDOW if k in draw}
        return "ok", {**metrics, **window, **scaled}

    @property
    def calls(self) -> int:
        return len(self.log)

    def true_value(self, params: Optional[Dict[str, Any]], metric: str = "throughput") -> Optional[float]:
        if not params:
            return None
        status, metrics, _ = self.truth(params)
        return metrics.get(f"true_{metric}", metrics.get(metric)) if status == "ok" else None


def interpolation(landscape: Dict[str, Any]) -> Callable[[Dict[str, Any]], Answer]:
    """params -> (status, metrics, wall_time_s) for a micro-batch between recorded ones (see the module doc)."""
    limit = landscape["memory_limit_bytes"]
    world = landscape["world_size"]
    groups: Dict[str, List[Dict[str, Any]]] = {}
    for p in landscape["points"]:
        groups.setdefault(key(knobs_of(p["params"])), []).append(p)

    def answer(params: Dict[str, Any]) -> Answer:
        mbs = params["micro_batch"]
        group = groups.get(key(knobs_of(params)))
        if group is None:  # another gas: the recorded gas's samples/s, a step gas times as long
            other = [g for g in groups.values() if key(knobs_of({**g[0]["params"], "gas": params["gas"]})) == key(knobs_of(params))]
            if other:
                recorded_gas = other[0][0]["params"]["gas"]
                status, metrics, wall = answer({**params, "gas": recorded_gas})
                if status == "ok":
                    f = params["gas"] / recorded_gas
                    metrics = {**metrics, "latency": metrics["latency"] * f, "step_time_median_ms": metrics["latency"] * f,
                               "train_batch_size": mbs * params["gas"] * world, "gas": params["gas"]}
                return status, metrics, wall
            group = []
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
