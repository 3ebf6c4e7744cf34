"""The commands: tune (and run), plan, experiment, sync. Glue from a session to search, tracking and reports."""

import json
import os
import shlex
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf
from optuna.exceptions import StorageInternalError

from mlautotune.console import Console
from mlautotune.errors import UserError
from mlautotune.files import atomic_write_text, read_json
from mlautotune.run.experiment import plain_command, prepare
from mlautotune.run.measure import WINDOW_KEYS, cut_short_note
from mlautotune.redact import redact, redact_args, redact_text
from mlautotune.track.report import (MOSTLY_DISTURBED, PROVENANCE_KEY, budget_text, disturbance, disturbance_text, launch_results, report_artifacts,
                                     session_metrics, write_reports)
from mlautotune.search import METRIC_KEYS, Outcome, Tuner, first_experiments
from mlautotune.session import SESSION_FILE, Session, hardware_params, open_session, session_hardware
from mlautotune.search.earlier import fingerprint, find_earlier, hardware_text, sqlite_missing
from mlautotune.search.warm import Earlier
from mlautotune.inputs.planned import planned_length, sequence_length
from mlautotune.inputs.space import experiment_name, plan_text
from mlautotune.search.candidates import given_batch, given_params, knobs_of_params, params_key
from mlautotune.track.estimate import Estimate, full_run
from mlautotune.track.earlier_runs import HARDWARE_TAG, find_earlier_runs
from mlautotune.track.tracking import PARENT_KEY, Tracker, TrackingObserver, child_payload, flatten, mlflow_status, parent_status, store_uri


class SessionFailed(Exception):
    exit_code = 1


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def tune_command(cfg: DictConfig) -> None:
    with open_session(cfg, lock=True) as session:
        _tune(session)


def session_console(session: Session) -> Console:
    """The session's progress console, with the plan's notices said."""
    console = Console(session.at.metric, session.at.tuner_num_trials)
    for notice in session.plan.notices:
        console.say(f"mlautotune: {notice}")
    return console


def session_tracker(session: Session, console: Console) -> Tracker:
    return Tracker(session.cfg.tracking.tracking_uri, session.cfg.tracking.experiment_name, session.cfg.tracking.enabled,
                   say=console.say, results_dir=session.results_dir)


