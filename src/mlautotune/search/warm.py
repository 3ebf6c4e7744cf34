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
- Other hardware: profiling runs as in a cold session; the earlier memory facts are not used.
- Either way the earlier throughputs enter the throughput model as observations of the earlier
  landscape: today's, offset by one factor (learnt from the configurations measured in both
  sessions, `Warm.offset`), plus a smooth discrepancy, a kernel part of its own (model.py) with a
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
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from mlautotune.search.candidates import params_key
from mlautotune.search.ledger import Measured
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

    @property
    def relation(self) -> str:
        """How their hardware compares with this session's, in the words of the console and summary.txt."""
        return "same hardware" if self.same_hardware else "another memory size" if self.same_ranks else "other hardware"


class Warm:
    """The search's view of `Earlier`: which runs count for memory, the earlier throughputs as
    observations, the first step, and when the warm start no longer applies."""

    def __init__(self, earlier: Earlier, score: Callable[[float], float], noise_var: Callable[[Measured], float]):
        self.earlier, self.score, self.noise_var = earlier, score, noise_var
        self.tau0 = TAU_SAME if earlier.same_hardware else TAU_OTHER
        self.num_params = earlier.num_params or next((int(m.result.metrics["num_params"]) for m in earlier.runs
                                                       if m.ok and m.result.metrics.get("num_params")), None)
        self.ok = [m for m in earlier.runs if m.value is not None]

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
        same accelerator and world size, those that ran with a measured peak under today's `limit`."""
        if any(m.trial_number < 0 for m in runs):
            return runs
        if self.same_hardware:
            return self.earlier.runs + list(runs)
        if self.earlier.same_ranks and limit:
            return [m for m in self.earlier.runs if m.ok and 0 < m.result.metrics.get("peak_memory_bytes", 0) <= limit] + list(runs)
        return runs

    def offset(self, runs: List[Measured]) -> Tuple[float, float, int]:
        """(c, tau^2, pairs): today's log score = an earlier one + c, give or take tau. From the
        configurations measured in both: c their mean log ratio, tau^2 the spread of the ratios beyond
        what the measurements' own noise explains, shrunk towards the prior spread (for the console;
        the model fits the discrepancy itself)."""
        new = _by_config([m for m in runs if m.value is not None and m.trial_number >= 0])
        old = _by_config(self.ok)
        pairs = [(new[k], old[k]) for k in new if k in old]
        if not pairs:
            return 0.0, self.tau0**2, 0
        r = [self._log_median(a) - self._log_median(b) for a, b in pairs]
        c = sum(r) / len(r)
        excess = [max(0.0, (x - c) ** 2 - self._var(a) - self._var(b)) for x, (a, b) in zip(r, pairs)]
        tau2 = (PRIOR_PAIRS * self.tau0**2 + sum(excess)) / (PRIOR_PAIRS + len(pairs))
        return c, tau2, len(pairs)

    def observations(self, runs: List[Measured]) -> List[Observation]:
        """The earlier measurements, offset by c, as observations of the earlier landscape (`earlier`:
        today's plus the model's discrepancy part)."""
        c, _, _ = self.offset(runs)
        return [Observation(m.params, math.log(self.score(v)) + c, self.noise_var(m), earlier=True) for m in self.ok for v in m.values]

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


def _by_config(runs: List[Measured]) -> Dict[str, List[Measured]]:
    out: Dict[str, List[Measured]] = {}
    for m in runs:
        out.setdefault(params_key(m.params), []).append(m)
    return out
