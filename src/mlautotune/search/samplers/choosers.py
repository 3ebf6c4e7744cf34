"""Choosers: pick the next experiment among the untried candidates of one step of the search.

The strategy decides what is worth trying (search/strategy.py); the tuner type decides which of
those comes first. History is every finished experiment of the study as (params, value, status),
value None unless ok. Each choice is a function of the history, the seed and the experiment count
`n`, so a resumed session or a second worker makes the same choice from the same state.
"""

import random
from typing import Any, Dict, List, Optional, Sequence, Tuple

import optuna
from optuna.distributions import CategoricalDistribution

History = Sequence[Tuple[Dict[str, Any], Optional[float], str]]


class Chooser:
    def __init__(self, seed: int = 0):
        self.seed = seed
        self.last_choice: Optional[str] = None  # how the last choice was made, for tests and logs

    def choose(self, untried: List[Dict[str, Any]], history: History, maximize: bool, n: int = 0) -> Dict[str, Any]:
        raise NotImplementedError


class GridOrder(Chooser):
    """gridsearch: every candidate once, in an order shuffled by the seed."""

    def choose(self, untried, history, maximize, n=0):
        self.last_choice = "grid"
        return min(untried, key=lambda p: random.Random(f"{self.seed}:{sorted(p.items())}").random())


class RandomChoice(Chooser):
    """random: a seeded uniform pick."""

    def choose(self, untried, history, maximize, n=0):
        self.last_choice = "random"
        return untried[random.Random(self.seed * 1_000_003 + n).randrange(len(untried))]


class OptunaChooser(Chooser):
    """Any Optuna sampler (search.sampler={_target_: ...}): it proposes in a scratch in-memory study
    holding the history over the candidates' space; a proposal that is not an untried candidate
    falls back to the first untried one."""

    def __init__(self, make_sampler, seed: int = 0):
        super().__init__(seed)
        self.make_sampler = make_sampler

    def choose(self, untried, history, maximize, n=0):
        keys = sorted({k for p in untried for k in p})
        space = {k: CategoricalDistribution(sorted({p[k] for p in untried} | {p[k] for p, _, _ in history if k in p}, key=repr)) for k in keys}
        study = optuna.create_study(direction="maximize" if maximize else "minimize", sampler=self.make_sampler(n))
        for p, v, status in history:
            if set(p) == set(keys):
                state = optuna.trial.TrialState.COMPLETE if v is not None else optuna.trial.TrialState.FAIL
                study.add_trial(optuna.trial.create_trial(params=p, distributions=space, value=v, state=state))
        proposal = study.ask(space).params
        self.last_choice = "optuna"
        return proposal if proposal in untried else untried[0]
