"""The search's settings (filled from the session's config by session.search_settings)."""

from dataclasses import dataclass
from typing import Any, Dict, Optional


@dataclass
class SearchSettings:
    metric: str = "throughput"
    tuner_type: str = "model_based"
    seed: int = 0
    num_trials: int = 50
    stop_probability: float = 0.05  # conf: search.stop_probability (the stop rule)
    memory_limit_bytes: Optional[int] = None
    world_size: int = 1
    device: str = "cpu"
    host_memory_bytes: Optional[int] = None  # a node's RAM, for offload (None: this host's)
    local_ranks: int = 1  # ranks per node, for offload's host check
    sampler_target: Optional[Dict[str, Any]] = None
    alone: bool = True  # the only worker on the study: trials left RUNNING at start belong to a dead process
    poll_seconds: float = 5.0  # a worker with nothing to do waits this long for the others' pending trials

    @property
    def maximize(self) -> bool:
        return self.metric != "latency"
