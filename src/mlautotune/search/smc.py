"""Draws from a posterior that a prior and a likelihood define, by tempered resample-move.

The prior is a discrete choice g (a grid value, with log weights) and, given g, a Gaussian: theta =
mean[g] + root[g] z, z standard normal, root a Cholesky factor. Importance weights of prior draws
collapse onto one draw once the evidence lies in the prior's tail (twenty OOMs where the formula
says fits), and a posterior of one draw says every probability is 0 or 1. So the likelihood is taken in by steps: each step raises
its exponent as far as keeps half the draws' worth (the effective sample size), resamples, and moves
every draw by a few Metropolis steps that leave that step's posterior unchanged: a
preconditioned Crank-Nicolson step of z and a step of g to a neighbour.
"""

from typing import Callable, Tuple

import numpy as np

MOVES = 4  # Metropolis steps per tempering step
MAX_STEPS = 40  # tempering steps at most (the exponent then jumps to 1)
KEEP = 0.5  # each step keeps this share of the draws' effective sample size


def ess(log_w: np.ndarray) -> float:
    w = np.exp(log_w - log_w.max())
    return float(w.sum() ** 2 / (w**2).sum())


def draw(log_prior: np.ndarray, mean: np.ndarray, root: np.ndarray, loglik: Callable[[np.ndarray, np.ndarray], np.ndarray],
         draws: int, rng: np.random.RandomState) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(g, theta, normalised weights) of `draws` draws from prior x likelihood. log_prior: G;
    mean: G x P; root: G x P x P; loglik(g, theta) -> the log likelihood of each draw."""
    G = len(log_prior)
    p = np.exp(log_prior - log_prior.max())
    g = rng.choice(G, size=draws, p=p / p.sum())
    z = rng.standard_normal((draws, mean.shape[1]))

    def theta_of(g, z):
        return mean[g] + np.einsum("npq,nq->np", root[g], z)

    theta = theta_of(g, z)
    ll = loglik(g, theta)
    phi, log_w, beta = 0.0, np.zeros(draws), 0.5
    for _ in range(MAX_STEPS):
        step = 1.0 - phi
        if ess(step * ll) < KEEP * draws:
            lo, hi = 0.0, step
            for _ in range(30):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if ess(mid * ll) >= KEEP * draws else (lo, mid)
            step = max(lo, 1e-12)
        phi, log_w = phi + step, step * ll
        if phi >= 1.0 - 1e-12 and ess(log_w) >= KEEP * draws:
            break
        keep = _resample(log_w, rng)
        g, z, theta, ll, log_w = g[keep], z[keep], theta[keep], ll[keep], np.zeros(draws)
        accepted = 0
        for _ in range(MOVES):
            g2 = g + rng.choice([-1, 0, 1], size=draws)
            inside = (g2 >= 0) & (g2 < G)  # a step off the grid is refused (clipping would favour its ends)
            g2 = np.clip(g2, 0, G - 1)
            z2 = np.sqrt(1 - beta**2) * z + beta * rng.standard_normal(z.shape)
            theta2 = theta_of(g2, z2)
            ll2 = loglik(g2, theta2)
            log_a = log_prior[g2] - log_prior[g] + phi * (ll2 - ll)  # the pCN step keeps z's prior: only these are left
            take = inside & (np.log(rng.uniform(size=draws)) < log_a)
            g, ll = np.where(take, g2, g), np.where(take, ll2, ll)
            z, theta = np.where(take[:, None], z2, z), np.where(take[:, None], theta2, theta)
            accepted += take.mean()
        beta = float(np.clip(beta * (1.5 if accepted / MOVES > 0.4 else 0.6), 0.02, 1.0))
        if phi >= 1.0 - 1e-12:
            break
    else:
        log_w = (1.0 - phi) * ll + log_w  # out of steps: the rest of the likelihood as weights
    w = np.exp(log_w - log_w.max())
    return g, theta, w / w.sum()


def _resample(log_w: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
    """Systematic resampling: indices of draws, each as often as its weight says."""
    w = np.exp(log_w - log_w.max())
    c = np.cumsum(w / w.sum())
    n = len(w)
    return np.minimum(np.searchsorted(c, (rng.uniform() + np.arange(n)) / n), n - 1)
