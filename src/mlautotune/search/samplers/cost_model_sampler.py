"""The XGBoost cost model as an Optuna sampler, for the product's search (search.sampler) or a plain study.

    study = optuna.create_study(sampler=CostModelSampler(seed=0))

Over the study's categorical parameters (the intersection of its trials' spaces): after
`n_startup_trials` random trials, a bootstrap ensemble of XGBoost regressors on the completed
trials gives every untried point of the space a mean and a spread; the point with the largest
expected improvement over the best value, times its P(feasible) from the XGBoost classifier of
cost_model.py (failed trials are the infeasible ones), is proposed. Other parameters are sampled
at random.
"""

import itertools
from typing import Any, Dict, List, Optional

import numpy as np
import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.samplers import BaseSampler, RandomSampler
from optuna.search_space import intersection_search_space
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from mlautotune.search.samplers.cost_model import CostModel, all_keys, encode


class CostModelSampler(BaseSampler):
    def __init__(self, seed: Optional[int] = None, n_startup_trials: int = 5, n_models: int = 5, max_candidates: int = 4096):
        self.seed, self.n_startup_trials, self.n_models, self.max_candidates = seed, n_startup_trials, n_models, max_candidates
        self._rng = np.random.RandomState(seed)
        self._random = RandomSampler(seed=seed)

    def reseed_rng(self) -> None:
        self._rng = np.random.RandomState()
        self._random.reseed_rng()

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> Dict[str, BaseDistribution]:
        space = intersection_search_space(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL)))
        return {k: d for k, d in space.items() if isinstance(d, CategoricalDistribution)}

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial, search_space: Dict[str, BaseDistribution]) -> Dict[str, Any]:
        if not search_space:
            return {}
        done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if set(search_space) <= set(t.params)]
        if len(done) < self.n_startup_trials:
            return {}
        names = sorted(search_space)
        tried = {tuple(repr(t.params.get(n)) for n in names) for t in study.get_trials(deepcopy=False) if t.number != trial.number}
        untried = [dict(zip(names, c)) for c in self._points(search_space, names) if tuple(repr(v) for v in c) not in tried]
        if not untried:
            return {}
        sign = 1.0 if study.direction == StudyDirection.MAXIMIZE else -1.0
        params = [{n: t.params[n] for n in names} for t in done]
        y = sign * np.array([t.value for t in done], dtype=float)
        keys = all_keys([params, untried])
        mu, sd = self._ensemble(encode(params, keys), y, encode(untried, keys))
        ei = expected_improvement(mu, sd, float(y.max()))
        failed = [{n: t.params[n] for n in names} for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,)) if set(names) <= set(t.params)]
        feasible = CostModel(self.seed or 0).fit_feasibility(params + failed, [True] * len(params) + [False] * len(failed)).p_feasible(untried)
        return untried[int(np.argmax(ei * feasible))]

    def _points(self, space: Dict[str, BaseDistribution], names: List[str]) -> List[tuple]:
        choices = [space[n].choices for n in names]
        size = int(np.prod([len(c) for c in choices]))
        if size <= self.max_candidates:
            return list(itertools.product(*choices))
        return [tuple(c[self._rng.randint(len(c))] for c in choices) for _ in range(self.max_candidates)]

    def _ensemble(self, X: np.ndarray, y: np.ndarray, candidates: np.ndarray):
        import xgboost as xgb

        preds = []
        for b in range(self.n_models):
            rows = self._rng.randint(len(y), size=len(y))
            model = xgb.XGBRegressor(n_estimators=30, max_depth=3, learning_rate=0.3, nthread=1, random_state=b, verbosity=0)
            model.fit(X[rows], y[rows])
            preds.append(model.predict(candidates))
        preds = np.array(preds, dtype=float)
        return preds.mean(axis=0), preds.std(axis=0) + 1e-9 * (np.abs(y).max() + 1.0)

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution) -> Any:
        return self._random.sample_independent(study, trial, param_name, param_distribution)


def expected_improvement(mu: np.ndarray, sd: np.ndarray, best: float) -> np.ndarray:
    from scipy.stats import norm

    z = (mu - best) / sd
    return (mu - best) * norm.cdf(z) + sd * norm.pdf(z)
