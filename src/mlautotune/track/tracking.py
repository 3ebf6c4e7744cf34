"""MLflow tracking: one parent run per tuning session, one child run per experiment.

Only this module writes to MLflow (track/earlier_runs.py reads a warm start's earlier sessions
back). It uses MlflowClient with explicit run ids, so nesting (`mlflow.parentRunId`) holds across
processes and a resumed session continues its parent run.
Children carry the Optuna trial number as a tag, which makes logging idempotent: `sync` can fill
in whatever a session could not log while the tracking server was unreachable.

Everything sent passes through `mlautotune.redact` (params, tags, uploaded files). Keys are
reduced to MLflow's characters; values too long for a param go to an artifact. Metrics carry the
wall-clock time and the Optuna trial number as step, so the latest value is the current one.
"""

import getpass
import json
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unicodedata
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from mlautotune.run.measure import WINDOW_KEYS
from mlautotune.search import METRIC_KEYS
from mlautotune.redact import redact, redact_text

log = logging.getLogger("mlautotune")

PARENT_KEY = "mlflow_parent_run_id"  # study user attribute
TRIAL_TAG = "mlautotune.trial"
SESSION_TAG = "mlautotune.session"
ROLE_TAG = "mlautotune.role"  # session | experiment | final_training
GROUP_TAG = "mlautotune.multirun"  # the same value on the parents of one Hydra multirun
SESSION_RUN_TAG = "mlautotune.session_run"  # on every experiment run: its session's parent run (a re-measurement's parent is its configuration's run)
VIEW_KEY = "mlautotune"  # the MLflow UI's shared view of the runs table: `?viewStateShareKey=mlautotune`
VIEW_TAG = f"mlflow.sharedViewState.{VIEW_KEY}"  # the experiment tag the UI reads that view from
REPEAT_TAG = "mlautotune.repeat_of"  # on a re-measurement's run: the trial number of its configuration's first measurement
MAX_PARAM_LEN = 6000  # MLflow's limits (mlflow.utils.validation)
MAX_TAG_LEN = 8000
MAX_KEY_LEN = 250
LONG_VALUES_DIR = "long_values"  # artifact folder for values longer than a param can hold
TEXT_SUFFIXES = {".json", ".txt", ".log", ".yaml", ".yml", ".csv", ".cfg", ".ini", ".sh", ""}
HINT = "mlautotune sync autotuning.results_dir={results_dir}"


def runs_table_view(metric: str) -> Dict[str, Any]:
    """The runs table as the session's link opens it: the metrics that rank the runs as columns (the
    UI shows none by default), sorted by the parents' best value."""
    key = METRIC_KEYS.get(metric, metric)
    columns = [f"metrics.`best_{metric}`", f"metrics.`{key}`", "metrics.`measurements`", "metrics.`disturbed`", "metrics.`stage`",
               "metrics.`micro_batch_size`", "metrics.`gradient_accumulation_steps`", "metrics.`peak_memory_fraction`", "tags.`status`",
               "tags.`search`"]
    return {"selectedColumns": columns, "orderByKey": f"metrics.`best_{metric}`", "orderByAsc": metric == "latency"}


