"""The stop rule: the search ends when the probability that one more measurement shows another
configuration better than the incumbent by more than `margin` falls below search.stop_probability
(or when the budget, tuner_num_trials, ends: the tuner's).

Untried and measured configurations are judged alike, by what one more measurement of each can
tell: whether its posterior mean, after one more draw, passes the incumbent's by the margin (a
draw moves the mean by a normal amount with sd sd^2 / sqrt(sd^2 + noise), as in the acquisition),
counted only where it fits (P(fits) from the memory model). A configuration the model knows little
about can move far, so it keeps the search open; a near-tie measured often, or an untried one the
model already places within noise of its neighbours, cannot, so a flat landscape ends the search.

The candidates are not independent: neighbours on the ladder, or knob sets that share most values,
rise and fall together under the model. The probability that any of them passes is estimated from
joint draws, each candidate's move correlated with the others' as their latent values are under the
posterior; whether each fits is drawn on its own. Candidates whose own chance is negligible are
added as if independent (they can only raise the estimate). The draws are needed only where the
answer is in doubt: the probability is at least the largest chance and at most the chances'
independent union, so where `threshold` lies outside those two it decides alone.
"""

import math
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

import numpy as np

from mlautotune.search.acquisition import moved_sd
from mlautotune.search.model import ThroughputModel

DRAWS = 2000  # joint draws: the estimate's sd is about 0.5% at a probability of 5%
NEGLIGIBLE = 1e-4  # a candidate's own chance below which it is not drawn jointly
JOINT_MAX = 400  # at most this many candidates are drawn jointly (those with the highest chance)


class Chance(NamedTuple):
    """The probability, or the bound that decided (`bound`: "at most" or "at least"; "" for the estimate)."""

    p: float
    bound: str = ""

    def __str__(self) -> str:
        return f"{self.bound + ' ' if self.bound else ''}{self.p:.1%}"


def p_beaten(model: ThroughputModel, incumbent: Dict[str, Any], untried: List[Dict[str, Any]], p_fit: Sequence[float],
             measured: List[Dict[str, Any]], margin: float, noise_var: float, threshold: Optional[float] = None) -> Chance:
    """P(one more measurement, with noise of variance `noise_var` in log units, shows a configuration
    of `untried` (that fits) or of `measured` more than `margin` better than `incumbent`). Where
    `threshold` is below the largest chance or above their independent union, that bound is returned
    (and said): it is on the same side of the threshold as the probability."""
    from scipy.stats import norm

    params = list(untried) + list(measured)
    if not params:
        return Chance(0.0)
    fits = np.concatenate([np.asarray(p_fit, dtype=float).reshape(len(untried)), np.ones(len(measured))])
    (mu_inc,), _ = model.predict([incumbent])
    X = model.X(params)
    mu, sd = model.latent(X)
    need = (math.log1p(margin) - (mu - mu_inc)) / moved_sd(sd, noise_var)  # standard moves that pass by the margin
    chance = fits * norm.sf(need)
    union = 1.0 - float(np.prod(1.0 - chance))
    if threshold is not None and chance.max() >= threshold:
        return Chance(float(chance.max()), "at least")
    if threshold is not None and union < threshold:
        return Chance(union, "at most")
    order = np.argsort(-chance)
    joint = [i for i in order[:JOINT_MAX] if chance[i] > NEGLIGIBLE]
    rest = np.setdiff1d(np.arange(len(params)), joint)
    p_rest = 1.0 - float(np.prod(1.0 - chance[rest]))
    if not joint:
        return Chance(p_rest)
    rng = np.random.default_rng(model.seed)
    corr = model.correlation(X[joint])
    w, v = np.linalg.eigh(corr)
    z = rng.standard_normal((DRAWS, len(joint))) @ (v * np.sqrt(np.maximum(w, 0.0))).T
    fit = rng.random((DRAWS, len(joint))) < fits[joint]
    p_joint = float(np.mean(np.any((z > need[joint]) & fit, axis=1)))
    return Chance(1.0 - (1.0 - p_joint) * (1.0 - p_rest))