def _tune(session: Session) -> None:
    console = session_console(session)
    study = session.open_study()
    earlier = warm_start(session, study, console)
    tuner = Tuner(session.plan, session.search_settings(), study, session.make_experiment, session.run, earlier=earlier)
    tracker = session_tracker(session, console)
    resumed = len(tuner.outcome().measured)
    console.say(
        f"mlautotune: session {session.name} | stages {session.plan.stages} | metric {session.at.metric} | tuner {session.at.tuner_type}"
        f" | budget {session.at.tuner_num_trials} experiments | {session.world_size} ranks | memory limit {session.memory_limit_bytes / 2**30:.2f} GiB/rank"
        + (f" | resuming with {resumed} experiments already measured" if resumed else "")
    )
    console.say(f"mlautotune: results in {session.results_dir}")
    prepare(session.ds_config, console.say)
    session.write_record(status="running", memory_limit_bytes=session.memory_limit_bytes)
    config_yaml = session.results_dir / "config.yaml"
    atomic_write_text(config_yaml, OmegaConf.to_yaml(redact(OmegaConf.to_container(session.cfg, resolve=True))))
    tracker.open_parent(study, session.name, parent_params(session), {"mode": session.cfg.mode, "metric": session.at.metric, **warm_tags(study)},
                        [session.ds_config_path, config_yaml],
                        group=multirun_group(), script=str(session.script))
    where = tracker.where()
    if where:
        console.say(where)
    tracker.drop_children(tuner.interrupted)
    tracker.fill_in(study, session.memory_limit_bytes)  # the last session may have died before tracking its last result
    tuner.observers = [console, TrackingObserver(tracker, session.at.metric, session.memory_limit_bytes)]

    started = time.monotonic() - float(study.user_attrs.get("wall_time_s", 0.0))
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    status, failure = "complete", None
    try:
        outcome = tuner.tune()
    except KeyboardInterrupt:
        hold_interrupts(console)  # a second Ctrl-C must not cut the partial report and leave the parent RUNNING
        status, outcome = "partial", tuner.outcome()
        console.say("mlautotune: interrupted; writing the best so far, marked partial. Run the same command again to resume.")
        tracker.kill_open_children()
    except (OSError, StorageInternalError) as e:  # a full disk, a folder gone read-only: end cleanly with what there is
        hold_interrupts(console)
        status, outcome, failure = "failed", tuner.outcome(), e
        tracker.kill_open_children()
    finally:
        if status == "complete":
            signal.signal(signal.SIGTERM, previous)
    wall = time.monotonic() - started
    if failure is not None:
        _fail_on_os_error(session, study, tracker, outcome, wall, failure, console)
    study.set_user_attr("wall_time_s", wall)
    if outcome.best is None and status == "complete":
        status = "failed"
    closing = finish(session, study, tracker, outcome, status, wall)
    console.say("")
    console.say((session.results_dir / "summary.txt").read_text().rstrip())
    if status != "complete":
        tracker.close_parent(**closing)
    if status == "failed":
        reasons = "; ".join(f"{m.result.name}: {m.result.status}" for m in outcome.measured[:8])
        raise SessionFailed(f"no experiment succeeded, so there is no optimal configuration ({reasons}). See {session.results_dir}/summary.txt and each experiment's stderr.log.")
    if status == "partial":
        sys.exit(130)
    console.say(f"mlautotune: optimal config: {session.results_dir / 'ds_config_optimal.json'}")
    console.say(f"mlautotune: command (secrets masked here, not in cmd_optimal.txt): {redact_text((session.results_dir / 'cmd_optimal.txt').read_text().strip())}")
    lr_advice(session, outcome, console)
    closing_warnings(outcome, study, console)
    if session.cfg.mode == "run":
        closing["metrics"].update(final_training(session, study, tracker, outcome, console))
    tracker.close_parent(**closing)


def warm_start(session: Session, study, console: Console) -> Optional[Earlier]:
    """Record the session's fingerprint and hardware on its study, and find the earlier sessions of the
    same model (`earlier_sessions`), unless search.warm_start=false. Says what it found."""
    key, hardware = fingerprint(session.script, session.ds_config, session.script_args), session_hardware(session)
    study.set_user_attr("fingerprint", key)
    study.set_user_attr("hardware", hardware)
    if not session.cfg.search.warm_start:
        study.set_user_attr("warm_start", None)
        return None
    note = lambda text: console.say(f"mlautotune: {text}")  # noqa: E731
    if resumed(study):  # the sessions it started from, no others
        earlier = recorded_earlier(session, study, note=note)
    else:
        earlier = earlier_sessions(session, key, hardware, note=note, parent_run=study.user_attrs.get(PARENT_KEY))
        study.set_user_attr("warm_start", {"sessions": earlier.sessions, "same_hardware": earlier.same_hardware,
                                           "relation": earlier.relation, **({"store": "mlflow"} if earlier.store else {})} if earlier else None)
    note(warm_start_text(earlier, session, hardware))
    return earlier


def resumed(study) -> bool:
    """The study has run and recorded its warm start: a resumed session's, or another worker's."""
    return bool(study.trials) and "warm_start" in study.user_attrs


