"""Step 2, the micro-batch of each stage (default knobs), and the line search that steps 4 reuses.

A line is a stage with fixed knobs along the micro-batch. Every stage but the first gets one look,
placed by the line of the stage below it (where none below ran, the stage above) stretched to its
own memory edge (pressed into a smaller edge, its fall moves and its rise does not); that run
scales the prior, and the stage goes on only where the scaled line can still win. The stage that
leads by more than the noise searches its own line above its sizes, memory edge first (on a CPU
host no probe goes above CPU_EDGE_STEP times the largest run so far);
below them the line below still prices it, having measured the rise there (and its fall, where it
peaked inside). Above a size that ties its best, the leader leaves no stretch over COVER times wide
unmeasured: there the line's bound rests on the slope between two sizes near its top, which one
noisy draw turns into a fall. With several workers a line (default knobs, or a knob set's own line
in step 4) takes at most LINE_IN_FLIGHT sizes at once: a third probe would split stretches the first
two already split, and the worker does more for the search on another line or on the stage's knobs
at its best size so far, whose results teach the cost model the knobs' effects before the line
ends. The pure search along one line is microbatch.py.
"""

import math
from typing import Any, Dict, List, Optional, Tuple

from mlautotune.search.candidates import base_knobs, knobs_of_params, params_key, with_knobs
from mlautotune.search.ledger import Measured
from mlautotune.search.microbatch import Point, concave_bound, edge_probe, peak_probe, scaled_reference, sizes_between, stretched
from mlautotune.search.step import Step

CPU_EDGE_STEP = 8  # on a CPU host no probe goes above this many times the largest micro-batch run so far
COVER = 2.0  # above a size that ties its best, the leading line leaves no stretch wider than this ratio unmeasured
LINE_IN_FLIGHT = 2  # sizes of one line measured at once (several workers); the next worker goes elsewhere
UNSEEN_STAGE = 10.0  # a stage not measured yet may be this much faster at the same micro-batch: every stage gets one look
# a stage's only look on a tight budget leaves this fraction of the memory limit free: until the stage
# runs, its fixed part is another stage's, and ZeRO's buffers differ by stage (the README's first
# command on a CPU host: ZeRO-3's peak 6-10% of the 1 GiB limit above ZeRO-0's at the same size, so
# looks placed at the edge ran out of memory and left stages unreported)
ONLY_LOOK_HEADROOM = 0.10


