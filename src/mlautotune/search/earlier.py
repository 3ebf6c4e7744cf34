"""Where a warm start's earlier measurements come from: the other studies in the session's Optuna
storage that measured the same model, matched by fingerprint, and how the earlier sessions are
chosen among those found there or, when the storage holds none, in the MLflow tracking store
(track/earlier_runs.py). search/warm.py says how the search uses them.

The fingerprint is a hash of the training script's content, the precision and optimizer of the
user's ds_config (or the script's --optim), and the sequence length when the script's arguments give
it. Other script arguments (a learning rate, a step count) do not change it; the parameter count,
known only once a run reports it, is checked by the search (Earlier.num_params).

Earlier sessions are only read, never written: one that cannot be read is skipped with a note.
"""

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from functools import partial
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


def sqlite_missing(storage: str) -> bool:
    """A sqlite storage whose file does not exist yet (opening it would create it)."""
    if not storage.startswith("sqlite:///"):
        return False
    path = storage[len("sqlite:///"):]
    return path not in ("", ":memory:") and not Path(path).exists()


@dataclass
class Candidate:
    """An earlier session with the fingerprint, before its measurements are read."""

    name: str
    started: Optional[datetime]
    hardware: Dict[str, Any]  # as session_hardware gives it ({} when not recorded)
    optimum: Optional[str]  # its optimum's experiment name
    num_params: Optional[int]  # the model's parameter count, when the session recorded it
    read: Callable[[], List[Measured]]  # its measurements; raises when they cannot be read


def find_earlier(storage: str, study_name: str, key: str, hardware: Dict[str, Any],
                 note: Callable[[str], None] = lambda text: None, only: Optional[List[str]] = None) -> Optional[Earlier]:
    """The newest MAX_SESSIONS other studies in `storage` with this fingerprint (`key`), as `choose`
    picks them; None when there are none. `only`: these studies and no others (what a resumed
    session or a report started from)."""
    if sqlite_missing(storage):
        return None
    try:
        summaries = optuna.get_all_study_summaries(storage, include_best_trial=False)
    except Exception as e:  # an unreadable storage never fails the session
        note(f"warm start: the study storage could not be read ({type(e).__name__}); starting cold")
        return None

    def read(name: str) -> List[Measured]:
        study = optuna.load_study(study_name=name, storage=storage)
        return measured_in(study.get_trials(deepcopy=True, states=(TrialState.COMPLETE, TrialState.FAIL)))

    return choose([Candidate(s.study_name, s.datetime_start, s.user_attrs.get("hardware") or {}, (s.user_attrs.get("optimum") or {}).get("experiment"),
                             int(s.user_attrs["num_params"]) if s.user_attrs.get("num_params") else None, partial(read, s.study_name))
                   for s in summaries if s.study_name != study_name and s.user_attrs.get("fingerprint") == key and (only is None or s.study_name in only)],
                  hardware, note)


def choose(candidates: List[Candidate], hardware: Dict[str, Any], note: Callable[[str], None] = lambda text: None,
           store: Optional[str] = None) -> Optional[Earlier]:
    """The newest MAX_SESSIONS candidates that measured something, their experiments as measurements
    numbered -1, -2, ...; None when there are none. Sessions on the same hardware (their `hardware`
    equals `hardware`) are preferred, then those that differ in memory size only (the same accelerator
    and world size: their peaks hold here), then those on the same accelerator (their peaks move by
    ZeRO's model states); only when there are none are those on another accelerator used. A
    candidate that cannot be read is skipped with a note. `store`: where they were found, when not in
    the study storage (Earlier.store)."""
    matching = sorted(candidates, key=lambda c: c.started or datetime.min, reverse=True)
    same = [c for c in matching if c.hardware == hardware]
    ranks = [c for c in matching if _ranks(c.hardware) == _ranks(hardware)]  # another memory size only: their peaks hold
    accelerator = [c for c in matching if c.hardware.get("accelerator") == hardware.get("accelerator")]  # peaks move by ZeRO's states
    sessions, runs, about, optima, num_params = [], [], {}, [], None
    for c in same or ranks or accelerator or matching:
        if len(sessions) == MAX_SESSIONS:
            break
        try:
            measured = c.read()
        except Exception as e:
            note(f"warm start: skipped the earlier session {c.name}: it could not be read ({type(e).__name__})")
            continue
        if not measured:
            continue
        for m in measured:
            m.trial_number = -(len(runs) + 1)
            if m.ok and c.hardware.get("world_size"):  # the probe records it; a run read from elsewhere may lack it
                m.result.metrics.setdefault("world_size", c.hardware["world_size"])
            runs.append(m)
        sessions.append(c.name)
        optima += [c.optimum] if c.optimum else []
        about[c.name] = _about(c, measured) + ("" if same else f", on {hardware_text(c.hardware)}")
        num_params = num_params or c.num_params or _num_params(measured)
    if not sessions:
        return None
    return Earlier(sessions, runs, same_hardware=bool(same), same_ranks=bool(same or ranks), num_params=num_params, about=about, store=store,
                   optima=optima, same_accelerator=bool(same or ranks or accelerator))


def _ranks(hardware: Dict[str, Any]) -> Dict[str, Any]:
    """The hardware less its memory sizes: what a run's peak depends on (the accelerator, the world size)."""
    return {k: v for k, v in hardware.items() if k not in ("device_memory_bytes", "memory_limit_per_rank")}


def _num_params(measured: List[Measured]) -> Optional[int]:
    return next((int(m.result.metrics["num_params"]) for m in measured if m.result.metrics.get("num_params")), None)


def _about(c: Candidate, measured: List[Measured]) -> str:
    """When it started, how many experiments it ran, its optimum."""
    words = [f"{c.started:%Y-%m-%d %H:%M}"] if c.started else []
    n = experiments_in(measured)
    words.append(f"{n} experiment{'s' * (n != 1)}")
    if c.optimum:
        words.append(f"optimum {c.optimum}")
    return ", ".join(words)


def hardware_text(hardware: Dict[str, Any]) -> str:
    """A session's hardware in a few words: accelerator, world size, memory limit per rank."""
    gib = (hardware.get("memory_limit_per_rank") or 0) / 2**30
    return f"{hardware.get('accelerator')} x{hardware.get('world_size')}, {gib:.2f} GiB/rank"
