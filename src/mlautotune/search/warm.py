"""Warm start: what earlier sessions of the same model measured, as the search's prior.

`Earlier` is what search/earlier.py finds in the study storage (or the MLflow store): the earlier
sessions' experiments, and whether they ran on the same hardware (accelerator, device memory, world
size and memory limit per rank) as this session.

How the search uses it (search.py):
- Same hardware: the earlier runs' memory facts (peaks, OOMs, model info) are this session's too, so
  no profiling is needed; the first experiment re-measures the earlier optimum.
- Other hardware: profiling runs as in a cold session; the earlier memory facts are not used.
- Either way the earlier throughputs enter the throughput model as observations of the same
  landscape, offset by one factor and each blurred by an extra spread, both learnt from the
  configurations measured in both sessions (`Warm.offset`). They are never taken as the truth: an
  earlier value counts as a measurement with spread TAU_SAME (same hardware) or TAU_OTHER (other)
  until pairs show how close the two sessions are. What the search then measures is what the
  acquisition values most: the earlier near-ties while their intervals overlap, untried
  configurations where the earlier session left doubt. The stop rule ends it as in a cold session.
- The first new run that reports a parameter count other than the earlier sessions' drops the warm
  start: it is another model.
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from mlautotune.search.ledger import Measured

TAU_SAME = 0.05  # prior spread (log units) of an earlier value against today's, same hardware
TAU_OTHER = 0.25  # ... other hardware or world size
PRIOR_PAIRS = 2.0  # the prior spread weighs as much as this many pairs


@dataclass
class Earlier:
    """Earlier sessions of the same model (matched by fingerprint)."""

    sessions: List[str]  # their names, newest first
    runs: List[Measured]  # their experiments; trial_number < 0, so they never collide with this study's
    same_hardware: bool
    num_params: Optional[int] = None  # the model's parameter count, when an earlier run reported it
    about: Dict[str, str] = field(default_factory=dict)  # session name -> a few words (when, experiments, optimum)
