"""The search's probabilistic model of throughput, with its uncertainty.

Throughput: a Gaussian process (scikit-learn) on the log of the score (higher is better whatever
the metric), fitted on every measurement of every stage, re-measurements included, each as its own
noisy observation. Inputs: the stage (one-hot), log2 of the micro-batch and of the gradient
accumulation, each knob scaled to 0..1 over its values, and the memory pressure: -log of the free
share of memory that fits.py predicts (`headroom`), so that near the limit, where a run's speed
changes fast with the fill, configurations are far apart. The kernel (`kernel_of`) adds three ARD
Matern 5/2 parts, the stage and sizes', the pressure's alone and the knobs', a part where each knob
value's own effect adds up (kernels.py), and white noise. With an earlier session's measurements (a warm
start, warm.py), a last input column flags them, and one more part, the discrepancy, exists between
them only. The hyperparameters are fitted by their posterior mode once five measurements exist
(fixed, broad ones before): the marginal likelihood times a log-normal prior around the broad
ones, so that a few points cannot make the model sure that something does not matter; each fit
starts from the last. A measurement's own
interval, where the probe gave one, is added to its noise. A configuration nobody measured has
the prior's mean and spread: an unseen stage is uncertain, not bad.

The risk of running out of memory is fits.py's.
"""

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np


MIN_FIT = 5  # measurements before the kernel's hyperparameters are fitted
MAX_ITERATIONS = 30
NOISE_FLOOR = 1e-4  # variance of one measurement in log units: at least 1% (sd)
Z95 = 1.96
HEADROOM_FLOOR = 0.05  # the free share's floor: fits.py's predicted fill is not finer than a few percent (PEAK_SD, ALLOCATOR_SLACK)
KNOB_FLOOR = 0.2  # the knobs' part keeps at least this sd (log units): a few runs cannot say that knobs do not matter;
# 0.2 rather than 0.1 reaches 99% on more generated landscapes, held-out seeds too (benchmarks/generator.md)
IGNORED = 1e5  # the length scale of a column a kernel part does not look at
SCALES = (0.3, 30.0)  # the bounds of a length scale that is fitted
EFFECT_SD = 0.05  # prior sd of each knob value's own effect (log units), in the part where knob effects add up
PRIOR_LOG_SD = 1.0  # the hyperparameters' prior: log-normal around kernel_of's values, this wide (a factor of e)


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


def _lbfgs(obj_func, initial_theta, bounds):
    """L-BFGS-B from the starting hyperparameters, at most MAX_ITERATIONS steps (started from the
    previous fit's, a few steps suffice)."""
    from scipy.optimize import minimize

    result = minimize(obj_func, initial_theta, method="L-BFGS-B", jac=True, bounds=bounds, options={"maxiter": MAX_ITERATIONS})
    return result.x, result.fun


def _map(prior_theta: np.ndarray):
    """The hyperparameters' fit: the posterior mode (MAP), not the marginal likelihood's maximum. Each
    hyperparameter but the white noise (the last: the measurements say how noisy they are) has a
    normal prior on its log, centred on `prior_theta` with sd PRIOR_LOG_SD: a handful of
    measurements cannot make the model sure that stages, sizes or knobs do not matter (an amplitude
    or a length scale driven to its bound), which then steers the search away from what it has not
    measured."""
    weight = np.ones(len(prior_theta))
    weight[-1] = 0.0

    def optimizer(obj_func, initial_theta, bounds):
        def objective(theta):
            value, grad = obj_func(theta)
            z = weight * (theta - prior_theta) / PRIOR_LOG_SD
            return value + 0.5 * float(z @ z), grad + weight * z / PRIOR_LOG_SD
        return _lbfgs(objective, initial_theta, bounds)
    return optimizer


def headroom(fill: float) -> float:
    """The memory-pressure input: -log of the free share of the device's memory (at least HEADROOM_FLOOR),
    so that near the limit, where a run's speed changes fast with the fill, configurations are far apart."""
    return -math.log(max(1.0 - fill, HEADROOM_FLOOR))


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
    earlier: bool = False  # an earlier session's measurement (warm start): today's value plus the discrepancy part


