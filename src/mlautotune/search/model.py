"""The search's probabilistic model: throughput with its uncertainty, and the risk of running out of memory.

Throughput: a Gaussian process (scikit-learn) on the log of the score (higher is better whatever
the metric), fitted on every measurement of every stage, re-measurements included, each as its own
noisy observation. Inputs: the stage (one-hot), log2 of the micro-batch and of the gradient
accumulation, and each knob scaled to 0..1 over its values. The kernel is a constant times an ARD
Matern 5/2 plus white noise; its hyperparameters are fitted by marginal likelihood once five
measurements exist (fixed, broad ones before). A measurement's own interval, where the probe gave
one, is added to its noise. A configuration nobody measured has the prior's mean and spread: an
unseen stage is uncertain, not bad.

Memory: P(fits) per configuration (`FitModel`). Memory grows with the micro-batch, so an ok run
at the same stage and knobs at or above it says yes and an OOM at or below it says no. Otherwise
the memory model's edge (memory.py: its fitted growth, corrected by every run and OOM) shifted by
the knobs' buffers (DeepSpeed's bucket semantics, then corrected by the peaks measured with those
knobs) is the prior: a logistic in log2(micro-batch / edge), wide while the per-sample growth
rests on the prior slope.
"""

import math
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from mlautotune.search.candidates import base_knobs, knobs_of_params
from mlautotune.search.memory import MemoryModel, savers_of

MIN_FIT = 5  # measurements before the kernel's hyperparameters are fitted
NOISE_FLOOR = 1e-4  # variance of one measurement in log units: at least 1% (sd)
Z95 = 1.96


_CONTROLLER = []


def one_thread():
    """BLAS on one thread: these matrices are small, and threads fighting over shared cores cost 30x."""
    if not _CONTROLLER:
        from threadpoolctl import ThreadpoolController

        _CONTROLLER.append(ThreadpoolController())  # finding the libraries is the slow part: once
    return _CONTROLLER[0].limit(limits=1)


def _value_range(values: Sequence[Any]) -> Tuple[float, float]:
    xs = [_num(v) for v in values]
    return min(xs), max(xs)


def _num(v: Any) -> float:
    if isinstance(v, bool):
        return float(v)
    v = float(v)
    return math.log10(v) if v >= 1000 else v


class Encoder:
    """Params -> a row of the model's inputs (every stage's knobs in one space; a knob a stage lacks is 0)."""

    def __init__(self, knob_values: Dict[str, Sequence[Any]]):
        self.knobs = sorted(knob_values)
        self.ranges = {k: _value_range(knob_values[k]) for k in self.knobs}
        self._rows: Dict[tuple, List[float]] = {}

    def row(self, p: Dict[str, Any]) -> List[float]:
        row = [1.0 if p["stage"] == s else 0.0 for s in range(4)]
        row += [math.log2(p["micro_batch"]), math.log2(p.get("gas", 1))]
        for k in self.knobs:
            lo, hi = self.ranges[k]
            row.append(0.0 if k not in p or hi == lo else (_num(p[k]) - lo) / (hi - lo))
        return row

    def rows(self, params: Sequence[Dict[str, Any]]) -> np.ndarray:
        out = []
        for p in params:
            key = tuple(sorted(p.items()))
            if key not in self._rows:
                self._rows[key] = self.row(p)
            out.append(self._rows[key])
        return np.array(out, dtype=float).reshape(len(params), 6 + len(self.knobs))


@dataclass
class Observation:
    params: Dict[str, Any]
    log_score: float
    noise_var: float = 0.0  # the measurement's own interval, as a variance in log units (0: unknown)


