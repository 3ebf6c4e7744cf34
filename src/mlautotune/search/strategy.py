"""The strategy: which configuration to measure next, decided afresh from everything the study holds.

`Strategy.next(ledger)` is a function of the measured and pending trials (and the seed), so a
resumed session, or a second worker on the same study, takes up the search where it stands. It
asks its steps in order, each in its own module:

1. profiling.py: the first runs and the memory model; stages that cannot fit are skipped.
2. lines.py: the micro-batch of each stage with its default knobs (the leading stage searches its
   own line above its sizes; below them, and everywhere for the others, the line of the stage below
   prices it, or above where none below ran; with several workers, at most two sizes of a line at
   once, step 4's knob lines included, the next worker going on down this list).
3. knobs.py: the ZeRO knobs of each stage at its best micro-batch: of the stages tied for the lead,
   the one with the most knob combinations first.
4. knobs.py: joint refinement, the best (and tied) knobs' own micro-batch search.
5. repeats.py: disturbed measurements first, then near-tied leaders, measured again.

When the experiments left in tuner_num_trials are no more than the stages not yet run, those stages'
first looks (step 2) come before everything after profiling: a small budget still tries every stage.
Each such look, the stage's only one, leaves 10% of the memory limit free (lines.ONLY_LOOK_HEADROOM).

What the steps share lives here: the score (higher is better whatever the metric), the incumbent,
the interval of one measurement, near-ties, and the one global stop rule that gates every step: a
candidate is measured only if its optimistic value beats the incumbent by more than `search.explore`
(by default half) of a measurement's interval, about one standard error. Nothing left -> the search
ends. A lower `explore` also measures candidates that may only tie the incumbent: the incumbent is
the luckiest of its near-ties, so its value is biased high and the strict rule stops short of them.
"""

import statistics
from typing import Any, Dict, List, Optional

from mlautotune.search.memory import MemoryModel
from mlautotune.search.samplers import make_chooser
from mlautotune.search.candidates import stage_knob_combos
from mlautotune.search.knobs import Knobs
from mlautotune.search.ledger import Ledger, Measured
from mlautotune.search.lines import Lines
from mlautotune.search.profiling import Profiling
from mlautotune.search.repeats import Repeats
from mlautotune.search.settings import SearchSettings
from mlautotune.search.step import Step, StrategyBase
from mlautotune.inputs.space import TuningPlan

__all__ = ["Step", "Strategy"]

MIN_MARGIN = 0.005
MAX_INTERVAL = 0.10  # a wider interval (a spread with outliers) counts as this: leaders further apart are not near-ties


class Strategy(StrategyBase):
    def __init__(self, plan: TuningPlan, settings: SearchSettings):
        self.plan, self.s = plan, settings
        self.chooser = make_chooser(settings.tuner_type, settings.seed, settings.sampler_target)
        self.cap = plan.micro_batch_cap
        self.low = min(plan.micro_batch.values)
        self.notes: List[str] = []
        self.memory: Optional[MemoryModel] = None
        self.pending_params: List[Dict[str, Any]] = []  # configurations other workers are measuring
        self.pending_repeats: Dict[str, int] = {}  # re-measurements other workers are running, by configuration key
        self.largest_run: Optional[int] = None  # the largest micro-batch that ran in any stage
        self.profiling, self.lines, self.knobs, self.repeats = Profiling(self), Lines(self), Knobs(self), Repeats(self)

    # ---- what the steps share ----------------------------------------------------------------------
    def best(self, runs: List[Measured]) -> Optional[Measured]:
        ok = [m for m in runs if m.value is not None]
        return max(ok, key=lambda m: self.score(m.final_value)) if ok else None

    def stage_best(self, runs: List[Measured], stage: int) -> Optional[Measured]:
        return self.best([m for m in runs if m.params["stage"] == stage])

    def margin(self, runs: List[Measured]) -> float:
        """The interval of one measurement (a candidate is measured once): the median of the runs'."""
        intervals = [m.single_interval for m in runs if m.ok]
        return min(max(statistics.median(intervals) if intervals else 0.0, MIN_MARGIN), MAX_INTERVAL)

    def tied(self, lead: Measured, other: Measured) -> bool:
        """The two values are within their intervals of each other."""
        a, b = self.score(lead.final_value), self.score(other.final_value)
        return (a - b) / a <= min(lead.interval + other.interval, MAX_INTERVAL)

    def spread(self, stages: List[int]) -> List[int]:
        """Stages nobody is measuring first (in their order), then those with trials in flight: with
        several workers, each goes where its result is not already on the way."""
        busy = {p["stage"] for p in self.pending_params}
        return [s for s in stages if s not in busy] + [s for s in stages if s in busy]

    def knob_order(self, runs: List[Measured], stages: List[int], best: Measured) -> List[int]:
        """The stages in the order their knobs are searched: those tied with the incumbent first, the
        one with the most knob combinations first among them (more candidates, more chances that one
        beats the incumbent), then the others by their best."""
        by_value = sorted(stages, key=lambda s: -(self.score((self.stage_best(runs, s) or best).final_value) or 0))
        tied = [s for s in by_value if (b := self.stage_best(runs, s)) is not None and (b is best or self.tied(best, b))]
        tied.sort(key=lambda s: -len(stage_knob_combos(self.plan, s)))
        return tied + [s for s in by_value if s not in tied]

    def unseen_on_a_tight_budget(self, stages: List[int], runs: List[Measured], ledger: Ledger) -> List[int]:
        """The stages not yet run, when the experiments left in the budget (tuner_num_trials) are no more
        than they are: each gets its first look before anything else, a disturbed measurement's repeat
        and the lines included. One look at every stage tells more than the last sizes of one line,
        and a budget that ends before a stage was tried leaves a report with the stage missing."""
        tried = {m.params["stage"] for m in runs} | {p["stage"] for p in self.pending_params}
        unseen = [s for s in stages if s not in tried]
        left = self.s.num_trials - ledger.spent
        if not unseen or left > len(unseen):
            return []
        self.note(f"tuner_num_trials={self.s.num_trials} would be spent before every stage had a look: "
                  "the stages not yet run get their first look before anything else")
        return unseen

    # ---- the next step ------------------------------------------------------------------------------
    def next(self, ledger: Ledger) -> Optional[Step]:
        runs, taken = ledger.order, ledger.taken()
        self.pending_params = list(ledger.pending.values())
        self.pending_repeats = ledger.pending_repeats
        self.largest_run = max((m.params["micro_batch"] for m in runs if m.ok), default=None)
        self.memory = self.memory_model(runs)
        if self.profiling.slope_pending(runs):
            return None  # another worker is measuring the second memory point: edges placed without it run out of memory
        step = self.profiling.step(runs, taken)
        if step is not None or not any(m.ok for m in runs):
            return step
        best = self.best(runs)
        target = self.score(best.final_value) * (1 + self.s.explore * self.margin(runs)) if best else 0.0
        stages = self.spread([s for s in self.plan.stages if self.profiling.feasible(s)])
        for stage in self.unseen_on_a_tight_budget(stages, runs, ledger):
            step = self.lines.step(stage, runs, taken, target, only_look=True)
            if step is not None:
                return step
        step = self.repeats.disturbed_step(runs)
        if step is not None:
            return step
        for stage in stages:
            step = self.lines.step(stage, runs, taken, target)
            if step is not None:
                return step
        for stage in self.spread(self.knob_order(runs, stages, best)):
            step = self.knobs.next(stage, runs, taken, target, ledger)
            if step is not None:
                return step
        return self.repeats.step(runs, target)
