"""MLflow tracking: one parent run per tuning session, one child run per experiment.

Only this module talks to MLflow. It uses MlflowClient with explicit run ids, so nesting
(`mlflow.parentRunId`) holds across processes and a resumed session continues its parent run.
Children carry the Optuna trial number as a tag, which makes logging idempotent: `sync` can fill
in whatever a session could not log while the tracking server was unreachable.
"""

import logging
import os
from pathlib import Path
from typing import Any, Dict, Iterable, Optional

import mlflow
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

log = logging.getLogger("mlautotune")

PARENT_KEY = "mlflow_parent_run_id"  # study user attribute
TRIAL_TAG = "mlautotune.trial"
SESSION_TAG = "mlautotune.session"
ROLE_TAG = "mlautotune.role"  # session | experiment | final_training
MAX_PARAM_LEN = 6000


def flatten(d: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


class Tracker:
    """Logs to MLflow while it can. The first failure switches it off for the session with one
    warning; results stay on disk and `mlautotune sync` fills the runs in later."""

    def __init__(self, tracking_uri: Optional[str], experiment_name: str, enabled: bool = True):
        self.enabled = enabled
        self.online = enabled
        self.tracking_uri = tracking_uri or mlflow.get_tracking_uri()
        self.experiment_name = experiment_name
        self.client = MlflowClient(self.tracking_uri) if enabled else None
        self.parent_id: Optional[str] = None
        self._children: Dict[int, str] = {}  # trial number -> run id
        self._experiment_id: Optional[str] = None

    def _guard(self, what: str, fn, *args, **kwargs):
        if not self.online:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # tracking must never stop the tuning
            self.online = False
            log.warning(
                "MLflow tracking at %s failed while %s (%s). Tuning goes on and results stay on disk; "
                "fill the MLflow runs in later with `mlautotune sync results_dir=<results_dir>`.",
                self.tracking_uri, what, str(e).splitlines()[0][:300] if str(e) else type(e).__name__,
            )
            return None

    # ---- parent ---------------------------------------------------------------------------
    def open_parent(self, study, session: str, params: Dict[str, Any], tags: Dict[str, str], artifacts: Iterable[Path]) -> Optional[str]:
        return self._guard("opening the parent run", self._open_parent, study, session, params, tags, list(artifacts))

    def _open_parent(self, study, session, params, tags, artifacts) -> str:
        self._experiment_id = self._experiment()
        active = mlflow.active_run()
        run_id = active.info.run_id if active else os.environ.get("MLFLOW_RUN_ID") or study.user_attrs.get(PARENT_KEY)
        if run_id and self.client.get_run(run_id).info.lifecycle_stage == "deleted":
            run_id = None
        if run_id:
            self.client.update_run(run_id, status="RUNNING")
        else:
            run_id = self.client.create_run(self._experiment_id, run_name=session, tags={ROLE_TAG: "session"}).info.run_id
        self.parent_id = run_id
        self._experiment_id = self.client.get_run(run_id).info.experiment_id
        study.set_user_attr(PARENT_KEY, run_id)
        existing = self.client.get_run(run_id).data.params
        new_params = {k: v for k, v in params.items() if k not in existing}
        self._log_batch(run_id, params=new_params, tags={**tags, SESSION_TAG: session, ROLE_TAG: "session", "status": "running"})
        for path in artifacts:
            self.client.log_artifact(run_id, str(path), artifact_path="inputs")
        self._children = self._existing_children()
        return run_id

    def _experiment(self) -> str:
        exp = self.client.get_experiment_by_name(self.experiment_name)
        return exp.experiment_id if exp else self.client.create_experiment(self.experiment_name)

    def _existing_children(self) -> Dict[int, str]:
        runs = self.client.search_runs(
            [self._experiment_id], filter_string=f"tags.mlflow.parentRunId = '{self.parent_id}'", max_results=5000
        )
        return {int(r.data.tags[TRIAL_TAG]): r.info.run_id for r in runs if TRIAL_TAG in r.data.tags}

    def drop_children(self, trial_numbers: Iterable[int]) -> None:
        """Delete the child runs of trials that were interrupted and will be run again."""
        for n in trial_numbers:
            if n in self._children:
                self._guard("deleting a stale child run", self.client.delete_run, self._children.pop(n))

    def close_parent(self, metrics: Dict[str, float], tags: Dict[str, str], artifacts: Iterable[Path], status: str) -> None:
        if self.parent_id is None:
            return
        self._guard("closing the parent run", self._close_parent, metrics, tags, list(artifacts), status)

    def _close_parent(self, metrics, tags, artifacts, status) -> None:
        self._log_batch(self.parent_id, metrics=metrics, tags=tags)
        for path in artifacts:
            if path.is_dir():
                self.client.log_artifacts(self.parent_id, str(path), artifact_path=path.name)
            elif path.exists():
                self.client.log_artifact(self.parent_id, str(path))
        self.client.set_terminated(self.parent_id, status=status)

    # ---- children -------------------------------------------------------------------------
    def child_started(self, trial_number: int, name: str, params: Dict[str, Any], tags: Dict[str, str]) -> None:
        if self.parent_id is None or trial_number in self._children:
            return
        run = self._guard(
            f"starting the run of {name}",
            self.client.create_run,
            self._experiment_id,
            run_name=name,
            tags={"mlflow.parentRunId": self.parent_id, TRIAL_TAG: str(trial_number), ROLE_TAG: tags.get(ROLE_TAG, "experiment"), "experiment": name},
        )
        if run is not None:
            self._children[trial_number] = run.info.run_id
            self._guard(f"logging the params of {name}", self._log_batch, run.info.run_id, params=params, tags=tags)

    def child_finished(self, trial_number: int, metrics: Dict[str, float], tags: Dict[str, str], exp_dir: Optional[str], status: str, params: Optional[Dict[str, Any]] = None) -> None:
        run_id = self._children.get(trial_number)
        if run_id is None:
            return
        self._guard(f"finishing run {run_id}", self._finish_child, run_id, metrics, tags, exp_dir, status, params or {})

    def _finish_child(self, run_id, metrics, tags, exp_dir, status, params) -> None:
        logged = self.client.get_run(run_id).data.params
        self._log_batch(run_id, params={k: v for k, v in params.items() if k not in logged}, metrics=metrics, tags=tags)
        if exp_dir and Path(exp_dir).is_dir():
            self.client.log_artifacts(run_id, exp_dir, artifact_path="experiment")
        self.client.set_terminated(run_id, status=status)

    def kill_open_children(self) -> None:
        for run_id in self._children.values():
            self._guard("ending a run", self._kill_if_running, run_id)

    def _kill_if_running(self, run_id: str) -> None:
        if self.client.get_run(run_id).info.status == "RUNNING":
            self.client.set_terminated(run_id, status="KILLED")

    def has_child(self, trial_number: int) -> bool:
        return trial_number in self._children

    def _log_batch(self, run_id: str, params: Optional[Dict[str, Any]] = None, metrics: Optional[Dict[str, float]] = None, tags: Optional[Dict[str, str]] = None) -> None:
        ps = [Param(k, str(v)[:MAX_PARAM_LEN]) for k, v in (params or {}).items()]
        ms = [Metric(k, float(v), 0, 0) for k, v in (metrics or {}).items() if v is not None]
        ts = [RunTag(k, str(v)[:MAX_PARAM_LEN]) for k, v in (tags or {}).items()]
        for i in range(0, max(len(ps), len(ms), len(ts), 1), 100):
            self.client.log_batch(run_id, metrics=ms[i : i + 100], params=ps[i : i + 100], tags=ts[i : i + 100])


def child_payload(params: Dict[str, Any], result: Dict[str, Any], ds_config: Dict[str, Any]) -> tuple:
    """Params, metrics and tags of one experiment's child run, with readable flat names."""
    p = {
        "stage": params.get("stage"),
        "micro_batch_size": params.get("micro_batch"),
        "gradient_accumulation_steps": params.get("gas"),
        "train_batch_size": result.get("metrics", {}).get("train_batch_size"),
    }
    p.update({f"zero.{k}": v for k, v in params.items() if k not in ("stage", "micro_batch", "gas")})
    p.update({f"ds_config.{k}": v for k, v in flatten(ds_config).items()})
    metrics_src = result.get("metrics", {})
    keys = ("throughput", "latency", "FLOPS_per_gpu", "peak_memory_bytes", "step_time_median_ms", "step_time_min_ms", "step_time_max_ms", "step_time_spread",
            "interval_rel", "warmup_steps", "measured_steps", "measure_seconds", "disturbed", "cpu_wait_share", "threads_per_rank", "end_to_end_throughput")
    metrics = {k: metrics_src[k] for k in keys if isinstance(metrics_src.get(k), (int, float))}
    metrics["wall_time_s"] = result.get("wall_time_s", 0.0)
    tags = {"status": result["status"], "experiment": result["name"]}
    if result.get("reason"):
        tags["failure_reason"] = result["reason"][-4000:]
    return {k: v for k, v in p.items() if v is not None}, metrics, tags


def parent_status(session_status: Optional[str]) -> str:
    """A session's status (complete | partial | failed) as the parent run's MLflow status."""
    return {"complete": "FINISHED", "partial": "KILLED", "failed": "FAILED"}.get(session_status or "", "KILLED")


def mlflow_status(result_status: str) -> str:
    return "FINISHED" if result_status == "ok" else "KILLED" if result_status == "interrupted" else "FAILED"


class TrackingObserver:
    """Turns the search's events into child runs."""

    def __init__(self, tracker: Tracker):
        self.tracker = tracker
        self._running: Dict[str, int] = {}  # experiment name -> trial number

    def experiment_started(self, exp, trial) -> None:
        self._running[exp.name] = trial.number
        params, _, _ = child_payload(exp.params, {"status": "running", "name": exp.name, "metrics": {}}, exp.ds_config)
        self.tracker.child_started(trial.number, exp.name, params, {"status": "running", "experiment": exp.name})

    def experiment_finished(self, exp, measured, best) -> None:
        result = measured.result.to_dict()
        params, metrics, tags = child_payload(exp.params, result, {})
        number = self._running.pop(exp.name, measured.trial_number)
        self.tracker.child_finished(number, metrics, tags, measured.result.exp_dir, mlflow_status(measured.result.status), params)