class ThroughputModel:
    """A GP over log(score): `predict` gives the latent mean and sd; `joint` samples the latent values."""

    def __init__(self, encoder: Encoder, seed: int = 0):
        self.encoder, self.seed = encoder, seed
        self.gp = None
        self.mean = 0.0
        self.prior_sd = 0.5

    def fit(self, obs: List[Observation], kernel=None, mean: Optional[float] = None) -> "ThroughputModel":
        """Fit on the observations; with `kernel` (and `mean`) given, those are kept, not fitted."""
        from sklearn.gaussian_process import GaussianProcessRegressor
        from sklearn.gaussian_process.kernels import ConstantKernel, Matern, WhiteKernel

        self.obs = list(obs)
        y = np.array([o.log_score for o in obs], dtype=float)
        self.mean = mean if mean is not None else (float(y.mean()) if len(y) else 0.0)
        self.prior_sd = max(float(y.std()) if len(y) > 1 else 0.0, 0.25)  # before data say otherwise, configurations differ by tens of percent
        X = self.encoder.rows([o.params for o in obs])
        fixed = kernel is not None or len(obs) < MIN_FIT
        if kernel is None:
            lengths = [1.0] * 4 + [2.0, 2.0] + [1.0] * (X.shape[1] - 6)
            kernel = (ConstantKernel(self.prior_sd**2, (1e-4, 4.0)) * Matern(lengths, (0.3, 30.0), nu=2.5)
                      + WhiteKernel(1e-3, (NOISE_FLOOR, 0.05)))
        alpha = np.array([max(o.noise_var, 0.0) for o in obs]) + 1e-8
        self.gp = GaussianProcessRegressor(kernel, alpha=alpha, optimizer=None if fixed else "fmin_l_bfgs_b", random_state=self.seed)
        with warnings.catch_warnings(), one_thread():
            warnings.simplefilter("ignore")  # a hyperparameter at its bound is fine here
            self.gp.fit(X, y - self.mean)
        return self

    @property
    def kernel(self):
        return self.gp.kernel_

    @property
    def noise_var(self) -> float:
        """The fitted variance of one measurement (log units)."""
        return max(float(self.gp.kernel_.k2.noise_level), NOISE_FLOOR)

    def latent(self, X: np.ndarray, return_cov: bool = False):
        """The latent (noise-free) posterior: the white-noise part is taken out of the GP's prediction."""
        with warnings.catch_warnings(), one_thread():
            warnings.simplefilter("ignore")
            out = self.gp.predict(X, return_cov=return_cov) if return_cov else self.gp.predict(X, return_std=True)
        mu, second = out
        white = float(self.gp.kernel_.k2.noise_level)
        if return_cov:
            cov = second - white * np.eye(len(X))
            return mu + self.mean, cov
        return mu + self.mean, np.sqrt(np.maximum(second**2 - white, 1e-12))

    def predict(self, params: Sequence[Dict[str, Any]]) -> Tuple[np.ndarray, np.ndarray]:
        if not params:
            return np.zeros(0), np.zeros(0)
        return self.latent(self.encoder.rows(params))

    def joint(self, params: Sequence[Dict[str, Any]], n: int, rng: np.random.RandomState) -> np.ndarray:
        """n joint draws of the latent log scores (n x len(params))."""
        mu, cov = self.latent(self.encoder.rows(params), return_cov=True)
        cov = (cov + cov.T) / 2
        jitter = 1e-9
        while True:
            try:
                root = np.linalg.cholesky(cov + jitter * np.eye(len(params)))
                break
            except np.linalg.LinAlgError:
                jitter *= 10
        return mu + rng.standard_normal((n, len(params))) @ root.T

    def with_fantasies(self, params: Sequence[Dict[str, Any]]) -> "ThroughputModel":
        """The model with pending experiments taken as measured at their predicted mean (kriging
        believer): their own uncertainty and their neighbours' shrink; no mean moves."""
        if not params:
            return self
        mu, _ = self.predict(params)
        extra = [Observation(dict(p), float(m)) for p, m in zip(params, mu)]
        return ThroughputModel(self.encoder, self.seed).fit(self.obs + extra, kernel=self.gp.kernel_, mean=self.mean)


