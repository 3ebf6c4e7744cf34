"""Per-stage memory model: a formula for the model states, a line fitted to measured peaks for the rest.

peak(stage, mbs) = fixed + model_states(stage) + per_sample * mbs

model_states follows ZeRO: bytes per parameter by precision and optimizer, partitioned over the
data-parallel degree (world_size // mp_size), with offloaded parts removed. `per_sample`
(activations) is fitted by least squares to the peaks that experiments measure, and refitted as
every result comes in. `fixed` (runtime, buffers, framework) is fitted per stage once the stage has
measurements of its own (ZeRO's buckets and prefetch buffers differ by stage); a stage not run yet
takes its nearest run stage's.
Where a stage's memory grows faster somewhere than its own fitted line says (a CPU rank's RSS),
that growth carries on beyond its largest run, from the run's measured peak, in the edge prediction
of every stage; an OOM's peak (at least the limit) counts as a point of that growth, so an edge probe
that ran out of memory moves every stage's edge under it. An OOM is also a hard bound: no
micro-batch at or above it is predicted to fit, in that stage or in any stage with more memory per
rank. In a stage with no successful run yet, an OOM also calibrates: its peak (at least the limit)
is a lower bound on the stage's fixed part, so the next prediction lands below it by the right
amount instead of one micro-batch lower.
"""

from typing import Any, Dict, List, Optional

import numpy as np