def earlier_sessions(session: Session, key: str, hardware: Dict[str, Any], note=lambda text: None, parent_run: Optional[str] = None,
                     only: Optional[List[str]] = None, store: str = "") -> Optional[Earlier]:
    """The earlier sessions of the same model: the studies in the session's storage
    (search/earlier.py); when it holds none, the parent runs in its MLflow tracking store
    (track/earlier_runs.py; not with tracking.enabled=false), this session's own parent run
    (`parent_run`) left out. `only` and `store` ("mlflow" or ""): the sessions a study recorded
    (recorded_earlier), looked for where they were found."""
    if store != "mlflow":
        earlier = find_earlier(session.storage, session.name, key, hardware, note=note, only=only)
        if earlier is not None or only is not None:
            return earlier
    if not session.cfg.tracking.enabled:
        return None
    return find_earlier_runs(session.cfg.tracking.tracking_uri, session.cfg.tracking.experiment_name, key, hardware, session.at.metric,
                             note=note, only=only, exclude=parent_run)


def recorded_earlier(session: Session, study, note=lambda text: None) -> Optional[Earlier]:
    """The earlier sessions this session's study says it started from (None if none), where it found
    them: a resumed session, another worker and a report decide on the same prior as the session did."""
    warm = study.user_attrs.get("warm_start")
    if not warm:
        return None
    return earlier_sessions(session, study.user_attrs.get("fingerprint", ""), study.user_attrs.get("hardware") or {}, note=note,
                            parent_run=study.user_attrs.get(PARENT_KEY), only=list(warm["sessions"]), store=warm.get("store", ""))


def warm_start_text(earlier: Optional[Earlier], session: Session, hardware: Dict[str, Any]) -> str:
    """The console's line: where the earlier sessions were found and what the search makes of them, or where none was."""
    if earlier is None:
        mlflow = f" or the MLflow store {redact_text(store_uri(session.cfg.tracking.tracking_uri))}" if session.cfg.tracking.enabled else ""
        return f"warm start: no earlier session of this model in {redact_text(session.storage)}{mlflow}"
    sessions = ", ".join(f"{name} ({earlier.about.get(name, '')})" for name in earlier.sessions)
    where = f" in the MLflow store {earlier.store}" if earlier.store else ""
    if earlier.same_hardware:
        how = "same hardware: the earlier optimum and its near-ties are measured first"
    elif earlier.same_ranks:
        how = (f"another memory size (this session: {hardware_text(hardware)}): the earlier runs that peaked under this limit stand in "
               "for profiling, and their measurements are the search's prior")
    elif earlier.same_accelerator:
        how = (f"another world size (this session: {hardware_text(hardware)}): the earlier runs whose peaks, moved by ZeRO's model states, "
               "fit under this limit stand in for profiling, and their measurements are the search's prior")
    else:
        how = f"other hardware (this session: {hardware_text(hardware)}): their measurements are the search's prior"
    return f"warm start: from {sessions}{where}; {how}"


def warm_tags(study) -> Dict[str, str]:
    """The parent run's tags: the model's fingerprint and the session's hardware (what a warm start
    from the MLflow store matches, track/earlier_runs.py), and the sessions a warm start started from."""
    tags = {"fingerprint": str(study.user_attrs.get("fingerprint", ""))}
    if study.user_attrs.get("hardware"):
        tags[HARDWARE_TAG] = json.dumps(study.user_attrs["hardware"], sort_keys=True)
    warm = study.user_attrs.get("warm_start")
    if warm:
        tags["warm_start"] = ",".join(warm["sessions"])
    return tags


def closing_warnings(outcome: Outcome, study, console: Console) -> None:
    """The session's last lines: a search the budget stopped, and a session whose measurements were mostly disturbed."""
    if outcome.budget_stopped:
        console.say("mlautotune: " + budget_text(outcome))
    d = disturbance(launch_results(outcome, study))
    if d["share"] > MOSTLY_DISTURBED:
        console.say("mlautotune: warning: " + disturbance_text(d).removeprefix("Warning: "))


def hold_interrupts(console: Console) -> None:
    """From the first interrupt on, Ctrl-C and SIGTERM only say that the partial report is being written."""
    def say(signum, frame):
        console.say("mlautotune: still writing the partial report and closing the MLflow runs; it takes a few seconds.")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, say)
        signal.signal(signal.SIGTERM, say)


