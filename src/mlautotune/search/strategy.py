"""The strategy: which configuration to measure next, decided afresh from everything the study holds.

`Strategy.next(ledger)` is a function of the measured and pending trials (and the seed), so a
resumed session, or a second worker on the same study, takes up the search where it stands.

1. Profiling: the first stage at the smallest micro-batch, and if that runs out of memory, the
   stage that keeps the least per rank; then a second size of the stage that ran. The memory model
   comes from the first successful run of any stage. A stage whose model states alone cannot fit,
   or that is predicted to OOM at the smallest micro-batch, is skipped with no experiment.
2. Micro-batch per stage (default knobs, microbatch.py): the stage that leads by more than the
   noise brackets its own peak, memory edge first. Every other stage gets one look, placed by the
   line of the stage below it stretched to its own memory edge; that run scales the prior, and
   the stage goes on only where the scaled line can still win.
3. Knobs, most promising stage first: at the stage's best micro-batch, the tuner chooses among the
   untried knob combinations (model_based: the XGBoost cost model with feasibility).
4. Joint refinement: the stage's best knobs, and any knobs tied with them within the noise, get
   their own micro-batch search (their own memory edge too), with the default knobs' line as the prior.
5. Noise: a disturbed measurement is re-measured before the search builds on it (the leader
   first), and its re-measurement replaces it; near-ties (within their intervals)
   are re-measured until they separate or `remeasure` repeats are done; a pick still tied when
   that budget is spent is measured again once if it stands on one window.

One global stop rule gates every step: a candidate is measured only if its optimistic value beats
the incumbent by more than EXPLORE (half) of a measurement's interval, about one standard error.
Nothing left -> the search ends.
"""

import math
import statistics
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from mlautotune.memory import MemoryModel
from mlautotune.samplers import make_chooser
from mlautotune.samplers.cost_model import CostModel
from mlautotune.search.candidates import base_knobs, base_params, knobs_of_params, micro_batch_cap, params_key, stage_knob_combos, with_knobs
from mlautotune.search.ledger import Ledger, Measured
from mlautotune.search.microbatch import Point, concave_bound, edge_probe, peak_probe, scaled_reference, sizes_between, stretched
from mlautotune.search.settings import SearchSettings
from mlautotune.space import TuningPlan

UNSEEN_STAGE = 10.0  # a stage not measured yet may be this much faster at the same micro-batch: every stage gets one look
KNOB_PRIOR = 0.25  # what knobs the cost model has not yet seen varied might be worth
KNOB_STARTUP = 4  # knob experiments on that prior in a stage tied for the lead; then the cost model decides
MODEL_SLACK = 0.02  # the cost model's prediction, made optimistic by this much
MIN_MARGIN = 0.005
MAX_INTERVAL = 0.10  # a wider interval (a spread with outliers) counts as this: leaders further apart are not near-ties
EXPLORE = 0.5  # measure a candidate predicted to beat the incumbent by more than this part of a measurement's interval (about one standard error)
PROFILE_FACTOR = 4  # the second profiling point: this many times the smallest micro-batch


@dataclass
class Step:
    params: Dict[str, Any]
    why: str
    repeat_of: Optional[Measured] = None


