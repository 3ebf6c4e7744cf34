"""The tuning plan: which stages, micro-batch sizes, gradient accumulation and ZeRO knob values to explore."""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple


@dataclass(frozen=True)
class MicroBatchRule:
    """How micro-batch sizes per GPU are chosen (README, "Configuring Train Micro-Batch Size").

    mode "min": values == (m,), tune upwards from m.   mode "list": values are the exact candidates.
    mode "fixed": values == (m,), m only.
    """

    mode: str
    values: Tuple[int, ...]


@dataclass
class TuningPlan:
    stages: List[int]
    # Per stage: zero_optimization knob -> candidate values, in the order to explore. A knob the
    # user fixed has a one-value list. "stage" itself is not a knob here.
    knobs: Dict[int, Dict[str, List[Any]]]
    micro_batch: MicroBatchRule
    gas: int
    max_train_batch_size: Optional[int]
    mp_size: int
    fast: bool
    base_config: Dict[str, Any]  # the user's ds_config: autotuning removed, "auto" resolved, tuned keys removed
    notices: List[str] = field(default_factory=list)  # one-line notices for the user (ignored keys, hints)