def _fail_on_os_error(session: Session, study, tracker: Tracker, outcome: Outcome, wall: float, error: Exception, console: Console) -> None:
    """Write what can still be written, end the parent run as FAILED with the reason, exit 1."""
    if isinstance(error, OSError):
        reason = f"writing {error.filename or 'a file'} failed: {error.strerror or error}"
    else:  # Optuna's study database (sqlite in the results folder) could not be written
        cause = error.__cause__ or error.__context__ or error
        reason = f"writing the Optuna study ({redact_text(session.storage)}) failed: {redact_text(' '.join(str(cause).split())[:200])}"
    try:
        closing = finish(session, study, tracker, outcome, "partial", wall)
        wrote = f"the partial results are in {session.results_dir}"
    except (OSError, StorageInternalError):
        closing = {"metrics": session_metrics(outcome, session.at.metric, wall), "tags": {"status": "failed"}, "artifacts": [],
                   "status": "FAILED", "step": len(study.trials), "note": ""}
        wrote = "the partial results could not be written there either; they are in the MLflow parent run"
    closing.update(status="FAILED", tags={**closing["tags"], "status": "failed", "failure_reason": reason})
    closing["note"] = closing["note"] or summary_text(outcome, session)
    tracker.close_parent(**closing)
    raise SessionFailed(f"the session stopped because {reason} (is the disk full?); {wrote}. Free some space and run the same command again to resume.")


def summary_text(outcome: Outcome, session: Session) -> str:
    from mlautotune.track.report import summary_table

    return summary_table(outcome, session.plan.stages)


