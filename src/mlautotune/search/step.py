"""A step of the search: the configuration to measure next, why, and the measurement it repeats (if it does)."""

from dataclasses import dataclass
from typing import Any, Dict, Optional

from mlautotune.search.ledger import Measured


@dataclass
class Step:
    params: Dict[str, Any]
    why: str
    repeat_of: Optional[Measured] = None
