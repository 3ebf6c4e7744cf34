"""ModelBasedSampler: an Optuna sampler that ranks the untried candidates of a finite space with
an XGBoost cost model fitted on every finished trial of the study.

Exploration rule: every `explore_every`-th proposal (after the start-up ones) takes, among the
promising untried candidates (expected score at or above the median), the one farthest in the
encoded feature space from everything tried so far, instead of the greedy best. That keeps a
mis-fitted model from circling one corner of the space without spending experiments on candidates
it already knows are poor (the smallest micro-batch, say).
"""

from typing import Any, Dict, List, Optional

import numpy as np
import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.samplers import BaseSampler
from optuna.trial import FrozenTrial, TrialState

from mlautotune.samplers.cost_model import CostModel, all_keys, encode


class ModelBasedSampler(BaseSampler):
    def __init__(self, search_space: Dict[str, List[Any]], seed: int = 0, n_startup: int = 2, explore_every: int = 4):
        self.space = {k: list(v) for k, v in search_space.items()}
        self.seed = seed
        self.n_startup = n_startup
        self.explore_every = explore_every
        self._rng = np.random.RandomState(seed)
        self._proposals = 0
        self.last_choice: Optional[str] = None  # "startup" | "greedy" | "explore", for tests and logs

    def candidates(self) -> List[Dict[str, Any]]:
        combos: List[Dict[str, Any]] = [{}]
        for k, values in self.space.items():
            combos = [{**c, k: v} for c in combos for v in values]
        return combos

    def infer_relative_search_space(self, study, trial) -> Dict[str, BaseDistribution]:
        return {k: CategoricalDistribution(v) for k, v in self.space.items()}

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial, search_space: Dict[str, BaseDistribution]) -> Dict[str, Any]:
        finished = [t for t in study.get_trials(deepcopy=False) if t.state.is_finished()]
        tried = {_key(_params(t)) for t in finished}
        untried = [c for c in self.candidates() if _key(_plain(c)) not in tried]
        if not untried:
            return {}
        self._proposals += 1
        plain = [_plain(c) for c in untried]
        choice = self.choose(plain, finished, study.direction == optuna.study.StudyDirection.MAXIMIZE)
        return untried[plain.index(choice)]

    def choose(self, untried: List[Dict[str, Any]], finished: List[FrozenTrial], maximize: bool) -> Dict[str, Any]:
        done = [t for t in finished if t.state == TrialState.COMPLETE]
        if len(done) < self.n_startup:
            self.last_choice = "startup"
            return untried[[0, len(untried) - 1, len(untried) // 2][len(finished) % 3]]
        scores = self.scores(untried, finished, maximize)
        if self.explore_every and self._proposals % self.explore_every == 0:
            self.last_choice = "explore"
            promising = [c for c, score in zip(untried, scores) if score >= np.median(scores)]
            return self._farthest(promising, [_params(t) for t in finished])
        self.last_choice = "greedy"
        return untried[int(np.argmax(scores))]

    def scores(self, untried: List[Dict[str, Any]], finished: List[FrozenTrial], maximize: bool) -> np.ndarray:
        """Expected value: the predicted metric (sign-flipped when minimising) weighted by P(feasible)."""
        done = [t for t in finished if t.state == TrialState.COMPLETE]
        model = CostModel(self.seed).fit([_params(t) for t in done], [t.value for t in done])
        predicted = model.predict(untried)
        labelled = [t for t in finished if t.state == TrialState.COMPLETE or t.user_attrs.get("status") == "oom"]
        model.fit_feasibility([_params(t) for t in labelled], [t.state == TrialState.COMPLETE for t in labelled])
        p_ok = model.p_feasible(untried)
        if maximize:
            return predicted * p_ok
        worst = max(t.value for t in done)
        return -(p_ok * predicted + (1 - p_ok) * worst * 10)

    def _farthest(self, untried: List[Dict[str, Any]], tried: List[Dict[str, Any]]) -> Dict[str, Any]:
        keys = all_keys([untried, tried])
        u, t = np.nan_to_num(encode(untried, keys)), np.nan_to_num(encode(tried, keys))
        scale = np.maximum(np.concatenate([u, t]).std(axis=0), 1e-9)
        dist = np.min(np.linalg.norm((u[:, None, :] - t[None, :, :]) / scale, axis=2), axis=1)
        return untried[int(np.argmax(dist))]

    def sample_independent(self, study, trial, param_name: str, param_distribution: BaseDistribution) -> Any:
        choices = param_distribution.choices
        return choices[self._rng.randint(len(choices))]


def _key(params: Dict[str, Any]) -> tuple:
    return tuple(sorted((k, str(v)) for k, v in params.items()))


def _plain(params: Dict[str, Any]) -> Dict[str, Any]:
    """Param names without a stage qualifier (`z1/micro_batch` -> `micro_batch`)."""
    return {k.split("/")[-1]: v for k, v in params.items()}


def _params(t: FrozenTrial) -> Dict[str, Any]:
    """A finished trial's plain params: mlautotune keeps them in user_attrs["params"]."""
    return dict(t.user_attrs.get("params") or _plain(t.params))
