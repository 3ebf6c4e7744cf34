"""Warm start: what earlier sessions of the same model measured, as the search's prior.

`Earlier` is what search/earlier.py finds (in the study storage or the MLflow store): the earlier
sessions' experiments, and whether they ran on the same hardware (accelerator, device memory, world
size and memory limit per rank) as this session.

How the search uses it (search.py):
- Same hardware: the earlier runs' memory facts (peaks, OOMs, model info) are this session's too, so
  no profiling is needed; the first experiment re-measures the earlier optimum.
- The same accelerator and world size with another memory per device (or memory limit): a run's
  peak is the same bytes whatever the device holds, so the earlier runs whose measured peak fits
  under today's limit stand in for profiling: they fit here too, and they give the memory model its
  points. Their OOMs, and runs that would not fit, are left out (they say nothing of today's limit).
- The same accelerator with another world size: a run's peak is its fixed part and activations,
  which the world size does not change, plus ZeRO's model states, which it does (memory.py's
  formula). So each earlier run's peak is moved by the states' difference, and those that then fit
  under today's limit stand in for profiling as above. A moved peak is the formula's, not a
  measurement: the runs and OOMs of this session correct it like any other prior (fits.py).
- Another accelerator: profiling runs as in a cold session; the earlier memory facts are not used.
- Either way the earlier throughputs enter the throughput model as observations of the earlier
  landscape: today's, offset by one factor (learnt from the configurations measured in both
  sessions, `Warm.offset`; with another world size, those of the same stage, micro-batch and knobs,
  since gas follows the world size under a fixed global batch, and the throughput metric first
  scaled by the ratio of the world sizes: data parallelism multiplies the samples per second of a
  configuration by its ranks), plus a smooth discrepancy, a kernel part of its own (model.py) with a
  prior sd of TAU_SAME (same hardware) or TAU_OTHER (other hardware or world size), fitted with the
  rest. They are never taken as the truth, and many earlier repeats of one configuration do not make
  today's value there any surer than the discrepancy allows: the discrepancy does not average away,
  as independent blurred values would. What the search then measures is what the
  acquisition values most: the earlier near-ties while their intervals overlap, untried
  configurations where the earlier session left doubt. The stop rule ends it as in a cold session.
- The first new run that reports a parameter count other than the earlier sessions' drops the warm
  start: it is another model.
"""

import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

from mlautotune.search.candidates import params_key
from mlautotune.search.ledger import Measured
from mlautotune.search.memory import MemoryModel, savers_of
from mlautotune.search.model import Observation

TAU_SAME = 0.03  # prior sd (log units) of the discrepancy between an earlier landscape and today's, same hardware
TAU_OTHER = 0.25  # ... other hardware or world size
PRIOR_PAIRS = 2.0  # the prior spread weighs as much as this many pairs


@dataclass
class Earlier:
    """Earlier sessions of the same model (matched by fingerprint)."""

    sessions: List[str]  # their names, newest first
    runs: List[Measured]  # their experiments; trial_number < 0, so they never collide with this study's
    same_hardware: bool
    same_ranks: bool = False  # the same accelerator and world size (the memory per device may differ): peaks hold
    num_params: Optional[int] = None  # the model's parameter count, when an earlier run reported it
    about: Dict[str, str] = field(default_factory=dict)  # session name -> a few words (when, experiments, optimum)
    store: Optional[str] = None  # where they were found when not in the study storage: the MLflow store's URI, redacted
    optima: List[str] = field(default_factory=list)  # the optimum each declared (its experiment's name), newest first
    same_accelerator: bool = False  # the same accelerator (the world size may differ): peaks move by ZeRO's states

    @property
    def relation(self) -> str:
        """How their hardware compares with this session's, in the words of the console and summary.txt."""
        if self.same_hardware:
            return "same hardware"
        if self.same_ranks:
            return "another memory size"
        return "another world size" if self.same_accelerator else "other hardware"


class Today(NamedTuple):
    """What the warm start needs of this session to move earlier peaks and values to it."""

    world_size: int
    ds_config: Dict[str, Any]
    mp_size: int
    device: str
    scales: bool  # the metric is the throughput (samples per second of the whole job)


