"""The tempered sampler (search/smc.py): evidence in the prior's far tail keeps many draws."""

import numpy as np
import pytest
from scipy.special import log_ndtr
from scipy.stats import norm

from mlautotune.search import smc

DRAWS = 2048


def _tail_case(edge: float):
    """One grid value, a standard normal prior, and evidence that x is above `edge` (a soft step)."""
    mean, root = np.zeros((1, 1)), np.ones((1, 1, 1))
    return np.zeros(1), mean, root, lambda g, theta: log_ndtr((theta[:, 0] - edge) / 0.05)


def test_evidence_in_the_tail_is_followed_by_many_draws_not_one():
    log_prior, mean, root, loglik = _tail_case(3.0)
    rng = np.random.RandomState(0)
    plain = rng.standard_normal(DRAWS)
    assert smc.ess(loglik(None, plain[:, None])) < 20, "importance weights of prior draws collapse here"
    g, theta, w = smc.draw(log_prior, mean, root, loglik, DRAWS, np.random.RandomState(1))
    exact = norm.pdf(3.0) / norm.sf(3.0)  # the mean of a normal above 3 (the soft step moves it little)
    assert 1.0 / np.sum(w**2) > 300 and len(np.unique(theta[:, 0])) > 300, "many draws, and not copies of a few"
    assert float(w @ theta[:, 0]) == pytest.approx(exact, abs=0.06)
    assert float(w @ (theta[:, 0] < 3.0)) < 0.15


def test_without_strong_evidence_the_draws_are_the_prior_s():
    log_prior = np.log(np.array([0.25, 0.75]))
    mean = np.array([[0.0], [10.0]])
    root = np.ones((2, 1, 1))
    g, theta, w = smc.draw(log_prior, mean, root, lambda g, t: np.zeros(len(g)), DRAWS, np.random.RandomState(2))
    assert float(w @ (g == 1)) == pytest.approx(0.75, abs=0.03)
    assert float(w @ theta[:, 0]) == pytest.approx(7.5, abs=0.2)


def test_the_grid_choice_follows_the_evidence():
    """Two grid values, the evidence fits the less likely one only: the draws move to it."""
    log_prior = np.log(np.array([0.9, 0.1]))
    mean = np.array([[0.0], [4.0]])
    root = np.ones((2, 1, 1))
    g, theta, w = smc.draw(log_prior, mean, root, lambda g, t: log_ndtr((t[:, 0] - 3.5) / 0.05), DRAWS, np.random.RandomState(3))
    assert float(w @ (g == 1)) > 0.9
