"""Several tuner workers on one session: Optuna's RDB storage does the sharing.

- The study lives in an RDBStorage with heartbeats: a worker that dies (SIGKILL, node lost) stops
  beating, and after the grace period another worker's `optuna.storages.fail_stale_trials` ends its
  trial, which the search then runs again.
- Whatever must happen once per session (creating the MLflow parent run, writing the report for a
  given set of trials) is claimed by creating a marker study: the storage's unique study name makes
  exactly one `create_study` succeed, on sqlite and PostgreSQL alike.
"""

import threading
import time
import warnings
from typing import Optional

import optuna
from optuna.exceptions import DuplicatedStudyError

HEARTBEAT_S = 30  # a live worker records a heartbeat for its running trial this often
GRACE_S = 120  # a trial whose heartbeat is older than this belongs to a dead worker


def storage(url: str, heartbeat_s: int = HEARTBEAT_S, grace_s: int = GRACE_S) -> optuna.storages.BaseStorage:
    """The session's Optuna storage, with heartbeats for RDB URLs (sqlite, PostgreSQL, MySQL)."""
    if url.startswith(("sqlite:", "postgresql", "mysql")):
        from sqlalchemy.exc import SQLAlchemyError

        for attempt in range(3):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # heartbeats are "experimental" since Optuna 2.9
                    return optuna.storages.RDBStorage(url, heartbeat_interval=heartbeat_s, grace_period=grace_s)
            except SQLAlchemyError:  # workers starting together on an empty database: another one is creating the tables
                if attempt == 2:
                    raise
                time.sleep(1 + attempt)
    return optuna.storages.get_storage(url)


def claim_once(store: optuna.storages.BaseStorage, session: str, what: str) -> bool:
    """True for exactly one caller per (session, what), whichever worker asks first."""
    try:
        optuna.create_study(storage=store, study_name=f"{session}#{what}")
        return True
    except DuplicatedStudyError:
        return False


class Heartbeat:
    """Records a trial's heartbeat every interval while its experiment runs (what `study.optimize`
    does for its own trials; ask/tell trials need it done for them)."""

    def __init__(self, store: optuna.storages.BaseStorage):
        self.store = store
        self.interval: Optional[int] = store.get_heartbeat_interval() if hasattr(store, "get_heartbeat_interval") else None
        self._stops = {}

    def experiment_started(self, exp, trial) -> None:
        if not self.interval:
            return
        stop = threading.Event()
        self._stops[exp.name] = stop
        trial_id = trial._trial_id  # the storage's id of an ask/tell trial (no public accessor)

        def beat() -> None:
            while True:
                try:
                    self.store.record_heartbeat(trial_id)
                except Exception:  # a lost database connection must not kill the experiment
                    pass
                if stop.wait(self.interval):
                    return

        threading.Thread(target=beat, name="mlautotune-heartbeat", daemon=True).start()

    def experiment_finished(self, exp, measured, best) -> None:
        stop = self._stops.pop(exp.name, None)
        if stop is not None:
            stop.set()