class Warm:
    """The search's view of `Earlier`: which runs count for memory, the earlier throughputs as
    observations, the first step, and when the warm start no longer applies."""

    def __init__(self, earlier: Earlier, score: Callable[[float], float], noise_var: Callable[[Measured], float],
                 today: Optional[Today] = None):
        self.earlier, self.score, self.noise_var, self.today = earlier, score, noise_var, today
        self.tau0 = TAU_SAME if earlier.same_hardware else TAU_OTHER
        self.num_params = earlier.num_params or next((int(m.result.metrics["num_params"]) for m in earlier.runs
                                                       if m.ok and m.result.metrics.get("num_params")), None)
        self.ok = [m for m in earlier.runs if m.value is not None]
        self._memory_facts: Dict[int, List[Measured]] = {}  # limit -> the earlier runs that fit under it (moved once, not at every look)

    @property
    def same_hardware(self) -> bool:
        return self.earlier.same_hardware

    def other_model(self, runs: List[Measured]) -> Optional[int]:
        """The parameter count of a new run when it is not the earlier sessions' (then it is another model)."""
        for m in runs:
            n = m.result.metrics.get("num_params") if m.ok else None
            if n and self.num_params and int(n) != self.num_params:
                return int(n)
        return None

    def memory_runs(self, runs: List[Measured], limit: Optional[int]) -> List[Measured]:
        """The runs whose memory facts hold here: the earlier ones too on the same hardware; with the
        same accelerator, those that ran with a peak under today's `limit` (with another world size,
        the peak moved by the model states' difference)."""
        if any(m.trial_number < 0 for m in runs):
            return runs
        if self.same_hardware:
            return self.earlier.runs + list(runs)
        if not limit or not (self.earlier.same_ranks or (self.earlier.same_accelerator and self.today is not None and self.num_params)):
            return runs
        if limit not in self._memory_facts:
            moved = [self._moved(m) for m in self.earlier.runs if m.ok and m.result.metrics.get("peak_memory_bytes")]
            self._memory_facts[limit] = [m for m in moved if m is not None and m.result.metrics["peak_memory_bytes"] <= limit]
        return self._memory_facts[limit] + list(runs)

    def _moved(self, m: Measured) -> Optional[Measured]:
        """An earlier run with its peak as it would be at today's world size (None: its world size is not known)."""
        if self.earlier.same_ranks:
            return m
        then = m.result.metrics.get("world_size")
        if not then:
            return None
        today, trainable = self.today, int(m.result.metrics.get("trainable_num_params") or self.num_params)

        def states(world_size: int) -> float:
            model = MemoryModel(self.num_params, trainable, today.ds_config, world_size, today.mp_size, None, today.device)
            return model.model_states(m.params["stage"], savers_of(m.params))

        peak = m.result.metrics["peak_memory_bytes"] + states(today.world_size) - states(int(then))
        return replace(m, result=replace(m.result, metrics={**m.result.metrics, "peak_memory_bytes": int(peak)}))

    def offset(self, runs: List[Measured]) -> Tuple[float, float, int]:
        """(c, tau^2, pairs): today's log score = an earlier one + c, give or take tau. From the
        configurations measured in both: c their mean log ratio, tau^2 the spread of the ratios beyond
        what the measurements' own noise explains, shrunk towards the prior spread (for the console;
        the model fits the discrepancy itself)."""
        gas = self.earlier.same_ranks  # with another world size, gas follows it under a fixed global batch: pairs without it
        new = _by_config([m for m in runs if m.value is not None and m.trial_number >= 0], gas)
        old = _by_config(self.ok, gas)
        pairs = [(new[k], old[k]) for k in new if k in old]
        if not pairs:
            return 0.0, self.tau0**2, 0
        r = [self._log_median(a) - self._log_median(b) - self._scale(b[0]) for a, b in pairs]
        c = sum(r) / len(r)
        excess = [max(0.0, (x - c) ** 2 - self._var(a) - self._var(b)) for x, (a, b) in zip(r, pairs)]
        tau2 = (PRIOR_PAIRS * self.tau0**2 + sum(excess)) / (PRIOR_PAIRS + len(pairs))
        return c, tau2, len(pairs)

    def observations(self, runs: List[Measured]) -> List[Observation]:
        """The earlier measurements, offset by c, as observations of the earlier landscape (`earlier`:
        today's plus the model's discrepancy part)."""
        c, _, _ = self.offset(runs)
        return [Observation(m.params, math.log(self.score(v)) + self._scale(m) + c, self.noise_var(m), earlier=True) for m in self.ok for v in m.values]

    def _scale(self, m: Measured) -> float:
        """For the throughput metric, log(today's world size / the run's): a configuration's samples per
        second grow with its data-parallel ranks. 0 for the other metrics, or a world size not known."""
        then = m.result.metrics.get("world_size")
        today = self.today
        return math.log(today.world_size / int(then)) if today is not None and today.scales and then else 0.0

    def optimum(self) -> Optional[Measured]:
        """The optimum the newest earlier session declared (what its report, parent run and study
        name); by median measurement only when none of them declared one that is among their runs."""
        for name in self.earlier.optima:
            if (declared := next((m for m in self.ok if m.result.name == name), None)) is not None:
                return declared
        return max(self.ok, key=lambda m: self.score(m.final_value), default=None)

    def describe(self, runs: List[Measured]) -> str:
        c, tau2, n = self.offset(runs)
        if not n:
            return f"no configuration measured in both yet; an earlier value counts with a ±{math.sqrt(tau2):.0%} spread"
        return (f"{n} configuration{'s' if n > 1 else ''} measured in both: today = earlier x {math.exp(c):.3f}, "
                f"each earlier value with a ±{math.sqrt(tau2):.1%} spread")

    def _log_median(self, ms: List[Measured]) -> float:
        return statistics.median(math.log(self.score(v)) for m in ms for v in m.values)

    def _var(self, ms: List[Measured]) -> float:
        return min(self.noise_var(m) for m in ms) / max(1, sum(len(m.values) for m in ms))


def _by_config(runs: List[Measured], gas: bool = True) -> Dict[str, List[Measured]]:
    out: Dict[str, List[Measured]] = {}
    for m in runs:
        out.setdefault(params_key(m.params if gas else {k: v for k, v in m.params.items() if k != "gas"}), []).append(m)
    return out
