"""Several workers on one session (`mlautotune worker`) and the session's report on demand (`mlautotune report`).

A worker joins the session named by search.storage and search.session (or, without a name, by the
settings that decide what is measured, its world size included but not its own devices or hosts).
Workers share the study (Optuna RDB storage with heartbeats), one MLflow parent run (created once,
`cluster.claim_once`) and the results folder layout. Each launches experiments on its own resources
only (its launcher.* settings, its CUDA_VISIBLE_DEVICES). A worker leaves when the strategy has nothing
more for the whole study and no other worker is measuring; the last to leave writes the report, once
per set of trials (`report@<trials>`).
"""

import os
import signal
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import List

import optuna
from omegaconf import DictConfig, OmegaConf
from optuna.trial import TrialState

from mlautotune.run.experiment import prepare
from mlautotune.search.cluster import Heartbeat, claim_once
from mlautotune.commands import _raise_interrupt, finish, lr_advice, parent_params, recorded_earlier, session_console, session_tracker, warm_start, warm_tags
from mlautotune.console import Console
from mlautotune.errors import UserError
from mlautotune.files import atomic_write_text
from mlautotune.redact import redact, redact_text
from mlautotune.search import Tuner
from mlautotune.session import Session, open_session
from mlautotune.track.tracking import PARENT_KEY, Tracker, TrackingObserver

WORKER_ATTR = "worker"  # trial user attribute: host:pid of the worker that ran it
PARENT_WAIT_S = 120  # how long a joining worker waits for the first one to create the parent run


class WorkerTag:
    """Names the worker on each trial it runs (study.trials_dataframe() shows who ran what)."""

    def __init__(self):
        self.name = f"{socket.gethostname()}:{os.getpid()}"

    def experiment_started(self, exp, trial) -> None:
        trial.set_user_attr(WORKER_ATTR, self.name)


def check_worker_settings(cfg: DictConfig) -> None:
    if cfg.mode == "run":
        raise UserError("mode=run (train with the optimum after tuning) is for a session tuned by one `mlautotune tune`; a worker only tunes.",
                        "Leave mode unset for workers, and train with cmd_optimal.txt (written by the last worker, or by `mlautotune report`).")
    check_storage_given(cfg)


def check_storage_given(cfg: DictConfig) -> None:
    if cfg.search.storage is not None and not cfg.search.storage.strip():
        raise UserError("search.storage= is given but empty, so this worker would not share the others' study "
                        "(an unset variable, such as $MLAUTOTUNE_STORAGE before `. DIR/env.sh`?).",
                        "Pass the shared study's URL, search.storage=postgresql://user:password@host:port/optuna, as every worker of the session does.")


def worker_command(cfg: DictConfig) -> None:
    # Optuna's heartbeats are meant for study.optimize; the Heartbeat observer beats for our ask/tell trials.
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
    check_worker_settings(cfg)
    with open_session(cfg, lock=True, worker=True) as session:
        _work(session)


def _work(session: Session) -> None:
    console = session_console(session)
    store = session.shared_storage()
    study = session.open_study(store)
    check_world_size(study, session)
    earlier = warm_start(session, study, console)
    tuner = Tuner(session.plan, session.search_settings(), study, session.make_experiment, session.run, earlier=earlier)
    tag = WorkerTag()
    console.say(f"mlautotune: worker {tag.name} joins session {session.name} | {len(study.trials)} trials so far | {session.world_size} ranks"
                f" | metric {session.at.metric} | budget {session.at.tuner_num_trials} experiments for the session")
    console.say(f"mlautotune: results in {session.results_dir}")
    prepare(session.ds_config, console.say)
    session.write_record(status="running", memory_limit_bytes=session.memory_limit_bytes)
    config_yaml = session.results_dir / "config.yaml"
    atomic_write_text(config_yaml, OmegaConf.to_yaml(redact(OmegaConf.to_container(session.cfg, resolve=True))))
    tracker = session_tracker(session, console)
    open_parent_once(tracker, store, study, session, [session.ds_config_path, config_yaml], console)
    tuner.observers = [Heartbeat(store), tag, console, TrackingObserver(tracker, session.at.metric, session.memory_limit_bytes)]

    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        tuner.tune()
    except KeyboardInterrupt:
        tracker.kill_open_children()
        console.say("mlautotune: worker interrupted; its experiment is free again for the other workers (or this command, run again).")
        sys.exit(130)
    finally:
        signal.signal(signal.SIGTERM, previous)
    trials = len(study.trials)
    if not claim_once(store, session.name, f"report@{trials}"):
        console.say(f"mlautotune: worker {tag.name} is done; another worker writes the report of these {trials} trials.")
        return
    console.say(f"mlautotune: worker {tag.name} finished last; writing the session's report.")
    write_report(session, study, tracker, console)


