"""The constrained space: every configuration the search may propose, for every sampler alike.

Per stage that can fit (profiling.py), every knob combination (the stage's tuned knobs, none in
fast mode) at every allowed micro-batch:
- rule "list": the user's sizes; rule "fixed": the one size;
- rule "min": a geometric ladder from the smallest size, eight sizes per doubling, plus each knob
  set's predicted memory edge (the throughput often peaks there);
- with max_train_batch_size the global batch is at most that: the ladder and the edges too, and
  the sizes that fill it best (mbs x gas x data-parallel ranks, the largest micro-batch at each
  gas: TuningPlan.fills_batch); near the memory edge the peak is often a size that fills it less.
Always at most the micro-batch cap, and only where the memory model gives the configuration a
chance to fit (P(fits) of at least MIN_P_FIT). The memory savers (savers.py) add their
configurations where the memory model says they let a larger micro-batch fit.

The ladder's steps are 9% apart, and the best size often lies between two of them. Around each
configuration in `around` (the search passes its incumbent and a warm start's earlier optimum),
every line (knob set) of its stage also gets its size and the sizes between its neighbours on the
ladder, FINE apart (or one): the peak's size is often the same for knob sets that differ little, and
the incumbent's knob set is not always the best one. The model values them like any other, so a
size between is run only where the model expects it to pay.
"""

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

from mlautotune.inputs.space import TuningPlan
from mlautotune.search import savers
from mlautotune.search.candidates import stage_knob_combos, with_knobs
from mlautotune.search.fits import FitModel

MIN_P_FIT = 0.02
PER_DOUBLING = 8  # not 4: 94% of seeds 0-199 reach 99%, not 91%; held out 92% either way (benchmarks/generator.md)
FINE = 0.01  # around the incumbent, sizes this far apart (relative), or one


def ladder(low: int, cap: int) -> List[int]:
    sizes, k = [], 0
    while True:
        m = int(round(low * 2 ** (k / PER_DOUBLING)))
        if m > cap:
            return sorted(set(sizes))
        sizes.append(m)
        k += 1


def sizes(plan: TuningPlan) -> List[int]:
    cap, rule = plan.micro_batch_cap, plan.micro_batch
    if rule.mode == "fixed":
        return [rule.values[0]]
    if rule.mode == "list":
        return sorted(v for v in set(rule.values) if v <= cap)
    low = rule.values[0]
    if plan.max_train_batch_size:  # the ladder too: near the memory edge the peak is often a size that fills the batch less
        return sorted(set(ladder(low, cap)) | {m for m in range(low, cap + 1) if plan.fills_batch(m)})
    return ladder(low, cap)


def between(here: List[int], mbs: int) -> List[int]:
    """The sizes strictly between mbs's neighbours in `here`, each the smallest at least FINE (and one) above the last."""
    lower = max((m for m in here if m < mbs), default=mbs)
    upper = min((m for m in here if m > mbs), default=mbs)
    out, m = [], lower
    while True:
        m = max(m + 1, math.ceil(m * (1 + FINE)))
        if m >= upper:
            return out
        out.append(m)


def candidates(plan: TuningPlan, stages: List[int], fit: FitModel, notes: Optional[List[str]] = None,
               around: Sequence[Dict[str, Any]] = ()) -> List[Tuple[Dict[str, Any], float]]:
    """Every configuration of the space, with its P(fits); the sizes between the ladder's around the
    configurations `around`; and the memory savers' where they let a larger micro-batch fit (savers.py)."""
    allowed = sizes(plan)
    free = plan.micro_batch.mode == "min"
    refine: Dict[int, List[int]] = {}  # stage -> the sizes to refine around, on each of its lines
    for p in around if free else ():
        refine.setdefault(p["stage"], []).append(p["micro_batch"])
    out = []
    for stage in stages:
        for knobs in stage_knob_combos(plan, stage):
            first = with_knobs(plan, stage, allowed[0], knobs)
            here = set(allowed)
            edge = fit.edge(first) if free else None
            if edge is not None and allowed[0] <= int(edge) <= plan.micro_batch_cap:
                here.add(int(edge))
            here = sorted(here)
            fine = {m for mbs in refine.get(stage, []) for m in [mbs, *between(here, mbs)] if allowed[0] <= m <= plan.micro_batch_cap}
            here = sorted(set(here) | fine)
            out += [(with_knobs(plan, stage, mbs, knobs), p) for mbs, p in zip(here, fit.p_fits(first, here)) if p >= MIN_P_FIT]
    return out + [(p, q) for p, q in savers.candidates(plan, fit, allowed, notes) if q >= MIN_P_FIT]

