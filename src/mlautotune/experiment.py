"""Run one experiment through the DeepSpeed launcher and measure it. The only module that starts processes."""

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

STATUSES = ("ok", "oom", "timeout", "failed", "incomplete")


@dataclass
class Resources:
    num_gpus: Optional[int] = None
    num_nodes: Optional[int] = None
    hostfile: Optional[str] = None
    include: Optional[str] = None
    exclude: Optional[str] = None
    master_port: int = 29500
    launcher: str = "pdsh"
    launcher_args: List[str] = field(default_factory=list)


@dataclass
class Experiment:
    name: str  # z{stage}_gas{gas}_tmbspg{mbs}[_<knob codes>]
    ds_config: Dict[str, Any]  # complete, concrete, no autotuning section
    script: str
    script_args: List[str]
    resources: Resources
    params: Dict[str, Any]  # the tuned values: stage, micro_batch, gas and every tuned knob (flat)
    arg_mappings: Dict[str, str] = field(default_factory=dict)
    start_profile_step: int = 3
    end_profile_step: int = 5
    memory_limit_bytes: Optional[int] = None
    timeout_s: float = 900.0


@dataclass
class Result:
    name: str
    status: str  # one of STATUSES
    metrics: Dict[str, Any] = field(default_factory=dict)  # metrics.json content (ok), else what was measured
    reason: str = ""  # empty for ok; the error's last lines or what happened otherwise
    wall_time_s: float = 0.0
    exp_dir: str = ""
    returncode: Optional[int] = None

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Result":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})
