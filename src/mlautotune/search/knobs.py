"""Steps 3 and 4, the ZeRO knobs of a stage, then the best knobs' own micro-batch.

3. At the stage's best micro-batch (`micro_batch`: of sizes tied within the noise, the largest below
   a fall at the line's edge, else the middle), the tuner chooses among the untried knob combinations
   (model_based: the XGBoost cost model with feasibility), while their optimistic value can beat
   the incumbent: in the stage tied for the lead, a prior for knob values not seen yet; in a stage
   behind it, one look if its best is within KNOB_LOOK of the incumbent; then the cost model's
   prediction. A stage's knob search also ends once KNOB_STARTUP + 1 combinations measured there
   differ by no more than the noise (`_within_noise`).
4. Joint refinement: the stage's best knobs, and any knobs tied with them within the noise that
   leave room for a larger micro-batch, get their own micro-batch search (their own memory edge
   too), with the default knobs' line as the prior, completed by the knob lines searched before.
   With several workers it runs beside step 3: while a knob combination of the stage is in flight,
   the next worker takes the best knobs' micro-batch search.
"""

import math
import statistics
from typing import Any, Dict, List, Optional, Tuple

from mlautotune.search.samplers.cost_model import CostModel
from mlautotune.search.candidates import base_knobs, knobs_of_params, params_key, stage_knob_combos, with_knobs
from mlautotune.search.ledger import Ledger, Measured
from mlautotune.search.microbatch import EDGE_TOLERANCE, Point, scaled_reference, stretched
from mlautotune.search.step import Step

KNOB_PRIOR = 0.25  # what knobs the cost model has not yet seen varied might be worth
KNOB_STARTUP = 4  # knob experiments on that prior in a stage tied for the lead; then the cost model decides
KNOB_LOOK = 0.10  # a stage behind the lead gets one knob experiment while its best is within this much of the incumbent
MODEL_SLACK = 0.02  # the cost model's prediction, made optimistic by this much
NOISE_SPREAD = 1.5  # knob combinations whose values vary no more than this times one value's noise variance: knobs within the noise


