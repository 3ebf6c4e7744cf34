"""Optuna's GridSampler for ask/tell loops.

Optuna's GridSampler calls `study.stop()` in after_trial once the grid is exhausted, which is
only allowed inside `study.optimize`; with ask/tell it raises and leaves the trial RUNNING. The
search stops on exhaustion itself, so this subclass only drops that call. Order: every grid point
once, shuffled by the seed (stable for a given search.seed).
"""

import optuna


class GridSampler(optuna.samplers.GridSampler):
    def after_trial(self, study, trial, state, values) -> None:
        return None
