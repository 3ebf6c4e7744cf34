"""The throughput model's own kernel parts (model.py). `Both` flags the rows of an earlier session's
measurements, so that the discrepancy part exists between those rows only.

`KnobsAdd`, the part where knob effects add up: each value of each knob
has its own effect, the same at every stage, size and other knob. As a kernel,
k(x, x') = a x (the number of knobs x and x' set alike), one amplitude `a` for all. A knob a stage
lacks reads as its lowest value; the stage's own level, in the model's main part, takes that up.

The model's Matern part over the knobs is a distance between knob sets: what it learned fades with
the number of knobs that differ. This part carries what one knob value did, measured with any
others, to every knob set, however far from what ran: a knob set of each knob's best value is
predicted near their sum, and a knob set unlike any that ran keeps a wide interval."""

from typing import List

import numpy as np
from sklearn.gaussian_process.kernels import Hyperparameter, Kernel


class KnobsAdd(Kernel):
    """k(x, x') = amplitude x the number of `columns` where x and x' are equal."""

    def __init__(self, columns: List[int], amplitude: float = 0.0025, amplitude_bounds=(1e-6, 0.25)):
        self.columns = columns
        self.amplitude = amplitude
        self.amplitude_bounds = amplitude_bounds

    @property
    def hyperparameter_amplitude(self):
        return Hyperparameter("amplitude", "numeric", self.amplitude_bounds)

    def _alike(self, X, Y):
        A = np.asarray(X, dtype=float)[:, self.columns]
        B = np.asarray(Y, dtype=float)[:, self.columns]
        return (np.abs(A[:, None, :] - B[None, :, :]) < 1e-9).sum(axis=2).astype(float)

    def __call__(self, X, Y=None, eval_gradient=False):
        K = self.amplitude * self._alike(X, X if Y is None else Y)
        if not eval_gradient:
            return K
        if Y is not None:
            raise ValueError("the gradient is only defined for K(X, X)")
        grad = np.empty((len(K), len(K), 0)) if self.hyperparameter_amplitude.fixed else K[:, :, np.newaxis]
        return K, grad  # d K / d log(amplitude) = K

    def diag(self, X):
        return np.full(len(X), self.amplitude * len(self.columns))

    def is_stationary(self):
        return False

    def __repr__(self):
        return f"KnobsAdd(amplitude={self.amplitude:.3g}, columns={len(self.columns)})"


class Both(Kernel):
    """k(x, x') = x[column] x x'[column]: with a 0/1 column, 1 where both rows are flagged (the earlier
    sessions' observations, model.py), so the part it multiplies exists between those rows only."""

    def __init__(self, column: int):
        self.column = column

    def __call__(self, X, Y=None, eval_gradient=False):
        a = np.asarray(X, dtype=float)[:, self.column]
        b = a if Y is None else np.asarray(Y, dtype=float)[:, self.column]
        K = np.outer(a, b)
        return (K, np.empty((len(a), len(a), 0))) if eval_gradient else K

    def diag(self, X):
        return np.asarray(X, dtype=float)[:, self.column] ** 2

    def is_stationary(self):
        return False

    def __repr__(self):
        return f"Both(column={self.column})"
