"""model_based: the untried candidate the XGBoost cost model expects to be best, among those its
feasibility model lets through.

Every finished experiment of the study (all stages) trains the regressor (the metric of ok runs)
and the feasibility classifier (ok against OOM). Where the candidates are knob combinations at one
stage and micro-batch (the knob step) and 3 or more combinations there are measured, knob effects
are taken to add up: each knob value's mean deviation over the measured combinations, shrunk
towards 0 by how few measured it, predicts every untried combination (the regressor breaks ties).
A knob effect smaller than the noise of one measurement is then estimated from every measurement
with that value, so the combination of the best values is tried even when no single run showed it.
Feasibility is a constraint: a candidate whose P(fits) is under one half is not chosen while
another remains. The first `n_startup` choices, and
every `explore_every`-th after them (the phase set by the seed), explore: a seeded pick among the
promising half (predicted at or above the median) weighted towards candidates far from everything
tried, so a mis-fitted model cannot circle one corner of the space, and different seeds explore
differently.
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from mlautotune.search.samplers.cost_model import CostModel, all_keys, encode
from mlautotune.search.samplers.choosers import Chooser, History

FEASIBLE = 0.5
MIN_MEASURED = 3  # measured knob combinations at the candidates' stage and micro-batch before knob effects are added up
TIE_BREAK = 1e-6  # the regressor's share of a score where knob effects decide
SLICE = ("stage", "micro_batch", "gas")


class ModelBasedSampler(Chooser):
    def __init__(self, seed: int = 0, n_startup: int = 1, explore_every: int = 4):
        super().__init__(seed)
        self.n_startup, self.explore_every = n_startup, explore_every

    def choose(self, untried: List[Dict[str, Any]], history: History, maximize: bool, n: int = 0) -> Dict[str, Any]:
        rng = np.random.RandomState((self.seed * 7919 + n) % 2**32)
        done = [(p, v) for p, v, status in history if v is not None]
        if len(done) < self.n_startup:
            self.last_choice = "startup"
            return untried[rng.randint(len(untried))]
        scores = self.scores(untried, history, maximize)
        if self.explore_every and (n + self.seed) % self.explore_every == 0:
            self.last_choice = "explore"
            promising = [c for c, s in zip(untried, scores) if s >= np.median(scores[np.isfinite(scores)])]
            return self._far(promising, [p for p, _, _ in history], rng)
        self.last_choice = "greedy"
        return untried[int(np.argmax(scores))]

    def scores(self, untried: List[Dict[str, Any]], history: History, maximize: bool) -> np.ndarray:
        """The predicted metric (negated when minimising); -inf where the feasibility model says it will not fit."""
        done = [(p, v) for p, v, _ in history if v is not None]
        model = CostModel(self.seed).fit([p for p, _ in done], [v if maximize else -v for _, v in done])
        predicted = model.predict(untried)
        labelled = [(p, v is not None) for p, v, status in history if v is not None or status == "oom"]
        model.fit_feasibility([p for p, _ in labelled], [ok for _, ok in labelled])
        additive = knob_effects(untried, done, maximize)
        if additive is not None:
            predicted = additive + TIE_BREAK * predicted
        fits = model.p_feasible(untried) >= FEASIBLE
        if not fits.any():
            return predicted
        return np.where(fits, predicted, -np.inf)

    def _far(self, candidates: List[Dict[str, Any]], tried: Sequence[Dict[str, Any]], rng: np.random.RandomState) -> Dict[str, Any]:
        """A seeded pick, with probability growing with the distance to the nearest tried point."""
        if not tried:
            return candidates[rng.randint(len(candidates))]
        keys = all_keys([candidates, tried])
        u, t = np.nan_to_num(encode(candidates, keys)), np.nan_to_num(encode(tried, keys))
        scale = np.maximum(np.concatenate([u, t]).std(axis=0), 1e-9)
        dist = np.min(np.linalg.norm((u[:, None, :] - t[None, :, :]) / scale, axis=2), axis=1)
        weights = dist**2 + 1e-9
        return candidates[rng.choice(len(candidates), p=weights / weights.sum())]


def knob_effects(untried: List[Dict[str, Any]], done: List[Tuple[Dict[str, Any], float]], maximize: bool) -> Optional[np.ndarray]:
    """Each untried combination's value as the mean of the measured ones at its stage and micro-batch
    plus the effect of each of its knob values (that value's mean deviation, times n / (n + 1) for n
    measurements with it); None unless the candidates share one stage, micro-batch and gas with at
    least MIN_MEASURED measured combinations."""
    def slice_of(p: Dict[str, Any]) -> tuple:
        return tuple(p.get(k) for k in SLICE)

    here = {slice_of(c) for c in untried}
    if len(here) != 1:
        return None
    at = here.pop()
    measured = [(p, v if maximize else -v) for p, v in done if slice_of(p) == at]
    if len(measured) < MIN_MEASURED:
        return None
    mean = float(np.mean([v for _, v in measured]))
    knobs = sorted({k for c in untried for k in c if k not in SLICE})
    effect = {}  # (knob, repr(value)) -> its shrunk mean deviation, once per value the candidates take
    for k in knobs:
        for value in {repr(c.get(k)) for c in untried}:
            with_it = [v for p, v in measured if repr(p.get(k)) == value]
            effect[k, value] = (float(np.mean(with_it)) - mean) * len(with_it) / (len(with_it) + 1) if with_it else 0.0
    return np.array([mean + sum(effect[k, repr(c.get(k))] for k in knobs) for c in untried])