def check_world_size(study: optuna.Study, session: Session) -> None:
    """Workers of one session launch the same number of ranks: their results are compared with each other."""
    first = study.user_attrs.get("world_size")
    if first is None:
        study.set_user_attr("world_size", session.world_size)
    elif first != session.world_size:
        raise UserError(
            f"This worker launches {session.world_size} ranks, but session {session.name!r} is tuned with {first} ranks per experiment "
            "(throughput at another world size is not comparable).",
            f"Give this worker {first} ranks (launcher.num_gpus, num_nodes, include or hostfile), or another search.session.",
        )


def open_parent_once(tracker: Tracker, store, study: optuna.Study, session: Session, artifacts: List, console: Console) -> None:
    """The first worker creates the session's parent run (with the session's params and inputs); the
    others wait for it and log into the same run."""
    if not tracker.enabled:
        return
    if claim_once(store, session.name, "parent"):
        tracker.open_parent(study, session.name, parent_params(session), {"mode": "tune", "metric": session.at.metric, **warm_tags(study)}, artifacts, script=str(session.script))
    else:
        deadline = time.monotonic() + PARENT_WAIT_S
        while PARENT_KEY not in study.user_attrs and time.monotonic() < deadline:
            time.sleep(1)
        if PARENT_KEY not in study.user_attrs:
            console.say(f"mlautotune: warning: the worker that opened session {session.name} has not created its MLflow parent run after "
                        f"{PARENT_WAIT_S} s; this worker's experiments are not tracked (`mlautotune report` fills the parent in later).")
            return
        tracker.open_parent(study, session.name, {}, {}, [], join=True)
    where = tracker.where()
    if where:
        console.say(where)


def report_command(cfg: DictConfig) -> None:
    """Write the report of a workers' session (summary, optimal config and command, plots, the parent
    run's metrics) from its study, at any time; trials still running make it partial."""
    from sqlalchemy.engine import make_url

    check_storage_given(cfg)
    session = open_session(cfg, dry_run=True, worker=True)  # creates nothing: the session must exist
    url = make_url(session.storage)
    try:
        if url.get_backend_name() == "sqlite" and not Path(url.database or "").expanduser().is_file():
            raise KeyError(session.name)
        study = optuna.load_study(study_name=session.name, storage=session.shared_storage())
    except KeyError:
        raise UserError(f"The storage {redact_text(session.storage)} holds no session named {session.name!r}.",
                        "Pass the workers' search.storage and search.session (or the same settings they were started with).")
    check_world_size(study, session)  # cmd_optimal.txt is built from this command's launcher settings
    console = Console(session.at.metric, session.at.tuner_num_trials)
    write_report(session, study, session_tracker(session, console), console)


def write_report(session: Session, study: optuna.Study, tracker: Tracker, console: Console) -> None:
    """The report over every worker's trials, and the parent run closed with it. Child runs of trials
    cut off (a worker killed or interrupted; each was run again) are removed, so every experiment is
    recorded once."""
    earlier = recorded_earlier(session, study)  # the same prior as the session's: the same declared optimum
    outcome = Tuner(session.plan, session.search_settings(), study, session.make_experiment, session.run, earlier=earlier).outcome()
    running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    status = "partial" if running else "complete" if outcome.best is not None else "failed"
    tracker.open_parent(study, session.name, {}, {}, [])  # the parent run, and its children as they are now
    tracker.drop_children([t.number for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,)) if "result" not in t.user_attrs])
    wall = wall_time(study)
    study.set_user_attr("wall_time_s", wall)
    closing = finish(session, study, tracker, outcome, status, wall)
    tracker.close_parent(**closing)
    console.say("")
    console.say((session.results_dir / "summary.txt").read_text().rstrip())
    if outcome.best is not None:
        console.say(f"mlautotune: optimal config: {session.results_dir / 'ds_config_optimal.json'}")
        console.say(f"mlautotune: command (secrets masked here, not in cmd_optimal.txt): {redact_text((session.results_dir / 'cmd_optimal.txt').read_text().strip())}")
        lr_advice(session, outcome, console)
    if running:
        console.say(f"mlautotune: {len(running)} trials are still running: the report is partial; workers write it again when they finish.")


def wall_time(study: optuna.Study) -> float:
    """The session's wall time over all workers: first trial started to last trial finished."""
    trials = study.get_trials(deepcopy=False)
    starts = [t.datetime_start for t in trials if t.datetime_start]
    ends = [t.datetime_complete for t in trials if t.datetime_complete]
    return (max(ends) - min(starts)).total_seconds() if starts and ends else 0.0
