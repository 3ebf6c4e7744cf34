"""The ledger: every experiment is an Optuna trial of the session's study, recorded through Optuna's
public API with its real params under plain names (`stage`, `micro_batch`, `gas`, knob names).

Its value is the metric (ok runs only); its user attributes are the status and all the metrics. OOM
and failed runs are FAIL trials with their status, never a metric of 0. A trial that finished FAIL
without a result was cut off (Ctrl-C, or its process died): it is `interrupted`. RUNNING trials of
other workers are pending: the strategy treats their params as taken, and when two workers claim the
same params at once, the lower trial number keeps them.
"""

import math
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import optuna
from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler
from optuna.trial import FrozenTrial, TrialState

from mlautotune.run.experiment import Result
from mlautotune.search.candidates import params_key

CLAIM_WAIT_S = 2.0  # how long a claim waits for an earlier claim still being written (a dead one stays RUNNING until its heartbeat fails it: waited for once)
MAX_CUT_OFF = 3  # a configuration whose experiment was cut off this often is not run again

METRIC_KEYS = {"throughput": "throughput", "latency": "latency", "FLOPS": "FLOPS_per_gpu"}


@dataclass
class Measured:
    params: Dict[str, Any]
    result: Result
    trial_number: int
    value: Optional[float]
    repeats: List[float] = field(default_factory=list)  # values of re-measurements, if any

    @property
    def ok(self) -> bool:
        return self.result.status == "ok"

    @property
    def values(self) -> List[float]:
        """Its measurements: a first one whose window was disturbed is replaced by its re-measurements."""
        if self.value is None:
            return []
        return list(self.repeats) if self.repeats and self.result.metrics.get("disturbed") else [self.value, *self.repeats]

    @property
    def final_value(self) -> Optional[float]:
        """The median over the measurements of this configuration."""
        return statistics.median(self.values) if self.value is not None else None

    @property
    def single_interval(self) -> float:
        """Relative half-width of the confidence interval of one measurement: the probe's
        `interval_rel`, else half the step-time spread (a full relative range)."""
        metrics = self.result.metrics
        if "interval_rel" in metrics:
            return float(metrics["interval_rel"] or 0.0)
        return float(metrics.get("step_time_spread") or 0.0) / 2

    @property
    def interval(self) -> float:
        """The interval of this configuration's value, narrowed by re-measurements."""
        return self.single_interval / math.sqrt(1 + len(self.repeats))

    @property
    def disturbed(self) -> bool:
        """The probe saw a disturbance in the window, and no re-measurement has confirmed the value."""
        return bool(self.result.metrics.get("disturbed")) and not self.repeats


class Fixed(BaseSampler):
    """Optuna sampler for a trial whose params the strategy chose: returns them as they are."""

    def __init__(self, params: Dict[str, Any]):
        self.params = params

    def infer_relative_search_space(self, study, trial) -> Dict[str, BaseDistribution]:
        return {}

    def sample_relative(self, study, trial, search_space) -> Dict[str, Any]:
        return {}

    def sample_independent(self, study, trial, param_name: str, param_distribution: BaseDistribution) -> Any:
        return self.params[param_name]


def experiments_in(runs: List[Measured]) -> int:
    """Launches behind these configurations: each one's first measurement and its re-measurements."""
    return sum(1 + len(m.repeats) for m in runs)


def trial_params(t: FrozenTrial) -> Dict[str, Any]:
    return dict(t.params or t.user_attrs.get("params") or {})


def claim_complete(t: FrozenTrial) -> bool:
    """Its claim is written: Ledger.claim sets the `params` attribute last."""
    return "params" in t.user_attrs


def trial_status(t: FrozenTrial) -> str:
    """ok, oom, failed, timeout, incomplete, interrupted (cut off), running, or pruned (a duplicate)."""
    if t.state == TrialState.RUNNING:
        return "running"
    if t.state == TrialState.FAIL and "result" not in t.user_attrs:
        return "interrupted"  # whatever else it holds: its process died between `record`'s writes
    return t.user_attrs.get("status") or t.state.name.lower()


def measurement_of(t: FrozenTrial) -> Measured:
    """A finished trial that holds a result, as a measurement (its value: COMPLETE trials only)."""
    return Measured(trial_params(t), Result.from_dict(t.user_attrs["result"]), t.number, t.value if t.state == TrialState.COMPLETE else None)


