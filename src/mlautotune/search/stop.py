"""The stop rule: the search ends when the probability that one more measurement shows another
configuration better than the incumbent by more than `margin` falls below search.stop_probability
(or when the budget, tuner_num_trials, ends: the tuner's).

For an untried configuration that is the probability that its true value is that much better:
joint draws of the model's latent values (correlated: configurations that share a stage and
nearby sizes move together), each counted only in the draws where it also fits (P(fits) from the
memory model); only the TOP untried ones by their upper bound are drawn, the others cannot change
the answer. For a measured one it is what a re-measurement can tell: the probability that its
posterior mean, after one more draw, passes the incumbent's by the margin. A near-tie keeps the
search open while one more measurement of it may still decide; one far behind does not.
"""

import math
from typing import Any, Dict, List, Sequence

import numpy as np

from mlautotune.search.model import ThroughputModel, one_thread

DRAWS = 256
TOP = 120


def p_beaten(model: ThroughputModel, incumbent: Dict[str, Any], untried: List[Dict[str, Any]], p_fit: Sequence[float],
             measured: List[Dict[str, Any]], margin: float, rng: np.random.RandomState) -> float:
    """P(one more measurement shows a configuration of `untried` (that fits) or of `measured` more than
    `margin` better than `incumbent`)."""
    threshold = math.log1p(margin)
    p_untried = 0.0
    if untried:
        p_fit = np.asarray(p_fit, dtype=float)
        mu, sd = model.predict(untried)
        keep = np.argsort(-(mu + 2 * sd))[:TOP]
        with one_thread():
            draws = model.joint([incumbent] + [untried[i] for i in keep], DRAWS, rng)
        fits = rng.random_sample((DRAWS, len(keep))) < p_fit[keep]
        p_untried = float(((draws[:, 1:] - draws[:, :1] > threshold) & fits).any(axis=1).mean())
    p_none = 1.0 - p_untried
    if measured:
        from scipy.stats import norm

        (mu_inc,), _ = model.predict([incumbent])
        mu, sd = model.predict(measured)
        moved = sd**2 / np.sqrt(sd**2 + model.noise_var)  # how far one more draw moves each posterior mean
        p_none *= float(np.prod(1.0 - norm.sf((threshold - (mu - mu_inc)) / np.maximum(moved, 1e-12))))
    return 1.0 - p_none
