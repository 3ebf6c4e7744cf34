"""Samplers beside the search's own model (search/search.py):

- gridsearch / random: Optuna's GridSampler and RandomSampler over the constrained space (baselines.py);
- search.sampler: any other Optuna sampler by a Hydra `_target_`, e.g. optuna.samplers.TPESampler (choosers.py);
- CostModelSampler (cost_model_sampler.py): an XGBoost cost model with feasibility as an
  optuna.samplers.BaseSampler, for search.sampler or a plain Optuna study.
"""

import inspect
from typing import Any, Dict

from mlautotune.search.samplers.choosers import OptunaChooser
from mlautotune.search.samplers.cost_model import CostModel
from mlautotune.search.samplers.cost_model_sampler import CostModelSampler

__all__ = ["CostModel", "CostModelSampler", "OptunaChooser", "make_chooser"]


def make_chooser(seed: int, target: Dict[str, Any]) -> OptunaChooser:
    """The chooser of search.sampler (`_target_`: an Optuna sampler class, then its arguments)."""
    from hydra.utils import get_class

    cls = get_class(target["_target_"])
    kwargs = {k: v for k, v in target.items() if not k.startswith("_") and k != "seed"}
    takes_seed = "seed" in inspect.signature(cls.__init__).parameters
    return OptunaChooser(lambda n: cls(**kwargs, **({"seed": seed * 1_000_003 + n} if takes_seed else {})), seed)
