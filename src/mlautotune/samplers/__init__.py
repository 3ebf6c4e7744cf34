"""Samplers, one module per algorithm behind Optuna's BaseSampler (as in optuna/samplers/).

tuner_type -> sampler, each built for one stage's finite search space:
- model_based: ModelBasedSampler (XGBoost cost model; see model_based.py)
- gridsearch: Optuna's GridSampler (samplers/grid.py, for ask/tell). It visits every grid point once, in an order shuffled
  by its seed: stable and reproducible for a given search.seed.
- random: optuna.samplers.RandomSampler(seed)
- any other Optuna sampler by a Hydra `_target_` (search.sampler), e.g. optuna.samplers.TPESampler.
"""

import inspect
from typing import Any, Dict, List, Optional

from optuna.samplers import BaseSampler

from mlautotune.samplers.cost_model import CostModel
from mlautotune.samplers.model_based import ModelBasedSampler

__all__ = ["ModelBasedSampler", "CostModel", "build_sampler"]
DEFAULT_TARGETS = {
    "model_based": "mlautotune.samplers.ModelBasedSampler",
    "gridsearch": "mlautotune.samplers.grid.GridSampler",
    "random": "optuna.samplers.RandomSampler",
}


def build_sampler(tuner_type: str, search_space: Dict[str, List[Any]], seed: int, target: Optional[Dict[str, Any]] = None) -> BaseSampler:
    """Instantiate the tuner's sampler (conf/tuner/<tuner_type>.yaml, or search.sampler) for one stage's space."""
    from hydra.utils import get_class

    if target is None:
        if tuner_type not in DEFAULT_TARGETS:
            raise ValueError(f"unknown tuner_type {tuner_type!r}")
        target = {"_target_": DEFAULT_TARGETS[tuner_type]}
    cls = get_class(target["_target_"])
    kwargs = {k: v for k, v in target.items() if not k.startswith("_")}
    accepted = inspect.signature(cls.__init__).parameters
    if "search_space" in accepted:
        kwargs["search_space"] = search_space
    if "seed" in accepted:
        kwargs.setdefault("seed", seed)
    return cls(**kwargs)
