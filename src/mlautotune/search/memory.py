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

Memory savers (savers.py: tuned where the plan has them) change two terms:
- activation checkpointing multiplies the per-sample part by CHECKPOINT_FACTOR, an estimate: a
  checkpointed layer keeps only its input (2 s h bytes of the ~34 s h + 5 a s^2 a layer keeps,
  Korthikanti et al.), and one layer's full set is rebuilt at a time in the backward, so a model of
  L layers keeps ~1/L + 0.06 of its activations; the logits are not checkpointed. 0.35 is that for
  a 4-layer model with its logits, on the safe side for deeper ones. Once a checkpointed run has
  measured its peak, the factor is the one its peaks show (their median, per-sample part over the
  plain per-sample slope); a checkpointed run that ran out of memory, before any fitted, raises the
  factor to what its micro-batch implies.
- ZeRO-Offload removes from the device what it moves to the host: offload_optimizer the fp32
  master weights and optimizer states (and their fp32 gradients), offload_param (stage 3) the
  weights. Their host memory is `host_bytes` (per rank), checked against the host's RAM by savers.py.
A run with offload alone is a point of the plain fit, its peak raised by the states it moved (its
activations and buffers are the plain ones); a checkpointed run is a point of its own curve. A run
with savers that ran out of memory bounds only configurations with the same savers.
"""

from typing import Any, Dict, List, Optional

import numpy as np

OPTIMIZER_BYTES = {"adam": 8, "adamw": 8, "fusedadam": 8, "cpuadam": 8, "onebitadam": 8, "zerooneadam": 8, "onebitlamb": 8, "lamb": 8, "adagrad": 4}
PRIOR_PER_SAMPLE_FRACTION = 0.02  # before two micro-batch sizes are measured: 2% of the fixed part per sample
MAX_MICRO_BATCH = 1 << 16
MIN_PER_SAMPLE = 1.0  # bytes: the fitted growth per sample is at least this (peaks that do not grow)
SECANT_RATIO = 1.5  # runs closer than this in micro-batch do not tell memory growth from allocator steps
CHECKPOINT_FACTOR = 0.35  # activation checkpointing's share of the per-sample memory, before a checkpointed run measures it
CHECKPOINT_FACTOR_RANGE = (0.02, 1.0)
SAVER_KEYS = ("activation_checkpointing", "offload_optimizer", "offload_param")


def savers_of(params: Optional[Dict[str, Any]]) -> Dict[str, bool]:
    """The savers switched on in these params (an absent key is off)."""
    return {k: True for k in SAVER_KEYS if params and params.get(k)}


class MemoryModel:
    def __init__(self, num_params: int, trainable_params: int, ds_config: Dict[str, Any], world_size: int, mp_size: int, limit_bytes: Optional[int], device: str,
                 host_memory: Optional[int] = None, local_ranks: int = 1):
        self.host_memory, self.local_ranks = host_memory, max(1, local_ranks)  # a node's RAM and ranks: offload's host check
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
        self.saver_points: List[tuple] = []  # (stage, savers key, mbs, peak, oom) of runs with a saver
        self.saver_oom_at: Dict[tuple, int] = {}  # (stage, savers key) -> smallest micro-batch seen to OOM
        self.checkpoint_factor = CHECKPOINT_FACTOR
        self.checkpoint_measured = False
        self.per_sample_bounded = False  # the per-sample growth is an OOM's lower bound (_bound_per_sample)
        self.host_held = 0.0  # the most host memory per rank (host_bytes) that an offloaded run took and ran

    def model_states(self, stage: int, savers: Optional[Dict[str, bool]] = None) -> float:
        """Bytes per rank for parameters, gradients, fp32 master copy and optimizer states (on the
        device: less what the user's or the tuned offload moves to the host)."""
        savers = savers or {}
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
        if self.offload_optimizer or (savers.get("offload_optimizer") and stage >= 1):
            optim = master = 0.0
        if self.offload_param or (savers.get("offload_param") and stage >= 3):
            params = 0.0
        return params + grads + master + optim

    def host_bytes(self, stage: int, savers: Optional[Dict[str, bool]] = None) -> float:
        """Host memory per rank that the tuned offload takes: the optimizer states, fp32 master
        weights and fp32 gradients of the rank's partition (offload_optimizer, 4 + 4 + optimizer
        bytes per parameter: 16 with Adam), the half weights (offload_param, stage 3)."""
        savers = savers or {}
        t = self.trainable_params / self.mp / (self.dp if stage >= 1 else 1)
        total = t * (8 + self.optimizer_bytes) if savers.get("offload_optimizer") else 0.0
        if savers.get("offload_param") and stage >= 3:
            total += self.num_params / self.mp / self.dp * (2 if self.half else 4)
        return total

    def per_sample_with(self, savers: Optional[Dict[str, bool]] = None) -> float:
        per_sample = self.per_sample if self.per_sample is not None else 0.0
        return per_sample * (self.checkpoint_factor if (savers or {}).get("activation_checkpointing") else 1.0)

    def predict(self, stage: int, mbs: int, savers: Optional[Dict[str, bool]] = None) -> float:
        fixed = self.fixed_part(stage)
        return fixed + self.model_states(stage, savers) + self.per_sample_with(savers) * mbs

    def fixed_part(self, stage: int) -> float:
        """The stage's own fixed part; for a stage not run yet, that of the nearest stage that ran (the
        higher stage of two as near): ZeRO's buckets and prefetch buffers grow with the stage, so a
        stage is more like its neighbour than like the average of all."""
        if stage in self.stage_fixed:
            return self.stage_fixed[stage]
        near = sorted(self.stage_fixed, key=lambda s: (abs(s - stage), -s))
        return self.stage_fixed[near[0]] if near else 0.0  # nothing has run yet: nothing fitted

    def observe(self, stage: int, mbs: int, peak_bytes: Optional[int], oom: bool, savers: Optional[Dict[str, bool]] = None) -> None:
        """One measured peak (an OOM's peak may be unknown: a real accelerator OOM reports none)."""
        if not oom and savers:
            self.host_held = max(self.host_held, self.host_bytes(stage, savers))
        if oom:
            peak_bytes = max(peak_bytes or 0, (self.limit or 0) + 1)
        elif not peak_bytes:
            return
        if savers and (oom or savers.get("activation_checkpointing")):
            self._observe_saver(stage, mbs, peak_bytes, oom, savers)
            return
        if savers:  # offload changes the states only: the run is a point of the plain curve, as if not offloaded
            peak_bytes = int(peak_bytes + self.model_states(stage) - self.model_states(stage, savers))
        if self.fixed is not None and not oom:
            predicted = self.predict(stage, mbs)
            self._errors.append({"stage": stage, "mbs": mbs, "predicted": predicted, "measured": peak_bytes, "rel_error": (predicted - peak_bytes) / peak_bytes})
        self.points.append((stage, mbs, peak_bytes, oom))
        if oom:
            for s in range(4):  # stages that keep at least as much per rank cannot fit it either
                if self.model_states(s) >= self.model_states(stage):
                    self.oom_at[s] = min(self.oom_at.get(s, mbs), mbs)
        self._fit()

    def _observe_saver(self, stage: int, mbs: int, peak_bytes: int, oom: bool, savers: Dict[str, bool]) -> None:
        key = (stage, tuple(sorted(savers)))
        self.saver_points.append((stage, key[1], mbs, peak_bytes, oom))
        if oom:
            self.saver_oom_at[key] = min(self.saver_oom_at.get(key, mbs), mbs)
        self._fit()

    def _fit_checkpoint_factor(self) -> None:
        """The checkpointing factor its measured peaks show: each run's memory above the fixed part and
        the states, per sample, over the plain per-sample slope (once that slope is measured)."""
        if self.fixed is None or not self.per_sample or not any(not oom for *_, oom in self.points) or not self.per_sample_measured():
            return
        ratios, bounds = [], []
        for stage, keys, mbs, peak, oom in self.saver_points:
            if "activation_checkpointing" not in keys:
                continue
            savers = dict.fromkeys(keys, True)
            (bounds if oom else ratios).append((peak - self.fixed_part(stage) - self.model_states(stage, savers)) / (self.per_sample * mbs))
        lo, hi = CHECKPOINT_FACTOR_RANGE
        if ratios:
            self.checkpoint_factor = float(min(max(np.median(ratios), lo), hi))
            self.checkpoint_measured = True
        elif bounds:  # a checkpointed OOM: at its micro-batch the peak passed the limit, so the factor is at least that
            self.checkpoint_factor = float(min(max(CHECKPOINT_FACTOR, *bounds), hi))

    def _fit(self) -> None:
        """per_sample: least squares within each stage (each stage has its own intercept); fixed:
        per stage from its own runs, or, for a stage with only OOMs, its nearest run stage's raised
        to what the OOMs imply."""
        ok = [(s, m, peak - self.model_states(s)) for s, m, peak, oom in self.points if not oom]
        if not ok:  # only checkpointed runs (nothing ran without it): each is a plain point at factor x its micro-batch
            ok = [(s, m * self.checkpoint_factor, peak - self.model_states(s, dict.fromkeys(k, True))) for s, k, m, peak, oom in self.saver_points if not oom]
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
        self._bound_per_sample()
        self._fit_checkpoint_factor()

    def _bound_per_sample(self) -> None:
        """Before two sizes have run, an offloaded run that ran out of memory, in a stage with a fitted
        fixed part, bounds the per-sample growth from below: at its micro-batch the peak passed the limit."""
        self.per_sample_bounded = False
        if self.per_sample_measured() or self.limit is None:
            return
        for stage, keys, mbs, peak, oom in self.saver_points:
            if oom and "activation_checkpointing" not in keys and stage in self.stage_fixed and mbs > 0:
                bound = (peak - self.stage_fixed[stage] - self.model_states(stage, dict.fromkeys(keys, True))) / mbs
                if bound > (self.per_sample or 0.0):
                    self.per_sample, self.per_sample_bounded = bound, True

    def fits(self, stage: int, mbs: int) -> bool:
        if stage in self.oom_at and mbs >= self.oom_at[stage]:
            return False
        return self.limit is None or self.fixed is None or self.predict(stage, mbs) <= self.limit

    def max_micro_batch(self, stage: int, cap: Optional[int] = None, headroom: float = 0.0, savers: Optional[Dict[str, bool]] = None) -> int:
        """The largest micro-batch predicted to fit (0 if none), at most `cap`; with `headroom`, the
        largest predicted to leave that fraction of the limit free. With savers: that curve's edge
        (below its own OOMs; the plain curve's curvature is not carried over)."""
        if savers:
            return self._saver_max_micro_batch(stage, cap, headroom, savers)
        top = min(x for x in (cap, self.oom_at.get(stage, MAX_MICRO_BATCH + 1) - 1, MAX_MICRO_BATCH) if x is not None)
        if self.limit is None or self.fixed is None or not self.per_sample:
            return top
        limit = self.limit * (1.0 - headroom)
        room = (limit - self.predict(stage, 0)) / self.per_sample
        for ratio, top_run, excess in self._curvature():  # beyond a run where memory grew faster than its line
            if room > top_run:
                room = top_run + (limit - self.predict(stage, top_run) - excess) / (self.per_sample * ratio)
        return max(0, min(top, int(room)))

    def _saver_max_micro_batch(self, stage: int, cap: Optional[int], headroom: float, savers: Dict[str, bool]) -> int:
        oom = self.saver_oom_at.get((stage, tuple(sorted(savers))), MAX_MICRO_BATCH + 1)
        top = min(x for x in (cap, oom - 1, MAX_MICRO_BATCH) if x is not None)
        per_sample = self.per_sample_with(savers)
        if self.limit is None or self.fixed is None or not per_sample:
            return top
        room = (self.limit * (1.0 - headroom) - self.predict(stage, 0, savers)) / per_sample
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
        sizes: Dict[Any, set] = {}
        for s, m, _, oom in self.points:
            if not oom:
                sizes.setdefault(s, set()).add(m)
        for s, k, m, _, oom in self.saver_points:
            if not oom:
                sizes.setdefault((s, k), set()).add(m)
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