class ThroughputModel:
    """A GP over log(score): `predict` gives the latent mean and sd."""

    def __init__(self, encoder: Encoder, seed: int = 0, pressure: Optional[Callable[[Dict[str, Any]], float]] = None,
                 discrepancy: float = 0.0):
        """`discrepancy`: the prior variance of how an earlier session's landscape differs from today's,
        a smooth part of its own (kernel_of) between the observations that are `earlier`."""
        self.encoder, self.seed = encoder, seed
        self.pressure = pressure or (lambda p: 0.0)
        self.gp = None
        self.mean = 0.0
        self.prior_sd = 0.5
        self.discrepancy = discrepancy
        self.flagged = False  # fitted on earlier observations: the flag column and the discrepancy part are in

    def fit(self, obs: List[Observation], kernel=None, mean: Optional[float] = None, start=None) -> "ThroughputModel":
        """Fit on the observations; with `kernel` (and `mean`) given, those are kept, not fitted; with
        `start` (an earlier fit's kernel), its hyperparameters are where the fit starts."""
        from sklearn.gaussian_process import GaussianProcessRegressor
        from sklearn.gaussian_process.kernels import WhiteKernel

        self.obs = list(obs)
        y = np.array([o.log_score for o in obs], dtype=float)
        self.mean = mean if mean is not None else (float(y.mean()) if len(y) else 0.0)
        self.prior_sd = max(float(y.std()) if len(y) > 1 else 0.0, 0.25)  # before data say otherwise, configurations differ by tens of percent
        self.flagged = bool(self.discrepancy) and any(o.earlier for o in obs)
        X = self.X([o.params for o in obs], [o.earlier for o in obs])
        optimizer = None
        if kernel is None:
            prior = self.kernel_of(X.shape[1]) + WhiteKernel(1e-3, (NOISE_FLOOR, 0.05))
            kernel = start if start is not None and len(start.theta) == len(prior.theta) else prior
            optimizer = _map(prior.theta) if len(obs) >= MIN_FIT else None
        alpha = np.array([max(o.noise_var, 0.0) for o in obs]) + 1e-8
        self.gp = GaussianProcessRegressor(kernel, alpha=alpha, optimizer=optimizer, random_state=self.seed)
        with warnings.catch_warnings(), one_thread():
            warnings.simplefilter("ignore")  # a hyperparameter at its bound is fine here
            self.gp.fit(X, y - self.mean)
        return self

    def X(self, params: Sequence[Dict[str, Any]], earlier: Optional[Sequence[bool]] = None) -> np.ndarray:
        """The inputs: the encoder's columns, then the memory pressure (`headroom` of the predicted fill),
        and, with earlier observations, whether a row is one (today's configurations are not)."""
        pressure = np.array([[headroom(self.pressure(p))] for p in params], dtype=float).reshape(len(params), 1)
        X = np.hstack([self.encoder.rows(params), pressure])
        if not self.flagged:
            return X
        flag = np.array(earlier if earlier is not None else [False] * len(params), dtype=float).reshape(len(params), 1)
        return np.hstack([X, flag])

    def kernel_of(self, width: int):
        """Parts that add up (log throughput = what the stage and sizes give + what the memory pressure
        gives + what the knobs give together + what each knob value gives on its own), so that a knob's
        effect measured at one micro-batch carries to the others, and a slowdown seen where memory is
        nearly full carries to every configuration that fills it as much. The stage-and-sizes part and
        the knobs' have their own amplitude and ARD length scales; the stage enters both, so knobs may
        act differently by stage. The pressure's part looks at the pressure alone: how full memory is
        slows a step the same way whatever fills it (with the pressure among the sizes' inputs, the
        fit read a drop near the edge as the micro-batch's, and expected it a size below too). The
        last (kernels.py) carries each knob value's effect to knob sets far from every one that ran,
        where the knobs' Matern part, a distance between knob sets, forgets it. A column a part
        ignores has a fixed, huge length scale."""
        from sklearn.gaussian_process.kernels import ConstantKernel, Matern

        from mlautotune.search.kernels import Both, KnobsAdd

        knobs = width - 7 - (1 if self.flagged else 0)  # the columns: stage one-hot, sizes, knobs, pressure, [earlier flag]
        stage = {i: (1.0, SCALES) for i in range(4)}
        stage_sizes = {**stage, 4: (2.0, SCALES), 5: (2.0, SCALES)}
        knob_columns = {i: (1.0, SCALES) for i in range(6, 6 + knobs)}
        pressure = {6 + knobs: (0.3, (0.05, 30.0))}

        def matern(looks: Dict[int, Tuple[float, Tuple[float, float]]]):
            """A Matern 5/2 over these columns ({column: (length scale, bounds)}); every other one is ignored."""
            ignored = (IGNORED, (IGNORED, IGNORED * (1 + 1e-6)))
            return Matern([looks.get(i, ignored)[0] for i in range(width)], [looks.get(i, ignored)[1] for i in range(width)], nu=2.5)

        def part(variance):
            return ConstantKernel(variance, (1e-4, 4.0))

        kernel = part(self.prior_sd**2) * matern(stage_sizes) + part(self.prior_sd**2) * matern(pressure)
        if knobs:
            knob = ConstantKernel(max((self.prior_sd / 2) ** 2, KNOB_FLOOR**2), (KNOB_FLOOR**2, 1.0)) * matern({**stage, **knob_columns})
            kernel = kernel + knob + KnobsAdd(list(knob_columns), EFFECT_SD**2)
        if self.flagged:  # earlier sessions: their landscape is today's plus a smooth discrepancy over stages, sizes and memory pressure
            kernel = kernel + ConstantKernel(self.discrepancy, (1e-5, 1.0)) * matern({**stage_sizes, **pressure}) * Both(width - 1)
        return kernel

    @property
    def kernel(self):
        return self.gp.kernel_

    @property
    def noise_var(self) -> float:
        """The fitted variance of one measurement (log units)."""
        return max(self._white, NOISE_FLOOR)

    def _gp_predict(self, X: np.ndarray, **kw):
        with warnings.catch_warnings(), one_thread():
            warnings.simplefilter("ignore")
            return self.gp.predict(X, **kw)

    def latent(self, X: np.ndarray):
        """The latent (noise-free) posterior: the white-noise part is taken out of the GP's prediction."""
        mu, sd = self._gp_predict(X, return_std=True)
        return mu + self.mean, np.sqrt(np.maximum(sd**2 - self._white, 1e-12))

    def correlation(self, X: np.ndarray) -> np.ndarray:
        """The latent posterior's correlation between these rows of inputs (the white noise taken out)."""
        _, cov = self._gp_predict(X, return_cov=True)
        cov = cov - self._white * np.eye(len(X))
        sd = np.sqrt(np.maximum(np.diag(cov), 1e-12))
        return np.clip(cov / np.outer(sd, sd), -1.0, 1.0)

    @property
    def _white(self) -> float:
        return float(self.gp.kernel_.k2.noise_level)

    def predict(self, params: Sequence[Dict[str, Any]]) -> Tuple[np.ndarray, np.ndarray]:
        if not params:
            return np.zeros(0), np.zeros(0)
        return self.latent(self.X(params))

    def with_fantasies(self, params: Sequence[Dict[str, Any]]) -> "ThroughputModel":
        """The model with pending experiments taken as measured at their predicted mean (kriging
        believer): their own uncertainty and their neighbours' shrink; no mean moves."""
        if not params:
            return self
        mu, _ = self.predict(params)
        extra = [Observation(dict(p), float(m)) for p, m in zip(params, mu)]
        return ThroughputModel(self.encoder, self.seed, self.pressure, self.discrepancy).fit(self.obs + extra, kernel=self.gp.kernel_, mean=self.mean)
