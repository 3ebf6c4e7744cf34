"""gridsearch and random: Optuna's own GridSampler and RandomSampler over the constrained space.

Each configuration of the space (search/constrained.py) is one choice of a categorical
`candidate` (its params as a key), chosen in a scratch in-memory study: grid, the first point
of GridSampler's seeded order over the untried configurations; random, RandomSampler's pick among the
untried ones, seeded by the seed and the experiment count. Both are functions of the ledger and
the seed: a resumed session or a second worker makes the same choice from the same state.
"""

from typing import List

import optuna
from optuna.distributions import CategoricalDistribution


def grid_pick(untried: List[str], seed: int) -> str:
    """The first point of GridSampler's seeded order over the untried part of the space."""
    grid = sorted(untried)
    study = optuna.create_study(sampler=optuna.samplers.GridSampler({"candidate": grid}, seed=seed))
    return study.ask({"candidate": CategoricalDistribution(grid)}).params["candidate"]


def random_pick(untried: List[str], seed: int, n: int) -> str:
    """RandomSampler's pick among the untried configurations (seeded by the seed and the count)."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed * 1_000_003 + n))
    return study.ask({"candidate": CategoricalDistribution(sorted(untried))}).params["candidate"]
