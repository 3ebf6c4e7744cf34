"""The stop rule: the search ends when the probability that one more measurement shows another
configuration better than the incumbent by more than `margin` falls below search.stop_probability
(or when the budget, tuner_num_trials, ends: the tuner's).

Untried and measured configurations are judged alike, by what one more measurement of each can
tell: the probability that its posterior mean, after one more draw, passes the incumbent's by the
margin (a draw moves the mean by a normal amount with sd sd^2 / sqrt(sd^2 + noise), as in the
acquisition), counted only where it fits (P(fits) from the memory model). A configuration the
model knows little about can move far, so it keeps the search open; a near-tie measured often, or
an untried one the model already places within noise of its neighbours, cannot, so a flat
landscape ends the search. The chances are taken as independent: the probability errs high.
"""

import math
from typing import Any, Dict, List, Sequence

import numpy as np

from mlautotune.search.acquisition import moved_sd
from mlautotune.search.model import ThroughputModel


def p_beaten(model: ThroughputModel, incumbent: Dict[str, Any], untried: List[Dict[str, Any]], p_fit: Sequence[float],
             measured: List[Dict[str, Any]], margin: float, noise_var: float) -> float:
    """P(one more measurement, with noise of variance `noise_var` in log units, shows a configuration
    of `untried` (that fits) or of `measured` more than `margin` better than `incumbent`)."""
    from scipy.stats import norm

    params = list(untried) + list(measured)
    if not params:
        return 0.0
    fits = np.concatenate([np.asarray(p_fit, dtype=float).reshape(len(untried)), np.ones(len(measured))])
    (mu_inc,), _ = model.predict([incumbent])
    mu, sd = model.predict(params)
    chance = fits * norm.sf((math.log1p(margin) - (mu - mu_inc)) / moved_sd(sd, noise_var))
    return float(1.0 - np.prod(1.0 - chance))
