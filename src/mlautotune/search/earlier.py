"""Where a warm start's earlier measurements come from: the other studies in the session's Optuna
storage that measured the same model, matched by fingerprint (search/warm.py says how the search
uses them).

The fingerprint is a hash of the training script's content, the precision and optimizer of the
user's ds_config (or the script's --optim), and the sequence length when the script's arguments give
it. Other script arguments (a learning rate, a step count) do not change it; the parameter count,
known only once a run reports it, is checked by the search (Earlier.num_params).

Earlier studies are only read, never written: a study that cannot be read is skipped with a note.
"""

import hashlib
import json
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import optuna
from optuna.trial import TrialState

from mlautotune.inputs.planned import sequence_length
from mlautotune.inputs.scriptargs import get_flag
from mlautotune.search.ledger import Measured, experiments_in, measured_in
from mlautotune.search.warm import Earlier

MAX_SESSIONS = 3  # the newest matching sessions that a warm start uses


def precision(ds_config: Dict[str, Any], script_args: List[str]) -> str:
    """fp16, bf16 or fp32, as the ds_config sets it ("auto": as the script's --fp16 / --bf16 do)."""
    for kind in ("bf16", "fp16"):
        enabled = (ds_config.get(kind) or {}).get("enabled", False) if isinstance(ds_config.get(kind), dict) else False
        if enabled is True or (enabled == "auto" and _switched_on(script_args, f"--{kind}")):
            return kind
    return "fp32"


def _switched_on(args: List[str], flag: str) -> bool:
    """A Trainer switch: `--bf16`, `--bf16 true` or `--bf16=true` (not `--bf16 false`)."""
    if not any(a == flag or a.startswith(flag + "=") for a in args):
        return False
    value = get_flag(args, flag)
    return value is None or value.startswith("--") or value.lower() not in ("false", "0", "no")


def optimizer(ds_config: Dict[str, Any], script_args: List[str]) -> str:
    """The ds_config's optimizer.type, else a Trainer script's --optim, else "script" (the script makes its own)."""
    kind = (ds_config.get("optimizer") or {}).get("type") if isinstance(ds_config.get("optimizer"), dict) else None
    return str(kind or get_flag(script_args, "--optim") or "script").lower()


def fingerprint(script: Path, ds_config: Dict[str, Any], script_args: List[str]) -> str:
    """What makes two sessions measure the same model (the module's docstring)."""
    tokens = sequence_length(script_args)
    blob = json.dumps({"script": hashlib.sha256(Path(script).read_bytes()).hexdigest(), "precision": precision(ds_config, script_args),
                       "optimizer": optimizer(ds_config, script_args), "sequence_length": tokens[0] if tokens else None}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _sqlite_missing(storage: str) -> bool:
    """A sqlite storage whose file does not exist yet (opening it would create it)."""
    if not storage.startswith("sqlite:///"):
        return False
    path = storage[len("sqlite:///"):]
    return path not in ("", ":memory:") and not Path(path).exists()


def find_earlier(storage: str, study_name: str, key: str, hardware: Dict[str, Any],
                 note: Callable[[str], None] = lambda text: None, only: Optional[List[str]] = None) -> Optional[Earlier]:
    """The newest MAX_SESSIONS other studies in `storage` with this fingerprint (`key`), their
    experiments as measurements numbered -1, -2, ...; None when there are none. Sessions on the same
    hardware (the study's `hardware` attribute equals `hardware`) are preferred; only when there are
    none are those on other hardware used. `only`: these studies and no others (what a resumed session
    or a report started from)."""
    if _sqlite_missing(storage):
        return None
    try:
        summaries = optuna.get_all_study_summaries(storage, include_best_trial=False)
    except Exception as e:  # an unreadable storage never fails the session
        note(f"warm start: the study storage could not be read ({type(e).__name__}); starting cold")
        return None
    matching = [s for s in summaries if s.study_name != study_name and s.user_attrs.get("fingerprint") == key
                and (only is None or s.study_name in only)]
    matching.sort(key=lambda s: s.datetime_start or datetime.min, reverse=True)
    same = [s for s in matching if s.user_attrs.get("hardware") == hardware]
    chosen = same or matching
    sessions, runs, about, num_params = [], [], {}, None
    for summary in chosen:
        if len(sessions) == MAX_SESSIONS:
            break
        try:
            study = optuna.load_study(study_name=summary.study_name, storage=storage)
            measured = measured_in(study.get_trials(deepcopy=True, states=(TrialState.COMPLETE, TrialState.FAIL)))
        except Exception as e:
            note(f"warm start: skipped the earlier session {summary.study_name}: it could not be read ({type(e).__name__})")
            continue
        if not measured:
            continue
        for m in measured:
            m.trial_number = -(len(runs) + 1)
            runs.append(m)
        sessions.append(summary.study_name)
        about[summary.study_name] = _about(summary, measured) + ("" if same else f", on {hardware_text(summary.user_attrs.get('hardware') or {})}")
        num_params = num_params or _num_params(summary.user_attrs, measured)
    if not sessions:
        return None
    return Earlier(sessions, runs, same_hardware=bool(same), num_params=num_params, about=about)


def _num_params(attrs: Dict[str, Any], measured: List[Measured]) -> Optional[int]:
    if attrs.get("num_params"):
        return int(attrs["num_params"])
    return next((int(m.result.metrics["num_params"]) for m in measured if m.result.metrics.get("num_params")), None)


def _about(summary: Any, measured: List[Measured]) -> str:
    """When it started, how many experiments it ran, its optimum."""
    words = [f"{summary.datetime_start:%Y-%m-%d %H:%M}"] if summary.datetime_start else []
    n = experiments_in(measured)
    words.append(f"{n} experiment{'s' * (n != 1)}")
    optimum = summary.user_attrs.get("optimum") or {}
    if optimum.get("experiment"):
        words.append(f"optimum {optimum['experiment']}")
    return ", ".join(words)


def hardware_text(hardware: Dict[str, Any]) -> str:
    """A session's hardware in a few words: accelerator, world size, memory limit per rank."""
    gib = (hardware.get("memory_limit_per_rank") or 0) / 2**30
    return f"{hardware.get('accelerator')} x{hardware.get('world_size')}, {gib:.2f} GiB/rank"