OPTIMIZER_BYTES = {"adam": 8, "adamw": 8, "fusedadam": 8, "cpuadam": 8, "onebitadam": 8, "zerooneadam": 8, "onebitlamb": 8, "lamb": 8, "adagrad": 4}
PRIOR_PER_SAMPLE_FRACTION = 0.02  # before two micro-batch sizes are measured: 2% of the fixed part per sample
MAX_MICRO_BATCH = 1 << 16
MIN_PER_SAMPLE = 1.0  # bytes: the fitted growth per sample is at least this (peaks that do not grow)
SECANT_RATIO = 1.5  # runs closer than this in micro-batch do not tell memory growth from allocator steps


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
        self.stage_fixed: Dict[int, float] = {}
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
        fixed = self.fixed_part(stage)
        per_sample = self.per_sample if self.per_sample is not None else 0.0
        return fixed + self.model_states(stage) + per_sample * mbs

    def fixed_part(self, stage: int) -> float:
        """The stage's own fixed part; for a stage not run yet, that of the nearest stage that ran (the
        higher stage of two as near): ZeRO's buckets and prefetch buffers grow with the stage, so a
        stage is more like its neighbour than like the average of all."""
        if stage in self.stage_fixed:
            return self.stage_fixed[stage]
        near = sorted(self.stage_fixed, key=lambda s: (abs(s - stage), -s))
        return self.stage_fixed[near[0]] if near else 0.0  # nothing has run yet: nothing fitted

    def observe(self, stage: int, mbs: int, peak_bytes: Optional[int], oom: bool) -> None:
        """One measured peak (an OOM's peak may be unknown: a real accelerator OOM reports none)."""
        if oom:
            peak_bytes = max(peak_bytes or 0, (self.limit or 0) + 1)
        elif not peak_bytes:
            return
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
        """per_sample: least squares within each stage (each stage has its own intercept); fixed:
        per stage from its own runs, or, for a stage with only OOMs, its nearest run stage's raised
        to what the OOMs imply."""
        ok = [(s, m, peak - self.model_states(s)) for s, m, peak, oom in self.points if not oom]
        if not ok:
            return
        num = den = 0.0
        for stage in {s for s, _, _ in ok}:
            n, d = _moments([(m, y) for s, m, y in ok if s == stage])
            num, den = num + n, den + d
        ys_all = np.array([y for _, _, y in ok], dtype=float)
        self.per_sample = max(num / den, MIN_PER_SAMPLE) if den > 0 else PRIOR_PER_SAMPLE_FRACTION * max(float(ys_all.mean()), 1.0)
        self.fixed = float(np.mean([y - self.per_sample * m for _, m, y in ok]))
        self.stage_fixed = {stage: float(np.mean([y - self.per_sample * m for s, m, y in ok if s == stage])) for stage in {s for s, _, _ in ok}}
        for stage in sorted({s for s, _, _, _ in self.points} - set(self.stage_fixed)):
            bounds = [peak - self.model_states(s) - self.per_sample * m for s, m, peak, oom in self.points if s == stage and oom]
            self.stage_fixed[stage] = max([self.fixed_part(stage), *(b + 1 for b in bounds)])

    def fits(self, stage: int, mbs: int) -> bool:
        if stage in self.oom_at and mbs >= self.oom_at[stage]:
            return False
        return self.limit is None or self.fixed is None or self.predict(stage, mbs) <= self.limit

    def max_micro_batch(self, stage: int, cap: Optional[int] = None, headroom: float = 0.0) -> int:
        """The largest micro-batch predicted to fit (0 if none), at most `cap`; with `headroom`, the
        largest predicted to leave that fraction of the limit free."""
        top = min(x for x in (cap, self.oom_at.get(stage, MAX_MICRO_BATCH + 1) - 1, MAX_MICRO_BATCH) if x is not None)
        if self.limit is None or self.fixed is None or not self.per_sample:
            return top
        limit = self.limit * (1.0 - headroom)
        room = (limit - self.predict(stage, 0)) / self.per_sample
        for ratio, top_run, excess in self._curvature():  # beyond a run where memory grew faster than its line
            if room > top_run:
                room = top_run + (limit - self.predict(stage, top_run) - excess) / (self.per_sample * ratio)
        return max(0, min(top, int(room)))

    def _curvature(self) -> List[tuple]:
        """Memory that grows faster at larger micro-batches (a CPU rank's RSS) grows at least as fast
        beyond them: for each stage whose steepest growth from a run to a larger run or OOM
        (SECANT_RATIO or more apart) is steeper than the stage's own least-squares line, (how many
        times steeper, the stage's largest run, how far that run's peak is above the fitted line).
        An OOM's peak (at least the limit where none was measured) is a lower bound, so the growth
        to it is too: an edge probe that ran out of memory moves every stage's edge under it, not
        only its own. Memory linear in the micro-batch, within the limit, has none."""
        curves = []
        for stage in {s for s, _, _, oom in self.points if not oom}:
            runs = sorted((m, peak) for s, m, peak, oom in self.points if s == stage and not oom)
            if len(runs) < 2:
                continue
            ends = runs + [(m, peak) for s, m, peak, oom in self.points if s == stage and oom]
            n, d = _moments(runs)
            own = n / d if d > 0 else 0.0
            steepest = max(((p2 - p1) / (m2 - m1) for m1, p1 in runs for m2, p2 in ends if m2 >= m1 * SECANT_RATIO), default=0.0)
            if own > 0 and steepest > own:
                top, peak = runs[-1]
                curves.append((steepest / own, top, max(0.0, peak - self.predict(stage, top))))
        return curves

    def grows(self) -> bool:
        """Whether the peaks seen grow with the micro-batch at all. Two sizes within one allocator chunk
        (a CPU rank's RSS) have the same peak: a line through them puts the edge at any size."""
        return self.per_sample is not None and self.per_sample > MIN_PER_SAMPLE

    def per_sample_measured(self) -> bool:
        """Whether the per-sample slope comes from runs (two sizes in one stage), not the prior."""
        sizes: Dict[int, set] = {}
        for s, m, _, oom in self.points:
            if not oom:
                sizes.setdefault(s, set()).add(m)
        return any(len(v) >= 2 for v in sizes.values())

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


def _moments(points: List[tuple]) -> tuple:
    """(sum of (x - mean x)(y - mean y), sum of (x - mean x)^2) over (x, y) points: a least-squares slope is their ratio."""
    xs, ys = np.array([x for x, _ in points], dtype=float), np.array([y for _, y in points], dtype=float)
    return float(((xs - xs.mean()) * (ys - ys.mean())).sum()), float(((xs - xs.mean()) ** 2).sum())


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
