"""The stop rule: the search ends when the probability that any other configuration, untried or
measured, beats the incumbent by more than `margin` falls below `threshold` (or when the budget,
tuner_num_trials, ends: the tuner's).

The probability comes from joint draws of the model's latent values (correlated: configurations
that share a stage and nearby sizes move together), each candidate counted only in the draws where
it also fits (P(fits) from the memory model). Only the candidates most likely to matter are drawn:
the measured ones and the `top` untried ones by their upper bound.
"""

import math
from typing import Any, Dict, List, Sequence

import numpy as np

from mlautotune.search.model import ThroughputModel, one_thread

DRAWS = 256
TOP = 120


def p_beaten(model: ThroughputModel, incumbent: Dict[str, Any], others: List[Dict[str, Any]], p_fit: Sequence[float],
             margin: float, rng: np.random.RandomState) -> float:
    """P(some configuration in `others` is more than `margin` better than `incumbent`)."""
    if not others:
        return 0.0
    p_fit = np.asarray(p_fit, dtype=float)
    mu, sd = model.predict(others)
    upper = mu + 2 * sd
    keep = np.argsort(-upper)[:TOP]
    with one_thread():
        draws = model.joint([incumbent] + [others[i] for i in keep], DRAWS, rng)
    fits = rng.random_sample((DRAWS, len(keep))) < p_fit[keep]
    beats = (draws[:, 1:] - draws[:, :1] > math.log1p(margin)) & fits
    return float(beats.any(axis=1).mean())
