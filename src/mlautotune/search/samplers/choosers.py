"""search.sampler: any Optuna sampler picks the next experiment among the untried configurations.

History is every finished experiment of the study as (params, value, status), value None unless ok.
Each choice is a function of the history, the seed and the experiment count `n`, so a resumed
session or a second worker makes the same choice from the same state.
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple

import optuna
from optuna.distributions import CategoricalDistribution

History = Sequence[Tuple[Dict[str, Any], Optional[float], str]]


class OptunaChooser:
    """It proposes in a scratch in-memory study holding the history over the candidates' space; a
    proposal that is not an untried candidate falls back to the first untried one."""

    def __init__(self, make_sampler, seed: int = 0):
        self.make_sampler, self.seed = make_sampler, seed

    def choose(self, untried: List[Dict[str, Any]], history: History, maximize: bool, n: int = 0) -> Dict[str, Any]:
        keys = sorted({k for p in untried for k in p})
        space = {k: CategoricalDistribution(sorted({p[k] for p in untried} | {p[k] for p, _, _ in history if k in p}, key=repr)) for k in keys}
        study = optuna.create_study(direction="maximize" if maximize else "minimize", sampler=self.make_sampler(n))
        for p, v, status in history:
            if set(p) == set(keys):
                state = optuna.trial.TrialState.COMPLETE if v is not None else optuna.trial.TrialState.FAIL
                study.add_trial(optuna.trial.create_trial(params=p, distributions=space, value=v, state=state))
        proposal = study.ask(space).params
        return proposal if proposal in untried else untried[0]
