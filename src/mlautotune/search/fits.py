"""P(fits): the probability that a configuration runs without running out of memory.

One posterior over how the memory model (memory.py) is wrong, corrected by every run and OOM of
every stage, knob set and memory saver. Each draw is a way the per-rank peak could really be:

    peak = the memory model's prediction with the configuration's savers (its fitted fixed part, the
           ZeRO model states less what offload moves to the host, its fitted growth per sample)
           + (g - the memory model's g) x micro-batch - (s - the memory model's s) x the stage's measured sizes' mean
           + b x the knobs' buffers above the stage's default knobs (DeepSpeed's bucket semantics)
           + d, the stage's own error
           + o, the offload combination's own error (none without offload)

g is the growth per sample: s without activation checkpointing, c with it. s is on a grid over
seven decades: its prior is mostly near the fitted growth (tight once two sizes of a stage are
measured, wide on the prior slope), and WRONG_SHARE of it is spread over the whole grid: the model
may simply be wrong, and a run of OOMs must then move the edge by more than one size. Given s, the
peak is linear in (d, b, c, o), each with a Gaussian prior: d small for a stage whose runs fitted
the memory model's fixed part (its plain runs; where no plain run has a peak, its checkpointed
ones), larger for one that did not (ZeRO's states by stage are a formula, not a measurement), and
then the d of the stage it borrows its fixed part from plus its own (`_stage_cov`); b
around 1 (how far the buffer formula is off); c around the memory model's checkpointing factor
times s, CHECKPOINT_SD wide; o around 0, OFFLOAD_SD of the limit. So every measured peak, of any knob set and savers, is taken in exactly (a Gaussian update per grid value of
s, whose marginal likelihood weighs s), and checkpointing's growth is learned from its own runs'
peaks even where the plain growth is not known. Then every OOM's likelihood is the probability that
the peak is over the limit there, and every run without a peak's that it is under; these are taken
in by tempered resample-move (smc.py), so that OOMs the formula did not foresee move the draws, not
the weights of a few of them. P(fits) of a configuration is the weighted share of draws under the
limit (each draw's limit spread by ALLOCATOR_SLACK: the allocator's soft edge). Two facts stay
hard: a knob set that ran at a micro-batch fits every smaller one, and an OOM at a micro-batch
means every larger one of the stage with no fewer buffers (and the same memory savers) runs out too.
"""

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from mlautotune.search import smc
from mlautotune.search.candidates import base_knobs, knobs_of_params
from mlautotune.search.memory import MemoryModel, savers_of

SLOPE_GRID = 128  # values of the growth per sample, log-spaced from 1e-7 of the limit to the limit
DRAWS_PER_SLOPE = 16
WRONG_SHARE = 0.25  # prior mass of the growth per sample spread over the whole grid, not near the fitted value
MEASURED_SLOPE_SD = 0.25  # log sd of the growth per sample once measured at two sizes of a stage
PRIOR_SLOPE_SD = 1.0  # ... while it rests on the prior slope
BUFFER_SD = 0.5  # sd of the buffer formula's factor (around 1)
CHECKPOINT_SD = 0.5  # sd of the growth per sample with checkpointing, c, as a share of its prior mean (memory.py's factor x s)
OFFLOAD_SD = 0.1  # an offload combination's own error, as a share of the limit: what offload frees is a formula, not a measurement
OFFLOAD_KEYS = (("offload_optimizer",), ("offload_optimizer", "offload_param"), ("offload_param",))
PARTS = 6 + len(OFFLOAD_KEYS)  # the linear parts of a peak: d by stage, b, c, an offset per offload combination
RAN_STAGE_SD = 0.02  # a stage's own error, as a share of the limit, once it ran with default knobs
UNRUN_STAGE_SD = 0.05  # ... before, plus STATES_SD of its model states' difference from a stage that ran
STATES_SD = 0.5
PEAK_SD = 0.03  # a measured peak's error, as a share of it
ALLOCATOR_SLACK = 0.02  # the soft edge: the peak's spread at the limit, as a share of it


def buffer_bytes(stage: int, knobs: Dict[str, Any], element_bytes: int) -> float:
    """DeepSpeed's communication buffers that the knobs size: the reduction bucket (two with
    overlap_comm), the all-gather bucket of stages 1-2 and stage 3's prefetch bucket."""
    total = float(knobs.get("reduce_bucket_size", 5e8)) * (2 if knobs.get("overlap_comm") else 1)
    if stage in (1, 2):
        total += float(knobs.get("allgather_bucket_size", 5e8))
    if stage == 3:
        total += float(knobs.get("stage3_prefetch_bucket_size", 5e7))
    return total * element_bytes


