"""Sharing one session between workers: once-only claims and heartbeats, on a real Optuna RDB storage."""

import time
from types import SimpleNamespace

import optuna
from optuna.trial import TrialState

from mlautotune.search.cluster import Heartbeat, claim_once, storage


def test_exactly_one_claim_per_session_and_purpose(tmp_path):
    first = storage(f"sqlite:///{tmp_path / 'optuna.db'}")
    second = storage(f"sqlite:///{tmp_path / 'optuna.db'}")  # another worker's connection
    assert claim_once(first, "s", "parent") is True
    assert claim_once(second, "s", "parent") is False
    assert claim_once(second, "s", "report@3") is True
    assert claim_once(first, "other-session", "parent") is True


def test_a_running_trial_stays_alive_while_it_beats_and_is_failed_once_its_worker_is_gone(tmp_path):
    store = storage(f"sqlite:///{tmp_path / 'optuna.db'}", heartbeat_s=1, grace_s=3)  # a beat may come 2 s late on a loaded host
    study = optuna.create_study(storage=store, study_name="s")
    trial = study.ask()
    beat = Heartbeat(store)
    exp = SimpleNamespace(name="z1_gas1_tmbspg4")
    beat.experiment_started(exp, trial)
    time.sleep(4.5)  # longer than the grace period: only the heartbeat keeps the trial alive
    optuna.storages.fail_stale_trials(study)
    assert study.trials[trial.number].state == TrialState.RUNNING
    beat.experiment_finished(exp, None, None)  # the worker stops beating, as a dead one would
    time.sleep(4.5)
    optuna.storages.fail_stale_trials(study)
    assert study.trials[trial.number].state == TrialState.FAIL