# ---- memory ---------------------------------------------------------------------------------------
KNOWN_SLOPE_SCALE = 0.15  # log2 units: the edge predicted from a measured per-sample growth
PRIOR_SLOPE_SCALE = 0.6  # ... from the prior slope (one micro-batch size measured)
BUFFER_KNOBS = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size")


def buffer_bytes(stage: int, knobs: Dict[str, Any], element_bytes: int) -> float:
    """DeepSpeed's communication buffers that the knobs size: the reduction bucket (two with
    overlap_comm), the all-gather bucket of stages 1-2 and stage 3's prefetch bucket."""
    total = float(knobs.get("reduce_bucket_size", 5e8)) * (2 if knobs.get("overlap_comm") else 1)
    if stage in (1, 2):
        total += float(knobs.get("allgather_bucket_size", 5e8))
    if stage == 3:
        total += float(knobs.get("stage3_prefetch_bucket_size", 5e7))
    return total * element_bytes


class FitModel:
    """P(fits) for configurations, from the memory model, the knobs' buffers and every run and OOM."""

    def __init__(self, plan, memory: Optional[MemoryModel], runs: Sequence[Any]):
        self.plan, self.memory = plan, memory
        self.element_bytes = 2 if memory is not None and memory.half else 4
        self.slope_measured = memory is not None and memory.per_sample_measured()
        self.ok_at: Dict[tuple, int] = {}  # stage+knobs -> largest micro-batch that ran
        self.oom_at: Dict[tuple, int] = {}  # stage+knobs -> smallest micro-batch that ran out of memory
        self.residual: Dict[tuple, List[float]] = {}  # stage+knobs -> measured peak minus the prior's prediction
        self.ooms: List[Tuple[int, float, int, tuple]] = []  # (stage, buffer bytes, micro-batch, savers) of every OOM
        for m in runs:
            key = _group(m.params)
            mbs = m.params["micro_batch"]
            if m.result.status == "ok":
                self.ok_at[key] = max(self.ok_at.get(key, 0), mbs)
                peak = m.result.metrics.get("peak_memory_bytes")
                if peak and memory is not None and memory.fixed is not None:
                    self.residual.setdefault(key, []).append(float(peak) - self._prior_peak(m.params))
            elif m.result.status == "oom":
                self.oom_at[key] = min(self.oom_at.get(key, mbs), mbs)
                self.ooms.append((m.params["stage"], self._buffers(m.params), mbs, tuple(sorted(savers_of(m.params)))))
        self.largest_ok = max([0, *self.ok_at.values()])
        self._edges: Dict[tuple, Optional[float]] = {}
        self._curves: Dict[tuple, tuple] = {}
        self._bounds: Dict[int, Tuple[float, float]] = {}
        # a run with a saver says nothing of the plain curve's edges (its own OOMs bound its own group: oom_at)
        self.outcomes = [(m.params, m.result.status) for m in runs if m.result.status in ("ok", "oom") and not savers_of(m.params)]

    def _buffers(self, params: Dict[str, Any]) -> float:
        return buffer_bytes(params["stage"], knobs_of_params(params), self.element_bytes)

    def _shift(self, params: Dict[str, Any]) -> float:
        stage = params["stage"]
        knobs = knobs_of_params(params)
        return buffer_bytes(stage, knobs, self.element_bytes) - buffer_bytes(stage, base_knobs(self.plan, stage), self.element_bytes)

    def _prior_peak(self, params: Dict[str, Any]) -> float:
        return self.memory.predict(params["stage"], params["micro_batch"], savers_of(params)) + self._shift(params)

    def edge(self, params: Dict[str, Any]) -> Optional[float]:
        """The largest micro-batch predicted to fit with these knobs (None: no memory model or no limit)."""
        key = _group(params)
        if key not in self._edges:
            self._edges[key] = self._edge(params)
        return self._edges[key]

    def _edge(self, params: Dict[str, Any]) -> Optional[float]:
        """The stage's default-knob edge (the memory model's, kept between the sizes that ran and those
        that ran out of memory in this stage, with any knobs) less this knob set's extra memory in samples."""
        mem = self.memory
        if mem is None or mem.limit is None or mem.fixed is None or not mem.per_sample:
            return None
        stage = params["stage"]
        if savers_of(params):  # a saver's own curve (memory.py) less the knobs' buffers and its group's measured excess
            savers = savers_of(params)
            extra = self._shift(params) + float(np.mean(self.residual.get(_group(params), [0.0])))
            return float(mem.max_micro_batch(stage, savers=savers)) - extra / max(mem.per_sample_with(savers), 1.0)
        edge = float(mem.max_micro_batch(stage))
        lo, hi = self.stage_bounds(stage)
        edge = min(max(edge, lo), hi - 1)
        edge -= self._offset(params)
        if not self.slope_measured:
            edge = min(edge, 4 * max(self.largest_ok, 1))
        return float(edge)

    def _offset(self, params: Dict[str, Any]) -> float:
        """This knob set's memory above the stage's default knobs, in samples (buffers, then the peaks measured with it)."""
        if knobs_of_params(params) == base_knobs(self.plan, params["stage"]):
            return 0.0
        extra = self._shift(params) + float(np.mean(self.residual.get(_group(params), [0.0])))
        return extra / self.memory.per_sample

    def stage_bounds(self, stage: int) -> Tuple[float, float]:
        """(largest, smallest) default-knob-equivalent micro-batch seen to fit / to run out of memory in the
        stage, or in a stage that keeps at least as much per rank (an OOM) / no more (a fit)."""
        if stage not in self._bounds:
            lo, hi = 0.0, math.inf
            states = self.memory.model_states
            for params, status in self.outcomes:
                u = params["micro_batch"] + self._offset(params)
                if status == "ok" and states(stage) <= states(params["stage"]):  # fits where it keeps no more per rank
                    lo = max(lo, u)
                elif status == "oom" and states(stage) >= states(params["stage"]):  # and runs out where it keeps no less
                    hi = min(hi, u)
            self._bounds[stage] = (lo, max(hi, lo + 1))
        return self._bounds[stage]

    def p_fit(self, params: Dict[str, Any]) -> float:
        return self.p_fits(params, [params["micro_batch"]])[0]

    def p_fits(self, params: Dict[str, Any], sizes: Sequence[int]) -> List[float]:
        """P(fits) of these params' stage and knobs at each micro-batch size."""
        key = _group(params)
        if key not in self._curves:
            self._curves[key] = self._curve(params, key)
        fits_up_to, fails_from, edge, scale = self._curves[key]
        out = []
        for mbs in sizes:
            if mbs <= fits_up_to:
                out.append(1.0)
            elif mbs >= fails_from:
                out.append(0.0)
            elif edge is None:
                out.append(0.9 if self.oom_at else 1.0)
            elif edge < 1:
                out.append(0.0 if self.slope_measured and edge <= 0 else 0.05)
            else:
                z = (math.log2(mbs) - math.log2(edge + 0.5)) / scale
                out.append(1.0 / (1.0 + math.exp(min(max(z, -50.0), 50.0))))
        return out

    def _curve(self, params: Dict[str, Any], key: tuple) -> Tuple[int, float, Optional[float], float]:
        """(largest size known to fit, smallest known not to, the predicted edge, the logistic's scale)."""
        buffers = self._buffers(params)
        savers = tuple(sorted(savers_of(params)))
        fails = [at for stage, b, at, s in self.ooms if stage == params["stage"] and buffers >= b and s == savers]  # an OOM with no more buffers
        fails_from = min([self.oom_at.get(key, math.inf), *fails])
        return self.ok_at.get(key, 0), fails_from, self.edge(params), KNOWN_SLOPE_SCALE if self.slope_measured else PRIOR_SLOPE_SCALE


def _group(params: Dict[str, Any]) -> tuple:
    return tuple(sorted((k, v) for k, v in params.items() if k not in ("micro_batch", "gas")))
