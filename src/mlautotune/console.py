"""Console progress: a line when an experiment starts and when it ends, with the best so far."""

import sys
from typing import Any, Optional

UNITS = {"throughput": "samples/s", "latency": "ms", "FLOPS": "FLOPS"}


class Console:
    def __init__(self, metric: str, budget: int, stream=sys.stdout):
        self.metric, self.budget, self.stream = metric, budget, stream
        self.count = 0

    def say(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def note(self, text: str) -> None:
        self.say(f"  note: {text}")

    def stage_started(self, stage: int, space: dict) -> None:
        sizes = ", ".join(f"{k}={len(v)}" for k, v in space.items() if len(v) > 1) or "one configuration"
        self.say(f"-- ZeRO stage {stage}: micro-batch candidates {space['micro_batch']}; space {sizes}")

    def profiled(self, memory: Any, points: list) -> None:
        self.say(f"  model info: {memory.num_params:,} parameters; memory model: {memory.describe()}")

    def _counter(self, exp: Any) -> str:
        """Launches against the budget (re-measurements count: they are launches too)."""
        return f"[{self.count:>3}/{self.budget}]" + (" re-run" if "_rep" in exp.name else "")

    def experiment_started(self, exp: Any, trial: Any) -> None:
        self.count += 1
        self.say(f"{self._counter(exp)} {exp.name} running ...")

    def experiment_finished(self, exp: Any, measured: Any, best: Optional[Any]) -> None:
        r = measured.result
        value = f"{measured.value:,.4g} {UNITS[self.metric]}" if measured.value is not None else _short(r.reason)
        if measured.value is not None and r.metrics.get("disturbed"):
            value += f" DISTURBED ({disturbed_cause(r.metrics)})"
        best_text = f"{best.result.name} {best.final_value:,.4g}" if best is not None else "none yet"
        if best is not None and len(best.values) > 1:
            best_text += f" (median of {len(best.values)} measurements)"
        self.say(f"{self._counter(exp)} {exp.name} {r.status:<10} {value}  ({r.wall_time_s:.1f} s)  best: {best_text}")


def disturbed_cause(metrics: dict) -> str:
    """Why the probe called a window disturbed, in a few words."""
    wait, shift = float(metrics.get("cpu_wait_share") or 0.0), float(metrics.get("step_time_shift") or 0.0)
    if wait >= shift:
        return f"the training threads waited for a CPU {wait:.0%} of the window: other processes use the cores"
    return f"the step time shifted {shift:.0%} within the window"


def _short(reason: str) -> str:
    lines = [l.strip() for l in (reason or "").splitlines() if l.strip()]
    return (lines[-1][:90] if lines else "")
