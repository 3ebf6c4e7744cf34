"""A step of the search: the configuration to measure next, why, and the measurement it repeats (if it does);
and what the search shares with the profiling step it asks (notes, the memory model, the score)."""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from mlautotune.search.ledger import Measured


@dataclass
class Step:
    params: Dict[str, Any]
    why: str
    repeat_of: Optional[Measured] = None


class StrategyBase:
    """Notes, the memory model and the score, which the search (search.py) shares with profiling.py;
    it sets `self.s` (its SearchSettings), `self.notes` and `self.profiling`."""

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def memory_model(self, runs: List[Measured]):
        return self.profiling.memory_model(runs)

    def score(self, value: Optional[float]) -> Optional[float]:
        """Higher is better whatever the metric."""
        if value is None:
            return None
        return value if self.s.maximize else 1.0 / max(value, 1e-12)