class Strategy:
    def __init__(self, plan: TuningPlan, settings: SearchSettings):
        self.plan, self.s = plan, settings
        self.chooser = make_chooser(settings.tuner_type, settings.seed, settings.sampler_target)
        self.cap = micro_batch_cap(plan, settings.world_size)
        self.low = min(plan.micro_batch.values)
        self.notes: List[str] = []
        self.memory: Optional[MemoryModel] = None
        self.pending_params: List[Dict[str, Any]] = []  # configurations other workers are measuring
        self.pending_repeats: Dict[str, int] = {}  # re-measurements other workers are running, by configuration key

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    # ---- scores: higher is better whatever the metric -----------------------------------------
    def score(self, value: Optional[float]) -> Optional[float]:
        if value is None:
            return None
        return value if self.s.maximize else 1.0 / max(value, 1e-12)

    def best(self, runs: List[Measured]) -> Optional[Measured]:
        ok = [m for m in runs if m.value is not None]
        return max(ok, key=lambda m: self.score(m.final_value)) if ok else None

    # ---- the next step ------------------------------------------------------------------------------
    def next(self, ledger: Ledger) -> Optional[Step]:
        runs, taken = ledger.order, ledger.taken()
        self.pending_params = list(ledger.pending.values())
        self.pending_repeats = ledger.pending_repeats
        self.memory = self._memory_model(runs)
        if self._slope_pending(runs):
            return None  # another worker is measuring the second memory point: edges placed without it run out of memory
        step = self._profile_step(runs, taken)
        if step is not None or not any(m.ok for m in runs):
            return step
        best = self.best(runs)
        disturbed = [m for m in runs if m.value is not None and m.disturbed and not self._repeats_pending(m)]
        if disturbed and self.s.remeasure > 0:  # the leader first; a low disturbed value would close its line
            m = max(disturbed, key=lambda m: self.score(m.final_value))
            return Step(m.params, f"{m.result.name} was disturbed: re-measured before the search builds on it", repeat_of=m)
        target = self.score(best.final_value) * (1 + EXPLORE * self._margin(runs, best)) if best else 0.0
        stages = self._spread([s for s in self.plan.stages if self._feasible(s)])
        for stage in stages:
            step = self._micro_batch_step(stage, runs, taken, target)
            if step is not None:
                return step
        by_promise = self._spread(sorted(stages, key=lambda s: -(self.score((self._stage_best(runs, s) or best).final_value) or 0)))
        for stage in by_promise:
            step = self._knob_step(stage, runs, taken, target, ledger) or self._joint_step(stage, runs, taken, target)
            if step is not None:
                return step
        return self._remeasure_step(runs)

    def _spread(self, stages: List[int]) -> List[int]:
        """Stages nobody is measuring first (in their order), then those with trials in flight: with
        several workers, each goes where its result is not already on the way."""
        busy = {p["stage"] for p in self.pending_params}
        return [s for s in stages if s not in busy] + [s for s in stages if s in busy]

    def _margin(self, runs: List[Measured], best: Measured) -> float:
        """The interval of one measurement (a candidate is measured once): the median of the runs'."""
        intervals = [m.single_interval for m in runs if m.ok]
        return min(max(statistics.median(intervals) if intervals else 0.0, MIN_MARGIN), MAX_INTERVAL)

    # ---- profiling and the memory model -------------------------------------------------------------
    def _memory_model(self, runs: List[Measured]) -> Optional[MemoryModel]:
        info = next((m.result.metrics for m in runs if m.ok and m.result.metrics.get("num_params")), None)
        if info is None:
            return None
        model = MemoryModel(
            num_params=int(info["num_params"]), trainable_params=int(info.get("trainable_num_params", info["num_params"])),
            ds_config=self.plan.base_config, world_size=self.s.world_size, mp_size=self.plan.mp_size,
            limit_bytes=int(self.s.memory_limit_bytes or 0) or None, device=self.s.device,
        )
        for m in runs:  # knobs change memory (buckets): the model learns from default-knob runs only
            peak = m.result.metrics.get("peak_memory_bytes")
            if m.result.status in ("ok", "oom") and knobs_of_params(m.params) == base_knobs(self.plan, m.params["stage"]):
                model.observe(m.params["stage"], m.params["micro_batch"], int(peak) if peak else None, m.result.status == "oom")
        return model

    def _profile_step(self, runs: List[Measured], taken: set) -> Optional[Step]:
        """Until a run succeeds: the first stage at the smallest micro-batch, then the stage that keeps
        the least per rank, then the others. Then a second size of a stage that ran, for the slope."""
        if self.memory is None and any(m.ok for m in runs):
            return None  # runs without a parameter count (no memory model): micro-batches by doubling
        stages = self.plan.stages
        if self.memory is None:  # the first stage's two sizes (another worker takes the second at once), then the
            order = dict.fromkeys([stages[0], stages[-1], *stages[1:-1]])  # others: a failure that is not an OOM may be passing
            for stage, mbs in [(stages[0], self.low), (stages[0], self._second_size()), *((s, m) for m in (self.low, self._second_size()) for s in order)]:
                p = base_params(self.plan, stage, mbs)
                if params_key(p) not in taken and not self._oom_at_or_below(runs, stage, mbs):
                    return Step(p, "profiling: model info and a first memory point")
            return None
        if self.plan.micro_batch.mode != "min" or self.memory.per_sample_measured():
            return None
        first, mbs = self._second_point(runs)  # not in flight (next() waits while it is): one is enough
        p = with_knobs(self.plan, first.params["stage"], mbs, knobs_of_params(first.params))
        if (self.cap is not None and mbs > self.cap) or params_key(p) in taken:
            return None
        return Step(p, "profiling: a second memory point for the per-sample slope")

    def _second_point(self, runs: List[Measured]) -> Tuple[Measured, int]:
        """The first run (the same for every worker: the lowest trial number) and the second size to measure."""
        first = min((m for m in runs if m.ok), key=lambda m: m.trial_number)
        return first, first.params["micro_batch"] * PROFILE_FACTOR

    def _slope_pending(self, runs: List[Measured]) -> bool:
        """Another worker is measuring the second memory point that the edges wait for."""
        if self.plan.micro_batch.mode != "min" or self.memory is None or self.memory.per_sample_measured():
            return False
        mbs = self._second_point(runs)[1]
        return any(p["micro_batch"] == mbs for p in self.pending_params)

    def _second_size(self) -> int:
        rule = self.plan.micro_batch
        if rule.mode == "list" and len(rule.values) > 1:
            return sorted(rule.values)[1]
        if rule.mode == "min" and (self.cap is None or self.low * PROFILE_FACTOR <= self.cap):
            return self.low * PROFILE_FACTOR
        return self.low

    def _oom_at_or_below(self, runs: List[Measured], stage: int, mbs: int) -> bool:
        return any(m.result.status == "oom" and m.params["stage"] == stage and m.params["micro_batch"] <= mbs for m in runs)

    def _feasible(self, stage: int) -> bool:
        m = self.memory
        if m is None:
            return True
        if m.limit and m.model_states(stage) > m.limit:
            self.note(f"z{stage}: skipped, its model states alone ({m.model_states(stage) / 2**30:.2f} GiB/rank) exceed the memory limit")
            return False
        if not m.fits(stage, self.low):
            self.note(f"z{stage}: skipped, the memory model predicts OOM at micro-batch {self.low}")
            return False
        return True

    # ---- one line: a stage with fixed knobs, along the micro-batch ------------------------------------
    def _line(self, runs: List[Measured], stage: int, knobs: Dict[str, Any]) -> Tuple[List[Point], List[int], List[int]]:
        same = [m for m in runs if m.params["stage"] == stage and knobs_of_params(m.params) == knobs]
        own = [(m.params["micro_batch"], self.score(m.final_value)) for m in same if m.value is not None]
        ooms = [m.params["micro_batch"] for m in same if m.result.status == "oom"]
        return own, ooms, [m.params["micro_batch"] for m in same]

    def _taken_sizes(self, stage: int, knobs: Dict[str, Any], taken: set, sizes: List[int]) -> set:
        return {m for m in sizes if params_key(with_knobs(self.plan, stage, m, knobs)) in taken}

    def _candidates(self, stage: int, high: int) -> List[int]:
        rule = self.plan.micro_batch
        if rule.mode == "fixed":
            return list(rule.values)
        allowed = [m for m in rule.values if self.memory is None or self.memory.fits(stage, m)] if rule.mode == "list" else None
        return sizes_between(self.low, min(high, self.cap or high), allowed)

    def _reference(self, runs: List[Measured], stage: int) -> Tuple[List[Point], Optional[int]]:
        """The best line of the nearest lower stage that ran, completed where it has no points of
        its own by the line below it, scaled; and its memory edge (nothing for the lowest stage)."""
        for lower in sorted((s for s in self.plan.stages if s < stage), reverse=True):
            b = self._stage_best(runs, lower)
            if b is not None:
                own = self._line(runs, lower, knobs_of_params(b.params))[0]
                below, below_edge = self._reference(runs, lower)
                completion = scaled_reference(own, stretched(below, below_edge, self._stage_edge(lower, own)), 1.0)
                # where the stage's own points bound its line (concave), the completion stays under them
                return own + [(m, min(v, concave_bound(own, m))) for m, v in completion], self._stage_edge(lower, own)
        return [], None

    def _stage_edge(self, stage: int, own: List[Point]) -> Optional[int]:
        if self.plan.micro_batch.mode != "min":
            return None
        if self.memory is not None:
            return self.memory.max_micro_batch(stage, cap=self.cap) or None
        return max((m for m, _ in own), default=None)

    def _edge(self, own: List[Point], ooms: List[int], stage: int, predicted: Optional[int] = None) -> Optional[int]:
        if self.plan.micro_batch.mode != "min":
            return None
        if predicted is None and self.memory is not None:
            predicted = self.memory.max_micro_batch(stage, cap=self.cap)
        return edge_probe([m for m, _ in own], ooms, self.low, self.cap, predicted, chunky=self.s.device == "cpu")

    def _micro_batch_step(self, stage: int, runs: List[Measured], taken: set, target: float) -> Optional[Step]:
        knobs = base_knobs(self.plan, stage)
        own, ooms, _ = self._line(runs, stage, knobs)
        edge = self._edge(own, ooms, stage)
        # the stage that leads by more than the noise gets a search of its own; the others are
        # priced by the line below them
        reference, ref_edge = ([], None) if self._leads(runs, stage, target) else self._reference(runs, stage)
        if not reference and self.plan.micro_batch.mode == "list":
            target = -math.inf  # sizes the user listed are all measured in the stage searched on its own
        return self._line_step(stage, knobs, own, ooms, stretched(reference, ref_edge, self._line_edge(own, edge)), edge, taken, target, UNSEEN_STAGE)

    def _leads(self, runs: List[Measured], stage: int, target: float) -> bool:
        """The stage holds the incumbent, and no other stage's best is within the noise of it."""
        mine = self._stage_best(runs, stage)
        if mine is None or mine is not self.best(runs):
            return False
        lead = self.score(mine.final_value)
        others = [self.score(b.final_value) for s in self.plan.stages if s != stage and (b := self._stage_best(runs, s)) is not None]
        return all(v * target / lead < lead for v in others)

    def _line_edge(self, own: List[Point], edge: Optional[int]) -> Optional[int]:
        """The line's memory edge: the edge search's next size, or its largest run once that is known."""
        return edge if edge is not None else max((m for m, _ in own), default=None)

    def _line_step(self, stage, knobs, own, ooms, reference, edge, taken, target, prior_ratio) -> Optional[Step]:
        high = max([m for m, _ in own] + [edge or 0, self.low] + (list(self.plan.micro_batch.values) if self.plan.micro_batch.mode != "min" else []))
        if ooms:
            high = min(high, min(ooms) - 1)
        candidates = self._candidates(stage, high)
        taken_sizes = self._taken_sizes(stage, knobs, taken, candidates) | set(ooms)
        pending = {p["micro_batch"] for p in self.pending_params if p["stage"] == stage and knobs_of_params(p) == knobs}
        mbs, bound = peak_probe(own, reference, candidates, taken_sizes, target, prior_ratio, high_probe=edge, rate=self.s.metric != "latency", pending=pending)
        if mbs is None:
            return None
        return Step(with_knobs(self.plan, stage, mbs, knobs), f"z{stage}: micro-batch {mbs} may reach {bound:.4g}")

    # ---- knobs, then the best knobs' own micro-batch -------------------------------------------------
    def _stage_best(self, runs: List[Measured], stage: int) -> Optional[Measured]:
        return self.best([m for m in runs if m.params["stage"] == stage])

    def _knob_step(self, stage: int, runs: List[Measured], taken: set, target: float, ledger: Ledger) -> Optional[Step]:
        combos = stage_knob_combos(self.plan, stage)
        best = self._stage_best(runs, stage)
        if len(combos) < 2 or best is None:
            return None
        base = base_knobs(self.plan, stage)
        base_line = [m for m in runs if m.params["stage"] == stage and knobs_of_params(m.params) == base and m.value is not None]
        at = max(base_line, key=lambda m: self.score(m.final_value)).params["micro_batch"] if base_line else best.params["micro_batch"]
        untried = [p for k in combos if params_key(p := with_knobs(self.plan, stage, at, k)) not in taken]
        if not untried:
            return None
        knob_runs = [m for m in runs if m.params["stage"] == stage and knobs_of_params(m.params) != base]
        margin = self._margin(runs, best)
        if self._since_improvement([m for m in runs if m.params["stage"] == stage], base, margin) >= self.s.early_stopping:
            self.note(f"z{stage}: early stop of the knob search after {self.s.early_stopping} experiments without improvement")
            return None
        leading = self.score(best.final_value) * (1 + margin) >= target
        promise = self._knob_promise(untried, runs, best, margin, len(knob_runs) if leading else KNOB_STARTUP)
        if promise <= target:
            self.note(f"z{stage}: no untried knob combination is predicted to beat the incumbent by more than the noise")
            return None
        history = [(m.params, m.final_value, m.result.status) for m in runs if m.result.status in ("ok", "oom")]
        choice = self.chooser.choose(untried, history, self.s.maximize, ledger.experiments)
        return Step(choice, f"z{stage}: knobs at micro-batch {at} ({self.chooser.last_choice})")

    def _since_improvement(self, stage_runs: List[Measured], base: Dict[str, Any], margin: float) -> int:
        """Knob experiments of the stage since its best last rose by more than the noise."""
        best, since = None, 0
        for m in sorted(stage_runs, key=lambda m: m.trial_number):
            value = self.score(m.final_value)
            if value is not None and (best is None or value > best * (1 + margin)):
                best, since = value, 0
            elif knobs_of_params(m.params) != base:
                since += 1
        return since

    def _knob_promise(self, untried: List[Dict[str, Any]], runs: List[Measured], best: Measured, margin: float, knob_runs: int) -> float:
        """Optimistic value of the stage's untried knob combinations: for its first KNOB_STARTUP
        knob experiments, a prior while some knob value has not been seen in any run; then the
        cost model's best prediction."""
        ok = [m for m in runs if m.value is not None]
        seen = {(k, repr(v)) for m in ok for k, v in knobs_of_params(m.params).items()}
        unseen = any((k, repr(v)) not in seen for p in untried for k, v in knobs_of_params(p).items())
        if unseen and knob_runs < KNOB_STARTUP:
            return self.score(best.final_value) * (1 + KNOB_PRIOR)
        model = CostModel(seed=self.s.seed).fit([m.params for m in ok], [self.score(m.final_value) for m in ok])
        return float(max(model.predict(untried))) * (1 + MODEL_SLACK)  # the target has the noise margin already

    def _joint_step(self, stage: int, runs: List[Measured], taken: set, target: float) -> Optional[Step]:
        """The stage's best knobs along the micro-batch, and those of any knob combination tied with
        them within the noise: its own edge (knobs change memory) from its measured peak, and the
        default knobs' line as the prior."""
        best = self._stage_best(runs, stage)
        base = base_knobs(self.plan, stage)
        if best is None:
            return None
        contenders = sorted((m for m in runs if m.params["stage"] == stage and m.value is not None and knobs_of_params(m.params) != base
                             and (m is best or self._tied(best, m))), key=lambda m: -self.score(m.final_value))
        for knobs in dict.fromkeys(repr(knobs_of_params(m.params)) for m in contenders):
            lead = next(m for m in contenders if repr(knobs_of_params(m.params)) == knobs)
            step = self._knob_line_step(stage, lead, runs, taken, target)
            if step is not None:
                return step
        return None

    def _knob_line_step(self, stage: int, lead: Measured, runs: List[Measured], taken: set, target: float) -> Optional[Step]:
        knobs = knobs_of_params(lead.params)
        own, ooms, _ = self._line(runs, stage, knobs)
        base_line = self._line(runs, stage, base_knobs(self.plan, stage))[0]
        below, below_edge = self._reference(runs, stage)
        base_edge = self._stage_edge(stage, base_line)
        reference = base_line + scaled_reference(base_line, stretched(below, below_edge, base_edge), 1.0)
        predicted = None
        peak = lead.result.metrics.get("peak_memory_bytes")
        if self.memory is not None and self.memory.limit and self.memory.per_sample and peak:
            predicted = lead.params["micro_batch"] + int((self.memory.limit - peak) / self.memory.per_sample)
        edge = self._edge(own, ooms, stage, predicted) if predicted is not None else None
        return self._line_step(stage, knobs, own, ooms, stretched(reference, base_edge, self._line_edge(own, edge)), edge, taken, target, 1.0)

    # ---- noise -------------------------------------------------------------------------------------------
    def _remeasure_step(self, runs: List[Measured]) -> Optional[Step]:
        """The best two, if their values overlap within their intervals, are measured again in turn
        until they separate or each has `remeasure` repeats (at most 2 x remeasure repeats in all)."""
        ok = sorted((m for m in runs if m.value is not None), key=lambda m: -self.score(m.final_value))
        if len(ok) < 2 or self.s.remeasure <= 0:
            return None
        lead = ok[0]
        ties = [m for m in ok[1:2] if self._tied(lead, m)]
        if not ties:
            return None
        if sum(self._repeats(m) for m in ok) >= 2 * self.s.remeasure:  # one tie's worth of repeats in all: noise
            if self._repeats(lead) == 0:  # that does not settle by then is a tie, but the pick is not left on one window
                return Step(lead.params, f"the pick, tied with {ties[0].result.name}, on one measurement", repeat_of=lead)
            return None
        for round_ in range(1, self.s.remeasure + 1):
            for m in [lead, *ties]:
                if self._repeats(m) < round_:
                    self.note("re-measuring near-tied leaders: " + ", ".join(x.result.name for x in [lead, *ties]))
                    return Step(m.params, f"near-tie with {lead.result.name}", repeat_of=m)
        return None

    def _repeats_pending(self, m: Measured) -> int:
        return self.pending_repeats.get(params_key(m.params), 0)

    def _repeats(self, m: Measured) -> int:
        """Re-measurements of m, done or being done by another worker."""
        return len(m.repeats) + self._repeats_pending(m)

    def _tied(self, lead: Measured, other: Measured) -> bool:
        a, b = self.score(lead.final_value), self.score(other.final_value)
        return (a - b) / a <= min(lead.interval + other.interval, MAX_INTERVAL)


def first_experiments(plan: TuningPlan, world_size: int) -> List[Dict[str, Any]]:
    """The session's first experiments, as `_profile_step` picks them when they run: the first stage at
    the smallest micro-batch, then (micro-batch rule "min") at PROFILE_FACTOR times it for the
    memory slope. `mlautotune plan` prints these and `mlautotune experiment` runs the first."""
    cap, low = micro_batch_cap(plan, world_size), min(plan.micro_batch.values)
    first = [base_params(plan, plan.stages[0], low)]
    if plan.micro_batch.mode == "min" and low * PROFILE_FACTOR <= cap:
        first.append(base_params(plan, plan.stages[0], low * PROFILE_FACTOR))
    return first