def _log_norm_cdf(z: np.ndarray) -> np.ndarray:
    from scipy.special import log_ndtr

    return log_ndtr(z)


class FitModel:
    """P(fits) for configurations: the memory model as the prior, every run and OOM as evidence."""

    def __init__(self, plan, memory: Optional[MemoryModel], runs: Sequence[Any], seed: int = 0):
        self.plan, self.memory = plan, memory
        self.element_bytes = 2 if memory is not None and memory.half else 4
        self.ok_at: Dict[tuple, int] = {}  # stage+knobs -> largest micro-batch that ran
        self.oom_at: Dict[tuple, int] = {}  # stage+knobs -> smallest micro-batch that ran out of memory
        self.ooms: List[Tuple[int, float, int, tuple]] = []  # (stage, buffer bytes, micro-batch, savers) of every OOM
        outcomes = []
        for m in runs:
            key, mbs = group(m.params), m.params["micro_batch"]
            if m.result.status == "ok":
                self.ok_at[key] = max(self.ok_at.get(key, 0), mbs)
                outcomes.append((m.params, "ok", m.result.metrics.get("peak_memory_bytes")))
            elif m.result.status == "oom":
                self.oom_at[key] = min(self.oom_at.get(key, mbs), mbs)
                self.ooms.append((m.params["stage"], self._buffers(m.params), mbs, tuple(sorted(savers_of(m.params)))))
                outcomes.append((m.params, "oom", None))
        self.limit = memory.limit if memory is not None else None
        self.usable = memory is not None and self.limit is not None and memory.fixed is not None
        self._curves: Dict[tuple, tuple] = {}
        self._edges: Dict[tuple, Optional[float]] = {}
        self._fills: Dict[tuple, float] = {}
        if self.usable:
            self._posterior(outcomes, np.random.RandomState(seed % 2**32))

    # ---- the posterior ---------------------------------------------------------------------------
    def _posterior(self, outcomes, rng: np.random.RandomState) -> None:
        """Draws of (s, theta) and their weights. Given s, the peak is linear in theta with a Gaussian
        prior: the measured peaks are taken in exactly (a Gaussian update per grid value of s, and its
        marginal likelihood as the weight of s); OOMs and runs without a peak then by smc.draw."""
        mem, limit = self.memory, self.limit
        self.slope = max(mem.per_sample or 0.0, 1.0)
        grid = np.geomspace(limit * 1e-7, limit, SLOPE_GRID)
        sd = MEASURED_SLOPE_SD if mem.per_sample_measured() else PRIOR_SLOPE_SD
        near = np.exp(-0.5 * (np.log(grid / self.slope) / sd) ** 2)
        log_prior = np.log((1 - WRONG_SHARE) * near / near.sum() + WRONG_SHARE / len(grid))
        plain = {st for st, _, _, oom in mem.points if not oom}
        ran = plain or {st for st, _, _, _, oom in mem.saver_points if not oom}  # the stages whose runs fitted a fixed part (memory.py's _fit)
        spread = np.zeros(4)
        self.anchor: Dict[int, float] = {}
        near: Dict[int, int] = {}
        for stage in range(4):
            near[stage] = near_stage = min(ran, key=lambda r: (abs(r - stage), -r)) if ran else stage
            # where s moves the fixed part: the plain runs' mean size that fitted it (none: only checkpointed runs fitted it, s does not)
            sizes = [m for st, m, _, oom in mem.points if st == (stage if stage in plain else near_stage) and not oom] or [0]
            self.anchor[stage] = float(np.mean(sizes))
            spread[stage] = RAN_STAGE_SD * limit if stage in ran else UNRUN_STAGE_SD * limit + STATES_SD * abs(
                mem.model_states(stage) - mem.model_states(near_stage))
        G = len(grid)
        prior_mean = np.zeros((G, PARTS))
        prior_mean[:, 4], prior_mean[:, 5] = 1.0, mem.checkpoint_factor * grid  # b around 1; c around the factor's share of s
        prior_cov = np.tile(np.diag(np.concatenate([spread**2, [BUFFER_SD**2, 0.0], [(OFFLOAD_SD * limit) ** 2] * len(OFFLOAD_KEYS)])), (G, 1, 1))
        prior_cov[:, :4, :4] = _stage_cov(spread, ran, near)
        prior_cov[:, 5, 5] = (CHECKPOINT_SD * mem.checkpoint_factor * grid) ** 2
        measured = [(p, float(peak)) for p, status, peak in outcomes if status == "ok" and peak]
        mean, cov = prior_mean, prior_cov
        if measured:
            H = np.array([self._row(p) for p, _ in measured])  # J x PARTS
            noise = np.diag([(PEAK_SD * peak) ** 2 for _, peak in measured])
            gap = np.array([peak - mem.predict(p["stage"], p["micro_batch"], savers_of(p)) for p, peak in measured])
            ckpt = np.array([_checkpointed(p) for p, _ in measured])
            sizes = np.array([p["micro_batch"] for p, _ in measured], dtype=float)
            at = np.array([self.anchor[p["stage"]] for p, _ in measured])
            lever = np.where(ckpt, -at, sizes - at)  # where s enters a peak (peaks(): the anchor's term, and the growth if not checkpointed)
            fitted_c = np.array([mem.per_sample_with(savers_of(p)) if c else 0.0 for (p, _), c in zip(measured, ckpt)])
            resid = gap[None, :] - (grid - self.slope)[:, None] * lever[None, :] + (fitted_c * sizes)[None, :]  # G x J: what H theta must explain
            HS = np.einsum("jp,gpq->gjq", H, prior_cov)
            C = np.einsum("gjq,kq->gjk", HS, H) + noise[None]
            off = resid - np.einsum("jp,gp->gj", H, prior_mean)
            solved = np.linalg.solve(C, off[:, :, None])[:, :, 0]
            log_prior = log_prior - 0.5 * np.einsum("gj,gj->g", off, solved) - 0.5 * np.linalg.slogdet(C)[1]
            mean = prior_mean + np.einsum("gjp,gj->gp", HS, solved)
            cov = prior_cov - np.einsum("gjp,gjq->gpq", HS, np.linalg.solve(C, HS))
        cov = (cov + np.swapaxes(cov, 1, 2)) / 2
        diag = np.maximum(np.einsum("gpp->gp", cov), 1e-12)
        root = np.linalg.cholesky(cov + 1e-9 * diag[:, :, None] * np.eye(PARTS)[None])  # d in bytes, b a factor: jitter per element
        evidence = [(params, status == "oom") for params, status, peak in outcomes if not (status == "ok" and peak)]  # the peaks are in exactly
        soft = ALLOCATOR_SLACK * limit

        def loglik(at: np.ndarray, theta: np.ndarray) -> np.ndarray:
            total = np.zeros(len(at))
            for params, oom in evidence:
                over = (self.peaks(params, [params["micro_batch"]], grid[at], theta)[0] - limit) / soft
                total += _log_norm_cdf(over if oom else -over)
            return total

        at, self.theta, self.w = smc.draw(log_prior, mean, root, loglik, len(grid) * DRAWS_PER_SLOPE, rng)
        self.s = grid[at]
        self.edge_bytes = limit * (1.0 + ALLOCATOR_SLACK * rng.standard_normal(len(at)))  # each draw's soft edge

    def peaks(self, params: Dict[str, Any], sizes: Sequence[int], s: Optional[np.ndarray] = None, theta: Optional[np.ndarray] = None) -> np.ndarray:
        """Each draw's peak (bytes) at each size: len(sizes) x draws (the posterior's draws, or these)."""
        s, theta = (self.s, self.theta) if theta is None else (s, theta)
        stage, savers = params["stage"], savers_of(params)
        m = np.asarray(sizes, dtype=float)[:, None]
        base = np.array([self.memory.predict(stage, int(x), savers) for x in sizes], dtype=float)[:, None]
        fitted = self.memory.per_sample_with(savers) if _checkpointed(params) else self.slope
        off = _offloaded(savers)
        offset = theta[:, 6 + OFFLOAD_KEYS.index(off)] if off else 0.0
        # the draw's fixed part matches the peaks measured at the anchor: base + (slope - s) at + (growth - fitted growth) m
        return (base + (self.slope - s) * self.anchor[stage] + (self._growth(params, s, theta) - fitted) * m + theta[:, 4] * self._shift(params)
                + theta[:, stage] + offset)

    def _growth(self, params: Dict[str, Any], s: np.ndarray, theta: np.ndarray) -> np.ndarray:
        """Each draw's memory per sample: s, or with checkpointing c (not below 0)."""
        return np.maximum(theta[:, 5], 0.0) if _checkpointed(params) else s

    def _row(self, params: Dict[str, Any]) -> List[float]:
        """Where (d by stage, b, c, the offload offsets) enter this configuration's peak: H's row."""
        savers = savers_of(params)
        return ([1.0 if params["stage"] == st else 0.0 for st in range(4)] + [self._shift(params)]
                + [float(params["micro_batch"]) if _checkpointed(params) else 0.0] + [1.0 if _offloaded(savers) == key else 0.0 for key in OFFLOAD_KEYS])

    # ---- what the search asks --------------------------------------------------------------------
    def _buffers(self, params: Dict[str, Any]) -> float:
        return buffer_bytes(params["stage"], knobs_of_params(params), self.element_bytes)

    def _shift(self, params: Dict[str, Any]) -> float:
        stage = params["stage"]
        return self._buffers(params) - buffer_bytes(stage, base_knobs(self.plan, stage), self.element_bytes)

    def edge(self, params: Dict[str, Any]) -> Optional[float]:
        """The largest micro-batch that fits with these knobs, the posterior median (None: no memory model or no limit)."""
        key = group(params)
        if key not in self._edges:
            self._edges[key] = self._edge(params)
        return self._edges[key]

    def _edge(self, params: Dict[str, Any]) -> Optional[float]:
        """The posterior median of the largest fitting micro-batch, within what ran and what ran out."""
        if not self.usable:
            return None
        at = max(1, int(round(self.anchor[params["stage"]])))
        edges = at + (self.edge_bytes - self.peaks(params, [at])[0]) / np.maximum(self._growth(params, self.s, self.theta), 1.0)
        order = np.argsort(edges)
        median = float(edges[order][np.searchsorted(np.cumsum(self.w[order]), 0.5)])
        fits_up_to, fails_from = self._facts(params)
        return max(min(median, fails_from - 1), fits_up_to, 0.0)

    def _facts(self, params: Dict[str, Any]) -> Tuple[int, float]:
        """(the largest size of this stage and knobs that ran, the smallest known to run out of memory)."""
        key = group(params)
        if key not in self._curves:
            buffers = self._buffers(params)
            savers = tuple(sorted(savers_of(params)))
            fails = [at for stage, b, at, sv in self.ooms if stage == params["stage"] and buffers >= b and sv == savers]  # an OOM with no more buffers
            self._curves[key] = (self.ok_at.get(key, 0), min([self.oom_at.get(key, math.inf), *fails]))
        return self._curves[key]

    def fill(self, params: Dict[str, Any]) -> float:
        """The posterior mean of the peak over the limit (0 without a memory model): how full memory is."""
        if not self.usable:
            return 0.0
        key = (group(params), params["micro_batch"])
        if key not in self._fills:
            self._fills[key] = float(min(max(self.w @ self.peaks(params, [params["micro_batch"]])[0] / self.limit, 0.0), 1.5))
        return self._fills[key]

    def p_fit(self, params: Dict[str, Any]) -> float:
        return self.p_fits(params, [params["micro_batch"]])[0]

    def p_fits(self, params: Dict[str, Any], sizes: Sequence[int]) -> List[float]:
        """P(fits) of these params' stage and knobs at each micro-batch size."""
        fits_up_to, fails_from = self._facts(params)
        if self.usable:
            p = (self.peaks(params, sizes) <= self.edge_bytes) @ self.w
        else:
            p = np.full(len(sizes), 0.9 if self.ooms else 1.0)
        return [1.0 if mbs <= fits_up_to else 0.0 if mbs >= fails_from else float(x) for mbs, x in zip(sizes, p)]


def _stage_cov(spread: np.ndarray, ran: set, near: Dict[int, int]) -> np.ndarray:
    """The prior covariance of the stages' own errors d. A stage that did not run takes its fixed part
    from the nearest stage that ran (memory.py), so its error is that stage's plus its own: what the
    runs show of one carries over to the stages that borrow from it."""
    cov = np.diag(spread**2)
    if not ran:  # no stage ran: each borrows from itself, and nothing is shared
        return cov
    for i in range(4):
        for j in range(4):
            r = near[i]  # a stage that ran is its own nearest
            if r == near[j] and not i == j == r:
                cov[i, j] += spread[r] ** 2
    return cov


def _offloaded(savers: Dict[str, bool]) -> tuple:
    """The offload combination switched on (empty: none)."""
    return tuple(sorted(k for k in savers if k.startswith("offload")))


def _checkpointed(params: Dict[str, Any]) -> bool:
    return bool(savers_of(params).get("activation_checkpointing"))


def group(params: Dict[str, Any]) -> tuple:
    """The stage and knobs of a configuration: what memory depends on besides the micro-batch."""
    return tuple(sorted((k, v) for k, v in params.items() if k not in ("micro_batch", "gas")))