class Knobs:
    def __init__(self, strategy):
        self.st = strategy

    def next(self, stage: int, runs: List[Measured], taken: set, target: float, ledger: Ledger) -> Optional[Step]:
        """Step 3, then step 4. While another worker measures a knob combination of the stage, step 4
        first: the best knobs so far get their micro-batch search beside the knob search, not after it."""
        if self.pending(stage):
            return self.joint_step(stage, runs, taken, target) or self.step(stage, runs, taken, target, ledger)
        return self.step(stage, runs, taken, target, ledger) or self.joint_step(stage, runs, taken, target)

    def step(self, stage: int, runs: List[Measured], taken: set, target: float, ledger: Ledger) -> Optional[Step]:
        """A knob combination of the stage at its best default-knob micro-batch, chosen by the tuner."""
        st = self.st
        combos = stage_knob_combos(st.plan, stage)
        best = st.stage_best(runs, stage)
        if len(combos) < 2 or best is None:
            return None
        base = base_knobs(st.plan, stage)
        base_line = [m for m in runs if m.params["stage"] == stage and knobs_of_params(m.params) == base and m.value is not None]
        at = self.micro_batch(base_line) if base_line else best.params["micro_batch"]
        untried = [p for k in combos if params_key(p := with_knobs(st.plan, stage, at, k)) not in taken]
        if not untried:
            return None
        knob_runs = [m for m in runs if m.params["stage"] == stage and knobs_of_params(m.params) != base]
        margin = st.margin(runs)
        if self._since_improvement([m for m in runs if m.params["stage"] == stage], base) >= st.s.early_stopping:
            st.note(f"z{stage}: early stop of the knob search after {st.s.early_stopping} experiments without improvement")
            return None
        if self._within_noise([m for m in runs if m.params["stage"] == stage and m.params["micro_batch"] == at and m.value is not None]):
            st.note(f"z{stage}: its knob combinations measured so far differ by no more than the noise: the knob search stops")
            return None
        leading = st.score(best.final_value) * (1 + margin) >= target
        first = not knob_runs and not self.pending(stage)
        promise = self._promise(untried, runs, best, len(knob_runs), leading, first)
        if promise <= target:
            st.note(f"z{stage}: no untried knob combination is predicted to beat the incumbent by more than the noise")
            return None
        history = [(m.params, m.final_value, m.result.status) for m in runs if m.result.status in ("ok", "oom")]
        choice = st.chooser.choose(untried, history, st.s.maximize, ledger.experiments)
        return Step(choice, f"z{stage}: knobs at micro-batch {at} ({st.chooser.last_choice})")

    def micro_batch(self, base_line: List[Measured]) -> int:
        """Where a stage's knobs are searched: the best size of its default-knob line. When other sizes
        of the line tie with it within the noise, one draw does not decide between them: the largest
        of the tied sizes if the line's next size above them is its top (a line that rose up to a fall
        at its memory edge peaks just below the fall), else their middle on a log scale (a peak inside
        the line lies amid the sizes that tie it)."""
        st = self.st
        top = max(base_line, key=lambda m: st.score(m.final_value))
        tied = sorted(m.params["micro_batch"] for m in base_line if m is top or st.tied(top, m))
        above = {m.params["micro_batch"] for m in base_line if m.params["micro_batch"] > tied[-1]}
        if len(above) <= 1:
            return tied[-1]
        middle = statistics.fmean(math.log(m) for m in tied)
        return min(tied, key=lambda m: (abs(math.log(m) - middle), -m))

    def pending(self, stage: int) -> bool:
        """Another worker is measuring a knob combination of the stage."""
        base = base_knobs(self.st.plan, stage)
        return any(p["stage"] == stage and knobs_of_params(p) != base for p in self.st.pending_params)

    def _since_improvement(self, stage_runs: List[Measured], base: Dict[str, Any]) -> int:
        """Knob experiments of the stage since its best last rose, as DeepSpeed counts for
        `tuner_early_stopping` (any rise: a rise within the noise may be the knob effect sought)."""
        best, since = None, 0
        for m in sorted(stage_runs, key=lambda m: m.trial_number):
            value = self.st.score(m.final_value)
            if value is not None and (best is None or value > best):
                best, since = value, 0
            elif knobs_of_params(m.params) != base:
                since += 1
        return since

    def _within_noise(self, here: List[Measured]) -> bool:
        """The stage's combinations measured at the knob micro-batch (the default knobs among them),
        KNOB_STARTUP + 1 or more, spread no more than their measurements' noise would alone: their
        variance is at most NOISE_SPREAD times the mean variance of one value (an interval is a 95%
        half-width, two standard deviations, narrowed by re-measurements). The knobs then move the
        metric by less than one measurement can tell, and a search among them chases lucky draws
        (gpu_flat: z1's six knob runs, true values all 0.982, read 0.957-1.008, each rise reopening
        the search). With several workers, on what is measured so far: a combination still in flight
        that spreads them reopens the search when it lands."""
        st = self.st
        if len(here) < KNOB_STARTUP + 1:
            return False
        values = [st.score(m.final_value) for m in here]
        noise = statistics.fmean((m.interval / 2 * v) ** 2 for m, v in zip(here, values))
        return statistics.variance(values) <= NOISE_SPREAD * noise

    def _promise(self, untried: List[Dict[str, Any]], runs: List[Measured], best: Measured, knob_runs: int, leading: bool, first: bool) -> float:
        """Optimistic value of the stage's untried knob combinations. Until the stage's first knob
        experiment the cost model has seen only other stages' knobs varied, which says little about
        this stage's: so a stage behind the lead gets one look (`first`: KNOB_LOOK above its best, as
        every stage gets one look along the micro-batch), and the stage tied for the lead, for its
        first KNOB_STARTUP knob experiments, a prior while some knob value has not been seen in any
        run; then the cost model's best prediction."""
        st = self.st
        if first and not leading:
            return st.score(best.final_value) * (1 + KNOB_LOOK)
        ok = [m for m in runs if m.value is not None]
        seen = {(k, repr(v)) for m in ok for k, v in knobs_of_params(m.params).items()}
        unseen = any((k, repr(v)) not in seen for p in untried for k, v in knobs_of_params(p).items())
        if leading and unseen and knob_runs < KNOB_STARTUP:
            return st.score(best.final_value) * (1 + KNOB_PRIOR)
        model = CostModel(seed=st.s.seed).fit([m.params for m in ok], [st.score(m.final_value) for m in ok])
        return float(max(model.predict(untried))) * (1 + MODEL_SLACK)  # the target has the noise margin already

    def joint_step(self, stage: int, runs: List[Measured], taken: set, target: float) -> Optional[Step]:
        """The stage's best knobs along the micro-batch, and those of any knob combination tied with
        them within the noise that leave room for a larger micro-batch: its own edge (knobs change
        memory) from its measured peak, and the default knobs' line as the prior."""
        st = self.st
        best = st.stage_best(runs, stage)
        base = base_knobs(st.plan, stage)
        if best is None:
            return None
        contenders = [m for m in runs if m.params["stage"] == stage and m.value is not None and knobs_of_params(m.params) != base
                      and (m is best or (st.tied(best, m) and self._more_room(m, best)))]
        for lead in self._best_per_knobs(contenders):
            step = self._knob_line_step(stage, lead, runs, taken, target)
            if step is not None:
                return step
        return None

    def _best_per_knobs(self, runs: List[Measured]) -> List[Measured]:
        """The best of the runs with each knob combination, best first."""
        leads: Dict[str, Measured] = {}
        for m in sorted(runs, key=lambda m: -self.st.score(m.final_value)):
            leads.setdefault(repr(knobs_of_params(m.params)), m)
        return list(leads.values())

    def _edge_from(self, m: Measured) -> Optional[int]:
        """The largest micro-batch the memory model allows from m's measured peak (knobs change memory)."""
        st = self.st
        peak = m.result.metrics.get("peak_memory_bytes")
        if st.memory is None or not st.memory.limit or not st.memory.per_sample or not peak:
            return None
        return m.params["micro_batch"] + int((st.memory.limit - peak) / st.memory.per_sample)

    def _more_room(self, m: Measured, best: Measured) -> bool:
        """m's knobs leave room for a larger micro-batch than the best's: a line of its own can go
        where the best's cannot. With the same room its line is the best's, scaled: nothing to learn."""
        a, b = self._edge_from(m), self._edge_from(best)
        if a is None or b is None:
            return False
        cap = self.st.cap or max(a, b)
        return min(a, cap) > min(b, cap) * (1 + 1 / EDGE_TOLERANCE)  # beyond the edge search's own tolerance

    def _knob_line(self, stage: int, lead: Measured, runs: List[Measured]) -> Tuple[List[Point], List[int], Optional[int]]:
        """The knob line of lead's knobs: its points, OOM sizes, and its edge search's next size."""
        lines = self.st.lines
        own, ooms, _ = lines.line(runs, stage, knobs_of_params(lead.params))
        predicted = self._edge_from(lead)
        return own, ooms, (lines.edge(own, ooms, stage, predicted) if predicted is not None else None)

    def _shape(self, stage: int, knobs: Dict[str, Any], runs: List[Measured]) -> Tuple[List[Point], Optional[int]]:
        """The stage's line shape for a knob line, and its edge: its default-knob line, completed
        beyond its own sizes by the stage's other knob lines already searched (two sizes or more,
        best first, stretched to its edge, scaled to it): where a tied knob set's line fell before its
        edge, the next one's is priced by that fall, not by the default line's rise."""
        st, lines = self.st, self.st.lines
        base = base_knobs(st.plan, stage)
        shape = lines.line(runs, stage, base)[0]
        base_edge = lines.stage_edge(stage, shape)
        for lead in self._best_per_knobs([m for m in runs if m.params["stage"] == stage and m.value is not None]):
            if repr(knobs_of_params(lead.params)) in (repr(base), repr(knobs)):
                continue
            own, _, edge = self._knob_line(stage, lead, runs)
            if len(own) >= 2:
                shape = shape + scaled_reference(shape, stretched(own, lines.line_edge(own, edge), base_edge), 1.0)
        return shape, base_edge

    def _knob_line_step(self, stage: int, lead: Measured, runs: List[Measured], taken: set, target: float) -> Optional[Step]:
        lines = self.st.lines
        knobs = knobs_of_params(lead.params)
        own, ooms, edge = self._knob_line(stage, lead, runs)
        shape, base_edge = self._shape(stage, knobs, runs)
        below, below_edge = lines.reference(runs, stage)
        reference = shape + scaled_reference(shape, stretched(below, below_edge, base_edge), 1.0)
        return lines.line_step(stage, knobs, own, ooms, stretched(reference, base_edge, lines.line_edge(own, edge)), edge, taken, target, 1.0)
