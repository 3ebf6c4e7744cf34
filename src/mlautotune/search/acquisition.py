"""The acquisition: what one more experiment is worth, per second of experiment.

Every candidate is valued the same way, an untried configuration (a new size, a knob set, a stage
not yet seen) as much as a re-measurement of one already measured: the expected rise in the
declared optimum's value (in log score, so a relative gain) that one more measurement brings,
knowledge-gradient style. One measurement of a configuration with latent sd `sd` moves its
posterior mean by a normal amount with sd s = sd^2 / sqrt(sd^2 + noise); the declared optimum
rises by E[max(mu' - ref, 0)] = s h((mu - ref) / s), h(z) = z Phi(z) + phi(z). For any candidate
but the incumbent, ref is the incumbent's mean; for the incumbent, it is the runner-up's (measured
again, the incumbent may fall below it). A re-measurement counts only the rise beyond the stop
rule's margin (ref + log 1.01): what the search asks for is a configuration better by more than 1%,
so telling apart two measured ones that differ by less is worth almost nothing. An untried
configuration counts every rise: the search climbs to the best by steps that are often smaller than
1% each (a size between two measured ones, one knob more). `noise` is what one more measurement
brings: the model's white noise and the probe's own. A candidate whose 95% interval does not overlap
the incumbent's is worth nothing: a near-tie is worth re-measuring only while they overlap.

An OOM is a cost: it takes its launch and gives nothing. value per second = P(fits) x gain /
(P(fits) x seconds of a run + (1 - P(fits)) x seconds of an OOM).
"""

import math
from typing import Optional, Sequence

import numpy as np

from mlautotune.search.model import Z95


def _h(z: np.ndarray) -> np.ndarray:
    from scipy.stats import norm

    return z * norm.cdf(z) + norm.pdf(z)


def moved_sd(sd: np.ndarray, noise_var: float) -> np.ndarray:
    """How far one more measurement moves each posterior mean (the sd of the move): sd^2 / sqrt(sd^2 + noise)."""
    sd = np.asarray(sd, dtype=float)
    return np.maximum(sd**2 / np.sqrt(sd**2 + noise_var), 1e-12)


def gain(diff: np.ndarray, sd: np.ndarray, overlaps: np.ndarray, noise_var: float, margin: float = 0.0,
         measured: Optional[Sequence[bool]] = None) -> np.ndarray:
    """Expected rise of the declared optimum (log units) from one more measurement of each candidate,
    beyond `margin` (relative) for those `measured` already (all, when not given): `diff` is its mean
    minus the incumbent's (for the incumbent: the runner-up's mean minus its own), `sd` its latent sd,
    `overlaps` whether the two 95% intervals overlap."""
    diff = np.asarray(diff, dtype=float)
    again = np.ones(len(diff), dtype=bool) if measured is None else np.asarray(measured, dtype=bool)
    diff = diff - np.where(again, math.log1p(margin), 0.0)
    s = moved_sd(sd, noise_var)
    return np.where(np.asarray(overlaps, dtype=bool), s * _h(diff / s), 0.0)


def overlap(mu: np.ndarray, sd: np.ndarray, ref: np.ndarray, ref_sd: np.ndarray) -> np.ndarray:
    """Whether each 95% interval reaches the reference's (a candidate's upper end above its lower end)."""
    return np.asarray(mu) + Z95 * np.asarray(sd) > np.asarray(ref) - Z95 * np.asarray(ref_sd)


def per_second(g: np.ndarray, p_fit: Sequence[float], seconds_ok: Sequence[float], seconds_oom: Sequence[float]) -> np.ndarray:
    """Gain per expected second; an OOM's launch is spent for nothing."""
    p = np.asarray(p_fit, dtype=float)
    seconds = p * np.asarray(seconds_ok, dtype=float) + (1 - p) * np.asarray(seconds_oom, dtype=float)
    return p * g / np.maximum(seconds, 1e-9)


def relative(log_gain: float) -> float:
    return math.expm1(log_gain)