def multirun_group() -> Optional[str]:
    """A value shared by the jobs of one Hydra multirun (their parents' grouping tag); None otherwise."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not (HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN):
        return None
    return os.environ.setdefault("MLAUTOTUNE_MULTIRUN", f"{socket.gethostname()}-{os.getpid()}-{int(time.time())}")


def finish(session: Session, study, tracker: Tracker, outcome: Outcome, status: str, wall: float) -> Dict[str, Any]:
    """Write the reports and bring the child runs in line with the study; return the arguments
    that close the parent run."""
    tracker.fill_in(study, session.memory_limit_bytes)
    for m in outcome.measured:  # each configuration's run shows the median of its measurements, as every other view does
        if m.repeats:
            tracker.log_configuration(m.trial_number, METRIC_KEYS[session.at.metric], m.values, m.final_value, step=len(study.trials))
    best = outcome.best
    num_params = next((m.result.metrics["num_params"] for m in outcome.measured if m.ok and m.result.metrics.get("num_params")), None)
    if num_params is not None:  # a warm start from this session checks it against its own model's (search/warm.py)
        study.set_user_attr("num_params", int(num_params))
    ds_optimal = session.make_experiment(best.params).ds_config if best else None
    cmd = optimal_cmd(session, best.params, ds_optimal) if best else None
    record = write_reports(
        session.results_dir, outcome, stages=session.plan.stages, metric=session.at.metric, status=status,
        wall_time_s=wall, session=session.name, optimal_ds_config=ds_optimal, optimal_cmd=cmd, study=study,
        estimate=run_estimate(session, outcome),
    )
    if best is not None and tracker.run_id_of(best.trial_number):
        record["tags"]["best_run_id"] = tracker.run_id_of(best.trial_number)
    if best is not None:  # the study's own best_value is its best single measurement; the session's optimum is a median
        study.set_user_attr("optimum", {"experiment": best.result.name, "trial": best.trial_number, session.at.metric: best.final_value,
                                        "measurements": len(best.values), "search": record["tags"]["search"], "status": status})
    session.write_record(**record)
    summary = (session.results_dir / "summary.txt").read_text()
    return {"metrics": record["metrics"], "tags": record["tags"], "artifacts": report_artifacts(session.results_dir),
            "status": parent_status(status), "step": len(study.trials), "params": record.get("params", {}), "note": summary}


def run_estimate(session: Session, outcome: Outcome) -> Optional[Estimate]:
    """The full run's wall time and GPU-hours at the optimum and at the user's starting configuration
    (the ds_config as given: the session's first experiment when it names one stage and one micro-batch)."""
    plan = session.plan
    start, why = given_params(plan, session.ds_config)
    measured = next((m for m in outcome.measured if start is not None and params_key(m.params) == params_key(start)), None)
    if start is not None and measured is None:
        why = f"{experiment_name(start['stage'], start['gas'], start['micro_batch'], knobs_of_params(start))} was not measured in this session"
    elif measured is not None and measured.final_value is None:
        why = f"{measured.result.name} ran but gave no time ({measured.result.status})"
    return full_run(planned_length(session.at, session.script_args, plan.hf_trainer), outcome.best, measured, why, metric=session.at.metric,
                    world_size=session.world_size, user_batch=given_batch(plan, session.ds_config), tokens=sequence_length(session.script_args))


def optimal_cmd(session: Session, params: Dict[str, Any], ds_config: Dict[str, Any]) -> str:
    """cmd_optimal.txt: the optimum's experiment, built by the experiments' own command-line builder."""
    exp = session.make_experiment(params)
    exp.ds_config = ds_config
    return shlex.join(plain_command(exp, str(session.results_dir / "ds_config_optimal.json")))


def parent_params(session: Session) -> Dict[str, Any]:
    """The parent's params, each once: the effective settings (not the tuner presets, not the
    ds_config's own autotuning section), the user's ds_config, the script and the hardware. Empty
    values are left out. The names are the same however the session was started: under `mlflow run`,
    the MLproject's own parameters (`num_gpus`) are there as well, and `launcher.num_gpus` too, so
    MLflow's Compare lines up sessions started either way."""
    cfg = OmegaConf.to_container(session.cfg, resolve=True)
    params = {k: v for k, v in flatten({k: cfg[k] for k in ("autotuning", "launcher", "search", "mode")}).items() if v not in (None, "", [])}
    params.pop("autotuning.enabled", None)
    params.update({f"user_ds_config.{k}": v for k, v in flatten({k: v for k, v in session.ds_config.items() if k != "autotuning"}).items()})
    params.update(
        {
            "script": str(session.script),
            "script_args": " ".join(redact_args(session.script_args)),
            "session": session.name,
            "stages": str(session.plan.stages),
            "results_dir": str(session.results_dir),
        }
    )
    params.update(hardware_params(session))
    return params


def lr_advice(session: Session, outcome: Outcome, console: Console) -> None:
    """README: if the best batch size differs from the user's, scale the learning rate."""
    user_mbs = session.ds_config.get("train_micro_batch_size_per_gpu")
    best = outcome.best
    if best is None or not isinstance(user_mbs, int):
        return
    b = user_mbs * session.plan.gas * session.world_size // session.plan.mp_size
    b2 = best.result.metrics.get("train_batch_size") or best.params["micro_batch"] * best.params["gas"] * session.world_size // session.plan.mp_size
    if b2 != b:
        console.say(
            f"mlautotune: the optimal global batch size {b2} differs from yours ({b}). Scale the learning rate by "
            f"sqrt({b2}/{b}) = {(b2 / b) ** 0.5:.3f} for Adam-like optimizers, or linearly by {b2 / b:.3f} for SGD, keeping the other hyperparameters."
        )


def final_training(session: Session, study, tracker: Tracker, outcome: Outcome, console: Console) -> Dict[str, float]:
    """mode=run: train with the optimum (autotuning removed), measured as its own child run; returns the
    parent run's metrics comparing it with the tuned figure."""
    exp = session.make_experiment(outcome.best.params)
    exp.name = "final_training"
    exp.ds_config = {k: v for k, v in exp.ds_config.items() if k not in ("autotuning", PROVENANCE_KEY)}
    exp.stop_after_window = False
    exp.timeout_s = session.at.final_training_timeout or float("inf")  # null: no cap
    console.say(f"mlautotune: final training with {outcome.best.result.name}'s configuration ...")
    params, _, _ = child_payload(exp.params, {"status": "running", "name": exp.name}, session.memory_limit_bytes)
    number = -1  # not an Optuna trial
    tracker.child_started(number, exp.name, params, {"status": "running", "experiment": exp.name, "mlautotune.role": "final_training"})
    exp.env.update(tracker.child_env(number))
    result = session.run(exp)
    final_params, metrics, tags = child_payload(exp.params, result.to_dict(), session.memory_limit_bytes)
    if outcome.best.value is not None:
        metrics[f"tuning_estimate_{session.at.metric}"] = outcome.best.final_value
    tracker.child_finished(number, exp.name, final_params, metrics, {**tags, "mlautotune.role": "final_training"}, result.exp_dir, mlflow_status(result.status))
    if result.status != "ok":
        raise SessionFailed(f"the final training ended as {result.status}: {result.reason.strip()[-500:]}")
    return check_against_tuning(result.metrics, tuned_throughput(session, outcome), outcome.best.result.metrics, console)


def tuned_throughput(session: Session, outcome: Outcome) -> float:
    """The optimum's throughput as tuning measured it (the median of its re-measurements when the metric is throughput)."""
    best = outcome.best
    return best.final_value if session.at.metric == "throughput" else best.result.metrics.get("throughput", 0.0)


def check_against_tuning(final: Dict[str, Any], tuned: float, tuned_metrics: Dict[str, Any], console: Console) -> Dict[str, float]:
    """The final training's end-to-end throughput after warm-up over the tuned figure (parent metric
    `final_over_tuned`), and a console line when they differ by more than the measurement interval."""
    e2e = final.get("end_to_end_throughput") or final.get("throughput")
    if not e2e or not tuned:
        console.say("mlautotune: the final training's throughput was not measured; no check against the tuned figure.")
        return {}
    ratio = e2e / tuned
    interval = max(tuned_metrics.get("interval_rel") or 0.0, final.get("interval_rel") or 0.0)
    line = f"mlautotune: final training: {e2e:,.4g} samples/s end to end after warm-up, tuned {tuned:,.4g}: final / tuned = {ratio:.3f}"
    if abs(ratio - 1.0) > interval:
        line += f", a difference beyond the measurement interval (+-{100 * interval:.1f}%)"
    console.say(line)
    return {"final_over_tuned": ratio, "final_throughput": e2e}


def plan_command(cfg: DictConfig) -> None:
    """Print the settings, the plan and the session's first experiments. Writes nothing, launches nothing."""
    session = open_session(cfg, dry_run=True)
    for notice in session.plan.notices:
        print(f"mlautotune: {notice}")
    print(f"session: {session.name}  ({session.world_size} ranks, results in {session.results_dir})")
    print("autotuning settings (conf < ds_config < command line):")
    print("  " + OmegaConf.to_yaml(session.at).strip().replace("\n", "\n  "))
    print(plan_text(session.plan))
    first = [session.make_experiment(p) for p in first_experiments(session.plan)]
    print("first experiments: " + ", ".join(e.name for e in first))
    print("first command: " + shlex.join(plain_command(first[0], str(session.results_dir / first[0].name / "ds_config.json"))))
    print(plan_warm_text(session))


def plan_warm_text(session: Session) -> str:
    """The plan's warm-start line: what `warm_start` would start from, looked up the same way and only
    read (no study attribute set, no storage or MLflow store created). The hardware it matches on is
    the session's own (session_hardware): the memory limit per rank is the setting, or the default
    from the device's or the host's memory, known before any launch. What only a run tells is the
    model's parameter count (an argument the fingerprint leaves out, such as --hidden_size, may change
    it): the line says the first run confirms it."""
    if not session.cfg.search.warm_start:
        return "warm start: off (search.warm_start=false)"
    key, hardware = fingerprint(session.script, session.ds_config, session.script_args), session_hardware(session)
    note = lambda text: print(f"mlautotune: {text}")  # noqa: E731
    own = _own_study(session)
    if own is not None and resumed(own):
        earlier = recorded_earlier(session, own, note=note)
    else:
        earlier = earlier_sessions(session, key, hardware, note=note, parent_run=own.user_attrs.get(PARENT_KEY) if own else None)
    return warm_start_text(earlier, session, hardware) + ("; the first run's parameter count confirms it is the same model" if earlier else "")


def _own_study(session: Session):
    """The session's study when its storage holds it (None otherwise); nothing is created."""
    import optuna

    if sqlite_missing(session.storage):
        return None
    try:
        return optuna.load_study(study_name=session.name, storage=session.storage)
    except Exception:  # not there, or a storage that cannot be read (find_earlier says so)
        return None


def experiment_command(cfg: DictConfig) -> None:
    """Run one experiment of the ds_config (the plan's first configuration) and print the result."""
    session = open_session(cfg, lock=True)
    exp = session.make_experiment(first_experiments(session.plan)[0])
    prepare(session.ds_config, lambda text: print(text, flush=True))
    print(f"mlautotune: running {exp.name} ...", flush=True)
    result = session.run(exp)
    print(f"status: {result.status}")
    for k in ("throughput", "latency", "FLOPS_per_gpu", "peak_memory_bytes", "step_time_median_ms", "step_time_spread", *WINDOW_KEYS):
        if k in result.metrics:
            print(f"{k}: {result.metrics[k]}")
    if result.reason:
        print(f"reason: {result.reason.strip()}")
    if result.status == "ok" and (advice := cut_short_note(result.metrics)):
        print(f"note: {advice}")
    print(f"wall time: {result.wall_time_s:.1f} s")
    print(f"folder: {result.exp_dir}")
    if result.status != "ok":
        sys.exit(1)


def sync_command(cfg: DictConfig) -> None:
    """Fill MLflow with a session's runs from its results directory (after a tracking outage):
    children that are missing are created, children left unfinished are completed."""
    import optuna

    results_dir = Path(cfg.autotuning.results_dir or "autotuning_results").expanduser().absolute()
    path = results_dir / SESSION_FILE
    if not path.is_file():
        raise UserError(f"{str(results_dir)!r} holds no tuning session ({SESSION_FILE} is missing).", "Pass autotuning.results_dir=<the results_dir of the session to sync>.")
    record = read_json(path)
    study = optuna.load_study(study_name=record["session"], storage=record["storage"])
    tracking = record.get("tracking", {})
    tracker = Tracker(cfg.tracking.tracking_uri or tracking.get("uri"), tracking.get("experiment_name") or cfg.tracking.experiment_name,
                      attempts=2, results_dir=results_dir)
    config_yaml = results_dir / "config.yaml"
    tracker.open_parent(study, record["session"], {"session": record["session"], "results_dir": str(results_dir)}, {}, [config_yaml] if config_yaml.exists() else [])
    if not tracker.online:
        raise SessionFailed(f"MLflow at {redact_text(tracker.tracking_uri)} cannot be reached; nothing was synced.")
    added = tracker.fill_in(study, record.get("memory_limit_bytes"))
    summary = results_dir / "summary.txt"
    tracker.close_parent(record.get("metrics", {}), record.get("tags", {}), report_artifacts(results_dir), parent_status(record.get("status")),
                         step=len(study.trials), params=record.get("params", {}), note=summary.read_text() if summary.exists() else "")
    print(f"mlautotune: synced {added} experiment runs of session {record['session']} to {redact_text(tracker.tracking_uri)} (parent run {tracker.parent_id})")