class Lines:
    def __init__(self, strategy):
        self.st = strategy

    def line(self, runs: List[Measured], stage: int, knobs: Dict[str, Any]) -> Tuple[List[Point], List[int], List[int]]:
        """The line's measured (micro-batch, score) points, its OOM sizes, and every size it ran."""
        same = [m for m in runs if m.params["stage"] == stage and knobs_of_params(m.params) == knobs]
        own = [(m.params["micro_batch"], self.st.score(m.final_value)) for m in same if m.value is not None]
        ooms = [m.params["micro_batch"] for m in same if m.result.status == "oom"]
        return own, ooms, [m.params["micro_batch"] for m in same]

    def _taken_sizes(self, stage: int, knobs: Dict[str, Any], taken: set, sizes: List[int]) -> set:
        return {m for m in sizes if params_key(with_knobs(self.st.plan, stage, m, knobs)) in taken}

    def _candidates(self, stage: int, high: int) -> List[int]:
        st = self.st
        rule = st.plan.micro_batch
        if rule.mode == "fixed":
            return list(rule.values)
        if rule.mode == "list":
            return sizes_between(st.low, min(high, st.cap or high), [m for m in rule.values if st.memory is None or st.memory.fits(stage, m)])
        sizes = sizes_between(st.low, min(high, st.cap or high))
        # gradient accumulation fills max_train_batch_size: each accumulation's largest size, and the line's top
        return [m for m in sizes if st.plan.fills_batch(m) or m == max(sizes)]

    def reference(self, runs: List[Measured], stage: int, above: bool = True) -> Tuple[List[Point], Optional[int]]:
        """The best line of the nearest lower stage that ran, completed where it has no points of
        its own by the line below it, scaled, if that makes two points or more; and its memory edge.
        When no stage below ran (the lowest stage, or those below it ran out of memory or were
        skipped), the best line of the nearest stage above that ran (`above`): a stage that fits only
        a few samples (z2 of a model that only z3 holds well) is priced by that line's rise,
        stretched to its own edge, and not searched down to micro-batch 1 on its own."""
        for lower in sorted((s for s in self.st.plan.stages if s < stage), reverse=True):
            own = self._best_line(runs, lower)
            if own is None:
                continue
            below, below_edge = self.reference(runs, lower, above=False)
            completion = scaled_reference(own, stretched(below, below_edge, self.stage_edge(lower, own)), 1.0)
            # where the stage's own points bound its line (concave), the completion stays under them
            line = own + [(m, min(v, concave_bound(own, m))) for m, v in completion]
            if len(line) >= 2:  # one point has no shape: flat from it, it would cap a rising line at its level
                return line, self.stage_edge(lower, own)
        for higher in sorted(s for s in self.st.plan.stages if s > stage) if above else []:
            own = self._best_line(runs, higher)
            if own is not None:
                return own, self.stage_edge(higher, own)
        return [], None

    def _best_line(self, runs: List[Measured], stage: int) -> Optional[List[Point]]:
        """The measured points of the stage's line with its best run's knobs, None if it has no run."""
        b = self.st.stage_best(runs, stage)
        return self.line(runs, stage, knobs_of_params(b.params))[0] if b is not None else None

    def stage_edge(self, stage: int, own: List[Point]) -> Optional[int]:
        st = self.st
        if st.plan.micro_batch.mode != "min":
            return None
        if st.memory is not None and st.memory.grows():
            return st.memory.max_micro_batch(stage, cap=st.cap) or None
        return max((m for m, _ in own), default=None)

    def edge(self, own: List[Point], ooms: List[int], stage: int, predicted: Optional[int] = None, headroom: float = 0.0) -> Optional[int]:
        st = self.st
        if st.plan.micro_batch.mode != "min":
            return None
        if predicted is None and st.memory is not None and st.memory.grows():
            predicted = st.memory.max_micro_batch(stage, cap=st.cap, headroom=headroom)
        return edge_probe([m for m, _ in own], ooms, st.low, st.cap, predicted, chunky=st.s.device == "cpu")

    def step(self, stage: int, runs: List[Measured], taken: set, target: float, only_look: bool = False) -> Optional[Step]:
        """The next size of the stage's default-knob line, or None when nothing on it can beat `target`.
        `only_look`: the stage's one look on a tight budget, kept ONLY_LOOK_HEADROOM under the limit
        (the line below is still stretched to the stage's edge: the look is capped, not moved)."""
        knobs = base_knobs(self.st.plan, stage)
        own, ooms, _ = self.line(runs, stage, knobs)
        edge = self.edge(own, ooms, stage)
        top = self.edge(own, ooms, stage, headroom=ONLY_LOOK_HEADROOM) if only_look else edge
        # the stage that leads by more than the noise gets a search of its own above its sizes; below
        # them, and everywhere for the others, the line below prices it
        leads = self._leads(runs, stage, target)
        reference, ref_edge = self.reference(runs, stage)
        if (leads or not reference) and self.st.plan.micro_batch.mode == "list":
            target = -math.inf  # sizes the user listed are all measured in the stage searched on its own
        # the stage below is scaled at each size by this line's ratio to it at its nearest point
        # (`by_size`): two stages' ratio moves along the micro-batch (costs per step, each one's memory
        # pressure), so a ratio at micro-batch 1 (a profiling run) does not price the stretch around a
        # peak at 12 when the line has a point at 20
        return self.line_step(stage, knobs, own, ooms, stretched(reference, ref_edge, self.line_edge(own, edge), keep_rise=True), top, taken, target, UNSEEN_STAGE,
                              reference_above=not leads, by_size=True, cover=COVER if leads else None, noise=self.st.margin(runs))

    def _leads(self, runs: List[Measured], stage: int, target: float) -> bool:
        """The stage's default-knob line holds the incumbent, and no other stage's best is within the
        noise of it. A stage that leads by its knobs has that knob line refined (knobs.py, step 4),
        with this line as the prior: this one is then priced by the line below it."""
        st = self.st
        mine = st.best([m for m in runs if m.params["stage"] == stage and knobs_of_params(m.params) == base_knobs(st.plan, stage)])
        if mine is None or mine is not st.best(runs):
            return False
        lead = st.score(mine.final_value)
        others = [st.score(b.final_value) for s in st.plan.stages if s != stage and (b := st.stage_best(runs, s)) is not None]
        return all(v * target / lead < lead for v in others)

    @staticmethod
    def line_edge(own: List[Point], edge: Optional[int]) -> Optional[int]:
        """The line's memory edge: the edge search's next size, or its largest run once that is known."""
        return edge if edge is not None else max((m for m, _ in own), default=None)

    def _reach(self) -> Optional[int]:
        """On a CPU host, the largest micro-batch a probe may try: CPU_EDGE_STEP times the largest run
        so far. Host memory puts the edge hundreds of times above the sizes measured, a step there
        takes as many times longer (minutes per experiment), and a CPU's throughput stops rising long
        before it. The line is still priced up to its edge."""
        largest = self.st.largest_run
        return largest * CPU_EDGE_STEP if self.st.s.device == "cpu" and largest is not None else None

    def _hedge(self, stage: int, own: List[Point], ooms: List[int], pending: set, free: List[int]) -> Optional[int]:
        """On a CPU host, while another worker probes the line above its sizes, the size the edge
        search takes next should that probe run out of memory. A CPU rank's memory grows in allocator
        chunks, so an edge probe there often does: the next worker hedges the probe rather than
        bisect the stretch below it (cpu_gpt-4M_fast, 4 workers: 99% at the 7th experiment, not the
        11th). On a GPU the memory model places the edge well, and a hedge nearly duplicates the
        probe (10b and knob landscapes: slower to 99% with it)."""
        top = max((m for m, _ in own), default=0)
        probe = max((p for p in pending if p > top), default=None)
        if self.st.s.device != "cpu" or probe is None:
            return None
        size = self.edge(own, list(ooms) + [probe], stage)  # above `top` by the edge search's rule
        return size if size in free else None  # free: not measured, and not pending with another worker

    def line_step(self, stage, knobs, own, ooms, reference, edge, taken, target, prior_ratio, reference_above=True, by_size=False,
                  cover=None, noise=0.0) -> Optional[Step]:
        """The line's next size by the peak search (microbatch.peak_probe), its edge search included."""
        st = self.st
        pending = {p["micro_batch"] for p in st.pending_params if p["stage"] == stage and knobs_of_params(p) == knobs}
        if own and len(pending) >= LINE_IN_FLIGHT:
            return None  # the next worker goes to another line, or to the knobs
        high = max([m for m, _ in own] + [edge or 0, st.low] + (list(st.plan.micro_batch.values) if st.plan.micro_batch.mode != "min" else []))
        if ooms:
            high = min(high, min(ooms) - 1)
        candidates = self._candidates(stage, high)
        taken_sizes = self._taken_sizes(stage, knobs, taken, candidates) | set(ooms)
        hedge = self._hedge(stage, own, ooms, pending, [m for m in candidates if m not in taken_sizes])
        if hedge is not None:
            return Step(with_knobs(st.plan, stage, hedge, knobs), f"z{stage}: micro-batch {hedge}, the edge if {max(pending)} runs out of memory")
        mbs, bound = peak_probe(own, reference, candidates, taken_sizes, target, prior_ratio, high_probe=edge, rate=st.s.metric != "latency",
                                pending=pending, reach=self._reach(), reference_above=reference_above, by_size=by_size, cover=cover,
                                noise=noise)
        if mbs is None:
            return None
        why = f"may reach {bound:.4g}" if bound > target else f"in a stretch over {cover:g}x wide above a size that ties the line's best"
        return Step(with_knobs(st.plan, stage, mbs, knobs), f"z{stage}: micro-batch {mbs} {why}")