def flatten(d: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def clean_key(key: str) -> str:
    """A key MLflow accepts: ASCII letters, digits, `_ - . space`; no path tricks; at most 250
    characters (longer ones keep their start and a hash of the whole)."""
    text = unicodedata.normalize("NFKD", str(key)).encode("ascii", "ignore").decode()
    text = re.sub(r"[^A-Za-z0-9_\-. ]", "_", text).strip(" ")
    if text.strip(".") == "":
        text = "_" + text
    if text != str(key) and text.strip("_.") == "" or len(text) > MAX_KEY_LEN or (text != str(key) and not str(key).isascii()):
        digest = hashlib.sha1(str(key).encode()).hexdigest()[:8]
        text = f"{text[: MAX_KEY_LEN - 9]}-{digest}"
    return text


def clean_keys(d: Dict[str, Any]) -> Dict[str, Any]:
    """clean_key on every key; two keys that clean to the same one stay apart (a hash suffix)."""
    out: Dict[str, Any] = {}
    for k, v in d.items():
        c = clean_key(k)
        if c in out:
            c = f"{c[: MAX_KEY_LEN - 9]}-{hashlib.sha1(str(k).encode()).hexdigest()[:8]}"
        out[c] = v
    return out


def context_tags(script: Optional[str]) -> Dict[str, str]:
    """MLflow's context tags for a run: user, source (the training script) and its git commit."""
    tags = {"mlflow.user": getpass.getuser(), "mlflow.source.type": "LOCAL"}
    if script:
        tags["mlflow.source.name"] = str(script)
        try:
            commit = subprocess.run(["git", "-C", str(Path(script).parent), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
            if commit.returncode == 0 and commit.stdout.strip():
                tags["mlflow.source.git.commit"] = commit.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return tags


def _outage(e: Exception) -> bool:
    """True for errors worth retrying (server unreachable, 5xx, timeouts); False for a request
    MLflow rejected (4xx): retrying it would fail the same way."""
    code = getattr(e, "get_http_status_code", lambda: 500)()
    return not (400 <= int(code or 500) < 500)


def quick_http() -> None:
    """MLflow's own HTTP retries stay on, but short (the user's settings win): the Tracker retries
    each call with backoff on top, and a server that is down must cost seconds, not minutes.
    MLflow's "View run at <uri>" lines would print a password in the URI, once per run: the
    console has our own line, with the URI redacted."""
    for var, value in (("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0"), ("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1"),
                       ("MLFLOW_HTTP_REQUEST_TIMEOUT", "10"), ("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")):
        os.environ.setdefault(var, value)


def store_uri(tracking_uri: Optional[str]) -> str:
    """The tracking store a session uses: tracking.tracking_uri, else MLflow's (MLFLOW_TRACKING_URI or its default)."""
    import mlflow

    return tracking_uri or mlflow.get_tracking_uri()


def local_artifacts(tracking_uri: str) -> Optional[str]:
    """Artifacts of a local sqlite store go beside the database file (`mlartifacts/`), not into
    MLflow's default `./mlruns` of whatever folder the session was started in."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    return (Path(tracking_uri[len("sqlite:///"):]).resolve().parent / "mlartifacts").as_uri()


class Tracker:
    """Logs to MLflow while it can. A call is tried `attempts` times with backoff; when the server
    stays unreachable the outage is shown once on the console and the session goes on untracked
    at once (later calls are skipped; with a finite `cooldown_s`, one is tried again per
    `cooldown_s`). Results stay on disk and `mlautotune sync` fills in the rest."""

    def __init__(self, tracking_uri: Optional[str], experiment_name: str, enabled: bool = True, *,
                 attempts: int = 2, backoff_s: float = 1.0, cooldown_s: float = float("inf"),
                 say: Callable[[str], None] = lambda text: print(text, file=sys.stderr, flush=True), results_dir: Any = "<results_dir>"):
        quick_http()
        self.enabled = enabled
        self.tracking_uri = store_uri(tracking_uri)
        self.experiment_name = experiment_name
        self.client = MlflowClient(self.tracking_uri) if enabled else None
        self.attempts, self.backoff_s, self.cooldown_s, self.say = attempts, backoff_s, cooldown_s, say
        self.results_dir = results_dir
        self.parent_id: Optional[str] = None
        self.experiment_id: Optional[str] = None
        self._children: Dict[int, str] = {}  # trial number -> run id
        self._down_since: Optional[float] = None
        self._last_attempt = 0.0
        self.missed = 0  # calls skipped or failed during outages

    @property
    def online(self) -> bool:
        return self.enabled and self._down_since is None

    def _call(self, what: str, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        if not self.enabled:
            return None
        if self._down_since is not None and time.monotonic() - self._last_attempt < self.cooldown_s:
            self.missed += 1
            return None
        tries = 1 if self._down_since is not None else self.attempts
        for attempt in range(tries):
            try:
                result = fn(*args, **kwargs)
            except Exception as e:  # tracking must never stop the tuning
                error = e
                if not _outage(e):
                    self.say(f"mlautotune: MLflow refused {what}: {_first_line(e)}")
                    return None
                if attempt + 1 < tries:
                    time.sleep(self.backoff_s * 2**attempt)
                continue
            if self._down_since is not None:
                self.say(f"mlautotune: MLflow at {redact_text(self.tracking_uri)} is reachable again; tracking resumes "
                         f"({self.missed} calls were missed: fill them in with `{HINT.format(results_dir=self.results_dir)}`).")
                self._down_since = None
            return result
        self.missed += 1
        self._last_attempt = time.monotonic()
        if self._down_since is None:
            self._down_since = time.monotonic()
            self.say(
                f"mlautotune: warning: MLflow tracking at {redact_text(self.tracking_uri)} failed while {what} after {tries} attempts "
                f"({_first_line(error)}). Tuning goes on untracked and results stay on disk"
                + (f"; tracking is retried every {self.cooldown_s:g} s. " if self.cooldown_s != float("inf") else ". ") +
                f"Fill the MLflow runs in later with `{HINT.format(results_dir=self.results_dir)}`."
            )
        return None

    # ---- parent ---------------------------------------------------------------------------
    def open_parent(self, study, session: str, params: Dict[str, Any], tags: Dict[str, str], artifacts: Iterable[Path],
                    group: Optional[str] = None, script: Optional[str] = None, join: bool = False) -> Optional[str]:
        """Create or continue the session's parent run. In a Hydra multirun (`group` set), a run
        given by MLFLOW_RUN_ID (`mlflow run`) is not adopted by every job: it becomes the jobs'
        common parent instead. A worker that `join`s a session whose report is written leaves the
        parent finished (the worker that writes the next report finishes it again)."""
        return self._call("opening the parent run", self._open_parent, study, session, params, tags, list(artifacts), group, script, join)

    def _open_parent(self, study, session, params, tags, artifacts, group, script, join=False) -> str:
        env_run = os.environ.get("MLFLOW_RUN_ID")
        adopted = env_run if env_run and not group else None
        run_id = adopted or study.user_attrs.get(PARENT_KEY)
        if run_id and self.client.get_run(run_id).info.lifecycle_stage == "deleted":
            run_id = None
        run_tags = {**tags, SESSION_TAG: session, ROLE_TAG: "session", "status": "running"}
        if group:
            run_tags[GROUP_TAG] = env_run or group
        if run_id:
            run = self.client.get_run(run_id)
            self.experiment_id = run.info.experiment_id
            keep = run.data.tags.get(SESSION_TAG) == session  # a resumed parent keeps its name
            if join and run.info.status == "FINISHED":
                run_tags.pop("status")
            else:
                self.client.update_run(run_id, status="RUNNING", name=run.info.run_name if keep else self._free_name(session, run_id))
        else:
            self.experiment_id = self.client.get_run(env_run).info.experiment_id if env_run else self._experiment()
            extra = {"mlflow.parentRunId": env_run} if env_run else {}
            run_id = self.client.create_run(self.experiment_id, run_name=self._free_name(session), tags={ROLE_TAG: "session", **extra}).info.run_id
            run_tags.update(context_tags(script))
        self.parent_id = run_id
        study.set_user_attr(PARENT_KEY, run_id)
        self.client.set_experiment_tag(self.experiment_id, VIEW_TAG, json.dumps(runs_table_view(tags.get("metric", "throughput"))))
        self._log_batch(run_id, params=params, tags=run_tags)
        for path in artifacts:
            self._upload(run_id, path, "inputs")
        self._children = self._existing_children()
        return run_id

    def _free_name(self, session: str, run_id: Optional[str] = None) -> str:
        """The session's name for its parent run, with -2, -3 ... when other parents of the experiment
        already have it (the same settings tuned in another results folder, or again after an archive)."""
        if "'" in session:
            return session
        others = self.client.search_runs([self.experiment_id], filter_string=f"tags.{SESSION_TAG} = '{session}'", max_results=1000)
        taken = {r.info.run_name for r in others if r.info.run_id != run_id}
        return next(n for n in (session if i == 1 else f"{session}-{i}" for i in range(1, len(taken) + 2)) if n not in taken)

    def _experiment(self) -> str:
        exp = self.client.get_experiment_by_name(self.experiment_name)
        return exp.experiment_id if exp else self.client.create_experiment(self.experiment_name, local_artifacts(self.tracking_uri))

    def where(self) -> str:
        """Where the runs are, for the console: the MLflow experiment, the parent run, and the parent
        run's page in the MLflow UI (in its "Model training" view: the UI opens in its GenAI view,
        which shows traces, not runs)."""
        if self.parent_id is None or not self.online:
            return ""
        exp = self._call("reading the experiment", self.client.get_experiment, self.experiment_id)
        if not exp:
            return ""
        uri = redact_text(self.tracking_uri)
        page = f"#/experiments/{exp.experiment_id}/runs/{self.parent_id}?workflowType=machine_learning"
        table = f"#/experiments/{exp.experiment_id}/runs?viewStateShareKey={VIEW_KEY}&workflowType=machine_learning"
        base = uri.rstrip("/") if uri.startswith(("http://", "https://")) else "http://127.0.0.1:5000"
        start = "" if uri.startswith(("http://", "https://")) else f"`mlflow ui --backend-store-uri {uri}`, then "
        return (f"mlautotune: tracked in MLflow experiment {exp.name!r}, parent run {self.parent_id} at {uri}\n"
                f"mlautotune: in the MLflow UI: {start}{base}/{page}\nmlautotune: the runs table with the metrics as columns: {base}/{table}")

    def _existing_children(self) -> Dict[int, str]:
        return {n: run.info.run_id for n, run in self._child_runs().items()}

    def _child_runs(self) -> Dict[int, Any]:
        """The session's experiment runs by trial number: the parent's children, and the re-measurements
        nested under their configuration's run."""
        return experiment_runs(self.client, self.experiment_id, self.parent_id)

    def drop_children(self, trial_numbers: Iterable[int]) -> None:
        """Delete the child runs of trials that were interrupted and will be run again."""
        for n in trial_numbers:
            if n in self._children:
                self._call("deleting a stale child run", self.client.delete_run, self._children.pop(n))

    def log_parent(self, metrics: Dict[str, float], step: int) -> None:
        """Metrics of the parent as the session goes (best so far, the experiment's value) at `step`."""
        if self.parent_id is not None:
            self._call("logging the session's progress", self._log_batch, self.parent_id, metrics=metrics, step=step)

    def close_parent(self, metrics: Dict[str, float], tags: Dict[str, str], artifacts: Iterable[Path], status: str,
                     step: int = 0, params: Optional[Dict[str, Any]] = None, note: str = "") -> None:
        if self.parent_id is None:
            return
        self._call("closing the parent run", self._close_parent, metrics, tags, list(artifacts), status, step, params or {}, note)

    def _close_parent(self, metrics, tags, artifacts, status, step, params, note) -> None:
        logged = self.client.get_run(self.parent_id).data.params
        changed = {k: v for k, v in clean_keys(params).items() if k in logged and logged[k] != str(v)}
        tags = {**tags, **{k: v for k, v in changed.items()}}  # a resumed session's new winner: params are immutable
        if note:
            tags["mlflow.note.content"] = note
        self._log_batch(self.parent_id, params={k: v for k, v in params.items() if clean_key(k) not in changed}, metrics=metrics, tags=tags, step=step)
        for path in artifacts:
            if path.exists():
                self._upload(self.parent_id, path, path.name if path.is_dir() else None)
        self.client.set_terminated(self.parent_id, status=status)

    # ---- children -------------------------------------------------------------------------
    def child_started(self, trial_number: int, name: str, params: Dict[str, Any], tags: Dict[str, str]) -> Optional[str]:
        """Create the experiment's child run (once per trial); its run id, or None when offline. A
        re-measurement (tags[REPEAT_TAG]) is nested under its configuration's run."""
        if self.parent_id is None:
            return None
        if trial_number in self._children:
            return self._children[trial_number]
        run = self._call(f"starting the run of {name}", self._create_child, trial_number, name, params, tags)
        return run

    def _create_child(self, trial_number, name, params, tags) -> str:
        of = tags.get(REPEAT_TAG)
        parent = self._children.get(int(of), self.parent_id) if of is not None else self.parent_id
        base = {"mlflow.parentRunId": parent, SESSION_RUN_TAG: self.parent_id, TRIAL_TAG: str(trial_number),
                ROLE_TAG: tags.get(ROLE_TAG, "experiment"), "experiment": name}
        run_id = self.client.create_run(self.experiment_id, run_name=name, tags=base).info.run_id
        self._children[trial_number] = run_id
        self._log_batch(run_id, params=params, tags=tags, step=max(trial_number, 0))
        return run_id

    def child_finished(self, trial_number: int, name: str, params: Dict[str, Any], metrics: Dict[str, float], tags: Dict[str, str],
                       exp_dir: Optional[str], status: str) -> None:
        """Log the experiment's result and end its run; a run missed during an outage is created now."""
        if self.parent_id is None:
            return
        self._call(f"finishing the run of {name}", self._finish_child, trial_number, name, params, metrics, tags, exp_dir, status)

    def _finish_child(self, trial_number, name, params, metrics, tags, exp_dir, status) -> None:
        run_id = self._children.get(trial_number) or self._create_child(trial_number, name, {}, {k: v for k, v in tags.items() if k in (ROLE_TAG, REPEAT_TAG)})
        self._log_batch(run_id, params=params, metrics=metrics, tags=tags, step=max(trial_number, 0))
        if exp_dir and Path(exp_dir).is_dir():
            self._upload(run_id, Path(exp_dir), "experiment")
        self.client.set_terminated(run_id, status=status)

    def fill_in(self, study, memory_limit_bytes: Optional[int] = None) -> int:
        """Finish, from the study, the child runs of measured trials that MLflow lacks or shows
        otherwise (an outage, or a session killed between recording a result and tracking it):
        the study is the record, the runs follow it. The number of runs filled in."""
        if self.parent_id is None:
            return 0
        runs = self._call("reading the child runs", self._child_runs)
        if runs is None:
            return 0
        filled = 0
        for t in study.get_trials(deepcopy=False):
            result = t.user_attrs.get("result")
            if result is None or "duplicate_of" in t.user_attrs:
                continue
            status = mlflow_status(result["status"])
            if t.number in runs and runs[t.number].info.status == status:
                continue
            params, metrics, tags = child_payload(t.user_attrs.get("params") or {}, result, memory_limit_bytes)
            if "repeat_of" in t.user_attrs:
                tags[REPEAT_TAG] = str(t.user_attrs["repeat_of"])
            self.child_finished(t.number, result["name"], params, metrics, tags, result.get("exp_dir"), status)
            filled += 1
        return filled

    def log_configuration(self, trial_number: int, metric: str, values: List[float], value: Optional[float], step: int) -> None:
        """A configuration's run shows its value: `metric` is the median of its measurements (its
        history: the value after each measurement), `measurements` how many there are."""
        run_id = self._children.get(trial_number)
        if run_id is None or value is None:
            return
        tags = {"measurements": " ".join(f"{v:.6g}" for v in values)}
        self._call("logging a configuration's value", self._log_batch, run_id, metrics={metric: value, "measurements": len(values)}, tags=tags, step=step)

    def run_id_of(self, trial_number: int) -> Optional[str]:
        return self._children.get(trial_number)

    def kill_open_children(self) -> None:
        for run_id in self._children.values():
            self._call("ending a run", self._kill_if_running, run_id)

    def _kill_if_running(self, run_id: str) -> None:
        if self.client.get_run(run_id).info.status == "RUNNING":
            self.client.set_terminated(run_id, status="KILLED")

    def child_env(self, trial_number: int) -> Dict[str, str]:
        """The environment that sends the experiment's own MLflow logging into its child run."""
        run_id = self._children.get(trial_number)
        if run_id is None:
            return {}
        return {"MLFLOW_RUN_ID": run_id, "MLFLOW_TRACKING_URI": self.tracking_uri, "MLFLOW_EXPERIMENT_ID": str(self.experiment_id)}

    # ---- the one way data goes out ---------------------------------------------------------
    def _log_batch(self, run_id: str, params: Optional[Dict[str, Any]] = None, metrics: Optional[Dict[str, float]] = None,
                   tags: Optional[Dict[str, str]] = None, step: int = 0) -> None:
        """Params (new ones only: MLflow params are immutable), metrics at `step` and now, tags:
        keys cleaned, values redacted; values longer than MLflow allows go to `long_values/`."""
        now = int(time.time() * 1000)
        params = clean_keys({k: v for k, v in (params or {}).items() if v not in (None, "")})
        if params:
            logged = self.client.get_run(run_id).data.params
            params = {k: v for k, v in params.items() if k not in logged}
        ps, long_values = [], {}
        for k, v in params.items():
            text = str(redact(v, k))
            if len(text) > MAX_PARAM_LEN:
                long_values[k] = text
                text = text[: MAX_PARAM_LEN - 60] + f" ... [full value: {LONG_VALUES_DIR}/{k}.txt]"
            ps.append(Param(k, text))
        ms = [Metric(k, float(v), now, int(step)) for k, v in clean_keys(metrics or {}).items() if isinstance(v, (int, float)) and v == v]
        ts = []
        for k, v in (tags or {}).items():
            key = k if k.startswith("mlflow.") else clean_key(k)
            text = str(redact(v, k))
            if len(text) > MAX_TAG_LEN:
                long_values[key] = text
                text = text[: MAX_TAG_LEN - 60] + f" ... [full value: {LONG_VALUES_DIR}/{key}.txt]"
            ts.append(RunTag(key, text))
        for i in range(0, max(len(ps), len(ms), len(ts), 1), 100):
            self.client.log_batch(run_id, metrics=ms[i : i + 100], params=ps[i : i + 100], tags=ts[i : i + 100])
        for k, text in long_values.items():
            self.client.log_text(run_id, text, f"{LONG_VALUES_DIR}/{k}.txt")

    def _upload(self, run_id: str, path: Path, artifact_path: Optional[str]) -> None:
        """Upload a file or folder with every text file redacted (logs, configs, commands)."""
        with tempfile.TemporaryDirectory(prefix="mlautotune-upload-") as tmp:
            copy = Path(tmp) / path.name
            files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
            for f in files:
                target = copy if path.is_file() else copy / f.relative_to(path)
                target.parent.mkdir(parents=True, exist_ok=True)
                redacted_copy(f, target)
            if path.is_file():
                self.client.log_artifact(run_id, str(copy), artifact_path=artifact_path)
            else:
                self.client.log_artifacts(run_id, str(copy), artifact_path=artifact_path)


def redacted_copy(src: Path, dst: Path) -> None:
    """Copy a file for upload: text files with secrets masked, JSON by key as well, binaries as they are."""
    import json

    if src.suffix.lower() not in TEXT_SUFFIXES:
        shutil.copyfile(src, dst)
        return
    text = src.read_text(errors="replace")
    if src.suffix.lower() == ".json":
        try:
            dst.write_text(json.dumps(redact(json.loads(text)), indent=2) + "\n")
            return
        except ValueError:
            pass
    dst.write_text(redact_text(text))


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return redact_text(text.splitlines()[0][:300]) if text else type(e).__name__


def as_number(v: Any) -> Optional[float]:
    if isinstance(v, bool):
        return float(v)
    return float(v) if isinstance(v, (int, float)) else None


def child_payload(params: Dict[str, Any], result: Dict[str, Any], memory_limit_bytes: Optional[int] = None) -> tuple:
    """Params, metrics and tags of one experiment's child run, under plain names. Numeric knobs are
    also metrics (they sort and plot as numbers); `ok` is 1 or 0 so failures can be filtered out.
    The full ds_config is the `experiment/ds_config.json` artifact, not params."""
    knobs = {"stage": params.get("stage"), "micro_batch_size": params.get("micro_batch"), "gradient_accumulation_steps": params.get("gas")}
    knobs.update({k: v for k, v in params.items() if k not in ("stage", "micro_batch", "gas")})
    measured = result.get("metrics", {}) or {}
    p = {**knobs, "train_batch_size": measured.get("train_batch_size"), "memory_limit_bytes": memory_limit_bytes}
    keys = ("throughput", "latency", "FLOPS_per_gpu", "peak_memory_bytes", "step_time_median_ms", "step_time_min_ms", "step_time_max_ms",
            "step_time_spread", *WINDOW_KEYS, "end_to_end_throughput", "num_params", "trainable_num_params")
    metrics = {k: measured[k] for k in keys if as_number(measured.get(k)) is not None}
    metrics.update({k: as_number(v) for k, v in knobs.items() if as_number(v) is not None})
    if memory_limit_bytes:
        metrics["memory_limit_bytes"] = memory_limit_bytes
        if metrics.get("peak_memory_bytes"):
            metrics["peak_memory_fraction"] = metrics["peak_memory_bytes"] / memory_limit_bytes
    status = result.get("status", "running")
    if status != "running":
        metrics["wall_time_s"] = result.get("wall_time_s", 0.0)
        metrics["ok"] = 1.0 if status == "ok" else 0.0
    tags = {"status": status, "experiment": result.get("name", "")}
    if result.get("reason"):
        tags["failure_reason"] = result["reason"][-4000:]
    return {k: v for k, v in p.items() if v is not None}, metrics, tags


def experiment_runs(client: MlflowClient, experiment_id: str, parent_id: str) -> Dict[int, Any]:
    """A parent run's experiment runs by trial number: its children, and the re-measurements nested
    under their configuration's run."""
    runs = [r for key in ("mlflow.parentRunId", SESSION_RUN_TAG) for r in client.search_runs(
        [experiment_id], filter_string=f"tags.{key} = '{parent_id}'", max_results=5000)]
    return {int(r.data.tags[TRIAL_TAG]): r for r in runs if TRIAL_TAG in r.data.tags}


def parent_status(session_status: Optional[str]) -> str:
    """A session's status (complete | partial | failed) as the parent run's MLflow status."""
    return {"complete": "FINISHED", "partial": "KILLED", "failed": "FAILED"}.get(session_status or "", "KILLED")


def mlflow_status(result_status: str) -> str:
    return "FINISHED" if result_status == "ok" else "KILLED" if result_status == "interrupted" else "FAILED"


class TrackingObserver:
    """Turns the search's events into child runs, gives each experiment its child run's id, and
    logs the session's progress on the parent (step = the Optuna trial number)."""

    def __init__(self, tracker: Tracker, metric: str, memory_limit_bytes: Optional[int] = None):
        self.tracker, self.metric, self.memory_limit_bytes = tracker, metric, memory_limit_bytes
        self.metric_key = METRIC_KEYS[metric]  # the child runs' name of the metric
        self._running: Dict[str, int] = {}  # experiment name -> trial number

    def experiment_started(self, exp, trial) -> None:
        self._running[exp.name] = trial.number
        params, metrics, _ = child_payload(exp.params, {"status": "running", "name": exp.name}, self.memory_limit_bytes)
        tags = {"status": "running", "experiment": exp.name}
        if trial.user_attrs.get("repeat_of") is not None:
            tags[REPEAT_TAG] = str(trial.user_attrs["repeat_of"])
        self.tracker.child_started(trial.number, exp.name, params, tags)
        exp.env.update(self.tracker.child_env(trial.number))

    def experiment_finished(self, exp, measured, best) -> None:
        number = self._running.pop(exp.name, measured.trial_number)
        params, metrics, tags = child_payload(exp.params, measured.result.to_dict(), self.memory_limit_bytes)
        self.tracker.child_finished(number, exp.name, params, metrics, tags, measured.result.exp_dir, mlflow_status(measured.result.status))
        # best first: the MLflow UI lists a run's metrics in the order they were first logged, and
        # the latest experiment's value at the top of the parent's list reads like the result
        progress = {f"best_{self.metric}": best.final_value} if best is not None and best.value is not None else {}
        if measured.value is not None:
            progress[f"experiment_{self.metric}"] = measured.value
        self.tracker.log_parent(progress, step=number)

    def remeasured(self, base, measured) -> None:
        """A re-measurement ended: its configuration's run shows the new median."""
        self.tracker.log_configuration(base.trial_number, self.metric_key, base.values, base.final_value, step=measured.trial_number)
