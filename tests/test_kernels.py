"""The throughput model's kernel part where knob effects add up (search/kernels.py). Pure logic."""

import math

import numpy as np

from mlautotune.search.kernels import KnobsAdd
from mlautotune.search.model import Encoder, Observation, ThroughputModel


def test_the_kernel_counts_the_knobs_set_alike_times_one_amplitude():
    X = np.array([[9.0, 0.0, 1.0, 0.5], [7.0, 0.0, 1.0, 1.0], [9.0, 1.0, 0.0, 0.5]])
    K = KnobsAdd([1, 2, 3], amplitude=0.5)(X)
    alike = np.array([[3, 2, 1], [2, 3, 0], [1, 0, 3]])  # column 0 is not a knob: ignored
    assert np.allclose(K, 0.5 * alike)
    assert np.allclose(KnobsAdd([1, 2, 3], amplitude=0.5).diag(X), np.diag(K))
    assert np.allclose(KnobsAdd([1, 2, 3], amplitude=0.5)(X[:1], X[1:]), 0.5 * alike[:1, 1:])


def test_the_kernels_gradient_is_the_derivative_by_the_log_amplitude():
    X = np.random.default_rng(0).integers(0, 3, size=(6, 4)) / 2.0
    k = KnobsAdd([0, 1, 2, 3], amplitude=0.01)
    K, grad = k(X, eval_gradient=True)
    step = 1e-6
    numeric = (k.clone_with_theta(k.theta + step)(X) - K) / step
    assert grad.shape == (6, 6, 1) and np.allclose(grad[:, :, 0], numeric, atol=1e-8)


def test_the_model_has_the_part_over_exactly_the_knob_columns():
    """Every knob column (and no size, stage or pressure column) is in the part where knob effects add
    up, and the fitted model keeps it (its amplitude fitted, within its bounds)."""
    knobs = {"overlap_comm": [True, False], "reduce_bucket_size": [50_000_000, 500_000_000]}
    encoder = Encoder(knobs)

    def p(mbs, oc, rb):
        return {"stage": 2, "micro_batch": mbs, "gas": 1, "overlap_comm": oc, "reduce_bucket_size": rb}

    obs = [Observation(p(m, oc, rb), math.log(10.0 * m * (1.1 if oc else 1.0) * (1.1 if rb < 1e8 else 1.0)), 1e-4)
           for m in (1, 2, 4) for oc in (True, False) for rb in (50_000_000, 500_000_000)]
    model = ThroughputModel(encoder, 0).fit(obs)
    parts = [k for k in _parts(model.kernel) if isinstance(k, KnobsAdd)]
    assert len(parts) == 1
    width = model.X([obs[0].params]).shape[1]
    knob_columns = [i for i, name in enumerate(_columns(encoder)) if name in knobs]
    assert parts[0].columns == knob_columns and width == len(_columns(encoder))
    assert parts[0].amplitude_bounds[0] < parts[0].amplitude < parts[0].amplitude_bounds[1]


def _columns(encoder):
    return ["stage0", "stage1", "stage2", "stage3", "micro_batch", "gas", *encoder.knobs, "pressure"]


def _parts(kernel):
    for name in ("k1", "k2"):
        if hasattr(kernel, name):
            yield from _parts(getattr(kernel, name))
    yield kernel