def measured_in(trials: List[FrozenTrial]) -> List[Measured]:
    """A study's configurations as Ledger reads them, without writing anything: its finished trials
    with a result (no duplicates, no cut-off or running ones) in trial order, re-measurements folded
    into their configuration's first measurement."""
    first: Dict[str, Measured] = {}
    for t in sorted(trials, key=lambda t: t.number):
        if t.state not in (TrialState.COMPLETE, TrialState.FAIL) or "result" not in t.user_attrs or "duplicate_of" in t.user_attrs:
            continue
        m, key = measurement_of(t), params_key(trial_params(t))
        if "repeat_of" not in t.user_attrs:
            first.setdefault(key, m)
        elif key in first and m.value is not None:
            first[key].repeats.append(m.value)
    return list(first.values())


class Budget(Exception):
    """tuner_num_trials experiments have been run."""


class Ledger:
    def __init__(self, study: optuna.Study, metric: str, distributions: Dict[str, BaseDistribution], alone: bool = True):
        self.study, self.metric, self.dists = study, metric, distributions
        self.measured: Dict[str, Measured] = {}  # params key -> first measurement
        self.order: List[Measured] = []
        self.interrupted: List[int] = []  # trials found cut off when the session resumed
        self.pending: Dict[int, Dict[str, Any]] = {}  # RUNNING trials (other workers', and this one's in flight): number -> params
        self.pending_repeats: Dict[str, int] = {}  # of those, re-measurements: params key -> how many
        self.cut_off: Dict[str, Dict[str, Any]] = {}  # configurations whose trial was cut off (a worker died or was interrupted): key -> params
        self.cut_off_times: Dict[str, int] = {}  # how often each was cut off
        self._loaded: set = set()
        self._stuck_claims: set = set()  # trials whose claim was waited for in vain: their worker died mid-claim
        self.alone = alone
        self._adopt_dead_trials(alone)
        self.refresh()

    # ---- reading the study ------------------------------------------------------------------
    def _adopt_dead_trials(self, alone: bool) -> None:
        """Trials left RUNNING by a dead process: with Optuna heartbeats, those whose heartbeat
        stopped; a tuner alone on its session (the session lock) also ends every RUNNING trial. Both
        become FAIL trials without a result, which is what `interrupted` means."""
        self._fail_stale_trials()
        for t in self.study.get_trials(deepcopy=False):
            if alone and t.state == TrialState.RUNNING:
                self.study.tell(t.number, state=TrialState.FAIL)
            if alone and t.state in (TrialState.RUNNING, TrialState.FAIL) and "result" not in t.user_attrs:
                self.interrupted.append(t.number)

    def _fail_stale_trials(self) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(self.study)

    def refresh(self) -> None:
        """Take in the trials finished since the last look (this worker's and others'), and the pending
        ones. Among workers, a pending trial whose worker stopped beating is failed first: it is free again."""
        if not self.alone:
            self._fail_stale_trials()
        self.pending, self.pending_repeats = {}, {}
        for t in self.study.get_trials(deepcopy=False):
            if t.number in self._loaded:
                continue
            if not claim_complete(t) and t.state != TrialState.COMPLETE:
                # a claim still being written (Optuna sets the params one by one after `ask`), or one
                # whose worker died before its claim was complete: nothing was launched for it
                if t.state not in (TrialState.RUNNING, TrialState.WAITING):
                    self._loaded.add(t.number)
                continue
            if t.state in (TrialState.RUNNING, TrialState.WAITING):  # this worker's own in-flight trials too
                self.pending[t.number] = trial_params(t)
                if "repeat_of" in t.user_attrs:
                    key = params_key(trial_params(t))
                    self.pending_repeats[key] = self.pending_repeats.get(key, 0) + 1
                continue
            self._loaded.add(t.number)
            if "result" in t.user_attrs and "duplicate_of" not in t.user_attrs:
                self._reuse(t)
            elif t.state == TrialState.FAIL and "repeat_of" not in t.user_attrs:
                key = params_key(trial_params(t))
                self.cut_off[key] = trial_params(t)
                self.cut_off_times[key] = self.cut_off_times.get(key, 0) + 1

    def _reuse(self, t: FrozenTrial) -> None:
        m = measurement_of(t)
        if "repeat_of" in t.user_attrs:
            base = self.measured.get(params_key(m.params))
            if base is not None and m.value is not None:
                base.repeats.append(m.value)
            return
        self._add(m)

    def _add(self, m: Measured) -> None:
        if params_key(m.params) not in self.measured:
            self.measured[params_key(m.params)] = m
            self.order.append(m)

    @property
    def experiments(self) -> int:
        """Experiments of this session so far, reused ones and re-measurements included."""
        return experiments_in(self.order)

    @property
    def spent(self) -> int:
        """What counts against tuner_num_trials: the experiments so far and every worker's running trials."""
        return self.experiments + len(self.pending)

    def taken(self) -> set:
        """Keys of every configuration measured or being measured by any worker."""
        return set(self.measured) | {params_key(p) for p in self.pending.values()}

    def to_run_again(self) -> List[Dict[str, Any]]:
        """Configurations whose experiment was cut off and that no worker has measured or is
        measuring since: they are run again before the strategy chooses anything new (a
        configuration cut off MAX_CUT_OFF times is given up)."""
        taken = self.taken()
        return [p for k, p in self.cut_off.items() if k not in taken and self.cut_off_times[k] < MAX_CUT_OFF]

    # ---- writing trials ---------------------------------------------------------------------
    def claim(self, params: Dict[str, Any], repeat_of: Optional[Measured] = None) -> Optional[optuna.Trial]:
        """A RUNNING trial with these params, or None if another worker holds them (same params in
        an earlier trial: the lower number keeps them; this trial becomes a PRUNED duplicate). The
        `params` attribute is written last: it marks the claim complete."""
        self.study.sampler = Fixed(params)
        trial = self.study.ask({k: self.dists[k] for k in params})
        if repeat_of is not None:
            trial.set_user_attr("repeat_of", repeat_of.trial_number)
        else:
            holder = self._earlier_claim(trial.number, params)
            if holder is not None:
                trial.set_user_attr("duplicate_of", holder)
                self.study.tell(trial, state=TrialState.PRUNED)
                return None
        trial.set_user_attr("params", dict(params))
        return trial

    def _earlier_claim(self, number: int, params: Dict[str, Any]) -> Optional[int]:
        """The earlier trial that holds these params, if any. An earlier claim still being written
        (its params are set one by one) is waited for, up to CLAIM_WAIT_S: it may be the holder. One
        still unwritten after that was cut off mid-claim, and is not waited for again."""
        deadline, polls = time.monotonic() + CLAIM_WAIT_S, 0
        while True:
            earlier = [t for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.COMPLETE, TrialState.FAIL)) if t.number < number]
            for t in earlier:
                if claim_complete(t) and trial_params(t) == params and "repeat_of" not in t.user_attrs and "duplicate_of" not in t.user_attrs and trial_status(t) != "interrupted":
                    return t.number
            writing = {t.number for t in earlier if t.state == TrialState.RUNNING and not claim_complete(t)} - self._stuck_claims
            if not writing:
                return None
            if polls and time.monotonic() > deadline:  # looked again at least once, however slow the storage
                self._stuck_claims |= writing
                return None
            polls += 1
            time.sleep(0.05)

    def interrupt(self, trial: optuna.Trial) -> None:
        trial.set_user_attr("status", "interrupted")
        self.study.tell(trial, state=TrialState.FAIL)

    def value_of(self, result: Result) -> Optional[float]:
        if result.status != "ok":
            return None
        v = result.metrics.get(METRIC_KEYS[self.metric])
        return float(v) if v is not None and math.isfinite(float(v)) else None

    def record(self, trial: optuna.Trial, params: Dict[str, Any], result: Result, repeat_of: Optional[Measured] = None) -> Measured:
        value = self.value_of(result)
        if result.status == "ok" and value is None:
            result.status, result.reason = "failed", f"metrics.json has no {METRIC_KEYS[self.metric]}"
        trial.set_user_attr("status", result.status)
        trial.set_user_attr("result", result.to_dict())
        for k, v in result.metrics.items():
            if isinstance(v, (int, float)):
                trial.set_user_attr(f"metric.{k}", v)
        if value is None:
            self.study.tell(trial, state=TrialState.FAIL)
        else:
            self.study.tell(trial, value)
        self._loaded.add(trial.number)
        m = Measured(dict(params), result, trial.number, value)
        if repeat_of is not None:
            if value is not None:
                repeat_of.repeats.append(value)
        else:
            self._add(m)
        return m
