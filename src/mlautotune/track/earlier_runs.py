"""A warm start's earlier sessions from the MLflow tracking store, for when the study storage holds
none (a new results folder, a fresh sqlite): the parent runs of the session's MLflow experiment
tagged with the same fingerprint, their experiment runs rebuilt as the measurements their study
holds. search/earlier.py chooses among them as among studies.

What comes back from what track/tracking.py logs:
- a parent run: its name (the session), start time, tags `hardware` (JSON, as the study's attribute;
  a parent without it, logged before the tag existed, has the same facts in its `hardware.*` params)
  and `best_experiment`;
- an experiment run: params `stage`, `micro_batch_size`, `gradient_accumulation_steps` and the
  knobs under their own names (their text read back as booleans, numbers or text), tags `status`
  and `failure_reason`, and its metrics (the metric's value on ok runs, peak memory, interval,
  parameter count, `wall_time_s`);
- a re-measurement's run (tag `mlautotune.repeat_of`): one more value of its configuration. The
  configuration's own run shows their median as its metric; its first value is the metric's entry
  at the earliest step.
Runs still running or cut off (`interrupted`) are left out, as measured_in leaves such trials out.

Only reads: a local store that does not exist (a sqlite file, a folder) is not opened, since opening
it would create it, and a store that cannot be read is a note and a cold start.
"""

import json
import re
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional
from urllib.parse import unquote, urlparse

from mlflow.tracking import MlflowClient

from mlautotune.redact import redact_text
from mlautotune.run.experiment import Result
from mlautotune.search import METRIC_KEYS
from mlautotune.search.candidates import params_key
from mlautotune.search.earlier import Candidate, choose, sqlite_missing
from mlautotune.search.ledger import Measured
from mlautotune.search.warm import Earlier
from mlautotune.track.tracking import REPEAT_TAG, ROLE_TAG, SESSION_TAG, experiment_runs, quick_http, store_uri

HARDWARE_TAG = "hardware"  # on the parent run: the session's hardware as JSON (commands.warm_tags)
NOT_KNOBS = ("stage", "micro_batch_size", "gradient_accumulation_steps", "train_batch_size", "memory_limit_bytes")


def store_missing(uri: str) -> bool:
    """A local store that does not exist yet: a sqlite file, or a file store's folder."""
    scheme = urlparse(uri).scheme
    if scheme in ("", "file") or len(scheme) == 1:  # a path (a Windows drive letter is a one-letter scheme)
        return not Path(unquote(urlparse(uri).path) if scheme == "file" else uri).expanduser().exists()
    return sqlite_missing(uri)


def find_earlier_runs(tracking_uri: Optional[str], experiment_name: str, key: str, hardware: Dict[str, Any], metric: str,
                      note: Callable[[str], None] = lambda text: None, only: Optional[List[str]] = None,
                      exclude: Optional[str] = None) -> Optional[Earlier]:
    """The newest earlier sessions with this fingerprint (`key`) among the parent runs of
    `experiment_name` in the tracking store, as search/earlier.py's `choose` picks them; None when
    there are none. `only`: these parent runs (by name) and no others; `exclude`: this session's
    own parent run id. A parent run of this session's name counts: the same settings tuned in another
    results folder."""
    uri = store_uri(tracking_uri)
    if not re.fullmatch(r"[0-9a-f]+", key or "") or store_missing(uri):
        return None
    quick_http()
    try:
        client = MlflowClient(uri)
        experiment = client.get_experiment_by_name(experiment_name)
        if experiment is None:
            return None
        parents = client.search_runs([experiment.experiment_id], filter_string=f"tags.fingerprint = '{key}' and tags.`{ROLE_TAG}` = 'session'",
                                     max_results=1000)
    except Exception as e:  # an unreadable store never fails the session
        note(f"warm start: the MLflow store {redact_text(uri)} could not be read ({type(e).__name__}); starting cold")
        return None
    read = partial(measured_runs, client, experiment.experiment_id, metric=metric)
    candidates = [Candidate(run.info.run_name or run.data.tags.get(SESSION_TAG, run.info.run_id), started(run), run_hardware(run),
                            run.data.tags.get("best_experiment") or None, None, partial(read, run.info.run_id))
                  for run in parents if run.info.run_id != exclude and (only is None or run.info.run_name in only)]
    return choose(candidates, hardware, note, store=redact_text(uri))


def started(run: Any) -> Optional[datetime]:
    return datetime.fromtimestamp(run.info.start_time / 1000) if run.info.start_time else None


def run_hardware(run: Any) -> Dict[str, Any]:
    """The parent run's `hardware` tag; without one (a parent logged before the tag existed), the same
    facts from its `hardware.*` params; {} when neither is there or readable (then it is other hardware)."""
    if HARDWARE_TAG not in run.data.tags:
        return _hardware_from_params(run.data.params)
    try:
        hardware = json.loads(run.data.tags[HARDWARE_TAG])
    except ValueError:
        return {}
    return hardware if isinstance(hardware, dict) else {}


def _hardware_from_params(params: Dict[str, str]) -> Dict[str, Any]:
    """session_hardware's keys from the params every parent run logs (session.hardware_params)."""
    try:
        memory = params.get("hardware.device_memory_bytes")
        return {"accelerator": params["hardware.accelerator"], "device_memory_bytes": int(memory) if memory else None,
                "world_size": int(params["hardware.world_size"]), "memory_limit_per_rank": int(params["hardware.memory_limit_per_rank_bytes"])}
    except (KeyError, ValueError):
        return {}


def measured_runs(client: MlflowClient, experiment_id: str, parent_id: str, metric: str) -> List[Measured]:
    """A parent run's experiments as measurements, in trial order, re-measurements folded into their
    configuration's first measurement (as ledger.measured_in reads a study)."""
    key = METRIC_KEYS[metric]
    first: Dict[str, Measured] = {}
    runs = experiment_runs(client, experiment_id, parent_id)
    for number in sorted(n for n in runs if n >= 0):
        run = runs[number]
        tags, metrics = run.data.tags, dict(run.data.metrics)
        status = tags.get("status")
        if tags.get(ROLE_TAG, "experiment") != "experiment" or status in (None, "running", "interrupted"):
            continue
        value = metrics.get(key) if status == "ok" else None
        if status == "ok" and value is None:
            continue  # its result was never logged in full
        params = run_params(run.data.params)
        if REPEAT_TAG in tags:
            if params_key(params) in first and value is not None:
                first[params_key(params)].repeats.append(value)
            continue
        result = Result(tags.get("experiment") or run.info.run_name, status, metrics, tags.get("failure_reason", ""), metrics.get("wall_time_s", 0.0))
        first.setdefault(params_key(params), Measured(params, result, number, value))
    for m in first.values():
        if m.repeats:  # the run's metric is the configuration's median now: its first value is the earliest entry
            history = client.get_metric_history(runs[m.trial_number].info.run_id, key)
            m.value = m.result.metrics[key] = min(history, key=lambda h: (h.step, h.timestamp)).value
    return list(first.values())


def run_params(logged: Dict[str, str]) -> Dict[str, Any]:
    """The search's params from an experiment run's: stage, micro_batch, gas and the knobs."""
    params = {"stage": _value(logged["stage"]), "micro_batch": _value(logged["micro_batch_size"]), "gas": _value(logged["gradient_accumulation_steps"])}
    params.update({k: _value(v) for k, v in logged.items() if k not in NOT_KNOBS})
    return params


def _value(text: str) -> Any:
    """A param's text as the value it was logged from: a boolean, None, a whole number, a number, else the text."""
    if text in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[text]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
