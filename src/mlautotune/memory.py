"""Per-stage memory model: a formula for the model states, a line fitted to measured peaks for the rest.

peak(stage, mbs) = fixed + model_states(stage) + per_sample * mbs

model_states follows ZeRO: bytes per parameter by precision and optimizer, partitioned over the
data-parallel degree (world_size // mp_size), with offloaded parts removed. `fixed` (runtime,
buffers, framework) and `per_sample` (activations) are fitted by least squares to the peaks that
experiments measure, and refitted as every result comes in. An OOM is a hard bound: no micro-batch
at or above it is predicted to fit, in that stage or in any stage with more memory per rank.
"""

from typing import Any, Dict, List, Optional

import numpy as np

OPTIMIZER_BYTES = {"adam": 8, "adamw": 8, "fusedadam": 8, "cpuadam": 8, "onebitadam": 8, "zerooneadam": 8, "onebitlamb": 8, "lamb": 8, "adagrad": 4}
PRIOR_PER_SAMPLE_FRACTION = 0.02  # before two micro-batch sizes are measured: 2% of the fixed part per sample
MAX_MICRO_BATCH = 1 << 16


class MemoryModel:
    def __init__(self, num_params: int, trainable_params: int, ds_config: Dict[str, Any], world_size: int, mp_size: int, limit_bytes: Optional[int], device: str):
        self.num_params, self.trainable_params = num_params, trainable_params
        self.mp = max(1, mp_size)
        self.dp = max(1, world_size // self.mp)
        self.limit = limit_bytes
        self.device = device
        self.half = any(isinstance(ds_config.get(k), dict) and ds_config[k].get("enabled") for k in ("fp16", "bf16"))
        self.optimizer_bytes = optimizer_bytes(ds_config.get("optimizer"))
        zero = ds_config.get("zero_optimization") or {}
        on_host = device == "cpu"  # with the CPU accelerator, host memory is device memory: offload frees nothing
        self.offload_optimizer = not on_host and (zero.get("offload_optimizer") or {}).get("device") in ("cpu", "nvme")
        self.offload_param = not on_host and (zero.get("offload_param") or {}).get("device") in ("cpu", "nvme")
        self.points: List[tuple] = []  # (stage, mbs, peak, oom)
        self.oom_at: Dict[int, int] = {}  # stage -> smallest micro-batch seen to OOM
        self.fixed: Optional[float] = None
        self.per_sample: Optional[float] = None
        self._errors: List[Dict[str, Any]] = []

    def model_states(self, stage: int) -> float:
        """Bytes per rank for parameters, gradients, fp32 master copy and optimizer states."""
        p, t = self.num_params / self.mp, self.trainable_params / self.mp
        params = p * (2 if self.half else 4)
        grads = t * (2 if self.half else 4)
        master = t * 4 if self.half else 0.0
        optim = t * self.optimizer_bytes
        if stage >= 1:
            optim, master = optim / self.dp, master / self.dp
        if stage >= 2:
            grads /= self.dp
        if stage >= 3:
            params /= self.dp
        if self.offload_optimizer:
            optim = master = 0.0
        if self.offload_param:
            params = 0.0
        return params + grads + master + optim

    def predict(self, stage: int, mbs: int) -> float:
        fixed = self.fixed or 0.0
        per_sample = self.per_sample if self.per_sample is not None else 0.0
        return fixed + self.model_states(stage) + per_sample * mbs

    def observe(self, stage: int, mbs: int, peak_bytes: int, oom: bool) -> None:
        if self.fixed is not None and not oom:
            predicted = self.predict(stage, mbs)
            self._errors.append({"stage": stage, "mbs": mbs, "predicted": predicted, "measured": peak_bytes, "rel_error": (predicted - peak_bytes) / peak_bytes})
        self.points.append((stage, mbs, peak_bytes, oom))
        if oom:
            for s in range(4):  # stages that keep at least as much per rank cannot fit it either
                if self.model_states(s) >= self.model_states(stage):
                    self.oom_at[s] = min(self.oom_at.get(s, mbs), mbs)
        self._fit()

    def _fit(self) -> None:
        ok = [(m, peak - self.model_states(s)) for s, m, peak, oom in self.points if not oom]
        if not ok:
            return
        xs = np.array([m for m, _ in ok], dtype=float)
        ys = np.array([y for _, y in ok], dtype=float)
        if len(set(xs)) >= 2:
            slope, intercept = np.polyfit(xs, ys, 1)
            self.per_sample = max(float(slope), 1.0)
            self.fixed = float(np.mean(ys - self.per_sample * xs))
        else:
            self.per_sample = PRIOR_PER_SAMPLE_FRACTION * max(float(ys.mean()), 1.0)
            self.fixed = float(ys.mean() - self.per_sample * xs.mean())

    def fits(self, stage: int, mbs: int) -> bool:
        if stage in self.oom_at and mbs >= self.oom_at[stage]:
            return False
        return self.limit is None or self.fixed is None or self.predict(stage, mbs) <= self.limit

    def max_micro_batch(self, stage: int, cap: Optional[int] = None) -> int:
        """The largest micro-batch predicted to fit (0 if none), at most `cap`."""
        top = min(x for x in (cap, self.oom_at.get(stage, MAX_MICRO_BATCH + 1) - 1, MAX_MICRO_BATCH) if x is not None)
        if self.limit is None or self.fixed is None or not self.per_sample:
            return top
        room = (self.limit - self.fixed - self.model_states(stage)) / self.per_sample
        return max(0, min(top, int(room)))

    def feasible(self, stage: int) -> bool:
        return self.fits(stage, 1)

    def errors(self) -> List[Dict[str, Any]]:
        return list(self._errors)

    def describe(self) -> str:
        gib = 2**30
        if self.fixed is None:
            return "not fitted yet"
        limit = f"{self.limit / gib:.2f} GiB" if self.limit else "none"
        return f"fixed {self.fixed / gib:.2f} GiB + states + {self.per_sample / 2**20:.1f} MiB/sample (limit {limit}/rank, dp {self.dp})"


def optimizer_bytes(optimizer: Optional[Dict[str, Any]]) -> int:
    if not optimizer:
        return 0  # a client optimizer DeepSpeed does not know about: states are not modelled
    kind = str(optimizer.get("type", "")).lower()
    if kind == "sgd":
        return 4 if (optimizer.get("params") or {}).get("momentum") else 0
    return OPTIMIZER_BYTES.get(kind, 8)


def default_limit(device: str, local_ranks: int) -> int:
    """No explicit limit: the device's memory on an accelerator, a share of host RAM on CPU."""
    if device != "cpu":
        from deepspeed.accelerator import get_accelerator

        return int(get_accelerator().total_memory())
    import psutil

    return int(psutil.virtual_memory().total // max(1, local_ranks))
