"""Choosers, one per tuner type (see choosers.py):

- model_based: ModelBasedSampler (XGBoost cost model with feasibility; model_based.py)
- gridsearch: every candidate once, in an order shuffled by the seed
- random: a seeded uniform pick
- any Optuna sampler by a Hydra `_target_` (search.sampler), e.g. optuna.samplers.TPESampler.

With search.strategy=v3, model_based is the search's own model and acquisition (search/v3.py);
gridsearch and random are Optuna's GridSampler and RandomSampler over the constrained space
(baselines.py); CostModelSampler (cost_model_sampler.py) is the XGBoost cost model as an
optuna.samplers.BaseSampler, for search.sampler or a plain Optuna study.
"""

import inspect
from typing import Any, Dict, Optional

from mlautotune.search.samplers.choosers import Chooser, GridOrder, OptunaChooser, RandomChoice
from mlautotune.search.samplers.cost_model import CostModel
from mlautotune.search.samplers.cost_model_sampler import CostModelSampler
from mlautotune.search.samplers.model_based import ModelBasedSampler

__all__ = ["ModelBasedSampler", "CostModel", "CostModelSampler", "Chooser", "make_chooser"]
BUILT_IN = {
    "mlautotune.search.samplers.ModelBasedSampler": ModelBasedSampler,
    "mlautotune.search.samplers.choosers.GridOrder": GridOrder,
    "mlautotune.search.samplers.choosers.RandomChoice": RandomChoice,
}
BY_TUNER = {"model_based": ModelBasedSampler, "gridsearch": GridOrder, "random": RandomChoice}


def make_chooser(tuner_type: str, seed: int, target: Optional[Dict[str, Any]] = None) -> Chooser:
    """The tuner's chooser (conf/tuner/<tuner_type>.yaml, or search.sampler for another Optuna sampler)."""
    if target is None or target.get("_target_") in BUILT_IN:
        cls = BUILT_IN[target["_target_"]] if target else BY_TUNER.get(tuner_type)
        if cls is None:
            raise ValueError(f"unknown tuner_type {tuner_type!r}")
        kwargs = {k: v for k, v in (target or {}).items() if not k.startswith("_") and k != "seed"}
        return cls(seed=seed, **kwargs)
    from hydra.utils import get_class

    cls = get_class(target["_target_"])
    kwargs = {k: v for k, v in target.items() if not k.startswith("_") and k != "seed"}
    takes_seed = "seed" in inspect.signature(cls.__init__).parameters
    return OptunaChooser(lambda n: cls(**kwargs, **({"seed": seed * 1_000_003 + n} if takes_seed else {})), seed)
