"""The search: stages in order, the largest runnable micro-batch per stage, then the sampler's trials.

Every experiment is an Optuna trial (ask/tell). Its params are the tuned values, its value the
metric (ok runs only), and its user attributes the status and all the metrics. OOM and failed
runs are FAIL trials with their status: they are never scored as a metric of 0. The same
params are never run twice in a session (except deliberate re-measurements of near-ties), which
is also what makes a resumed session skip what it already measured.
"""

import hashlib
import json
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from mlautotune.experiment import Experiment, Result
from mlautotune.memory import MemoryModel
from mlautotune.samplers import build_sampler
from mlautotune.samplers.cost_model import CostModel, same_but_micro_batch
from mlautotune.space import TuningPlan, tuned_knobs

METRIC_KEYS = {"throughput": "throughput", "latency": "latency", "FLOPS": "FLOPS_per_gpu"}
MAX_DUPLICATE_PROPOSALS = 50
MAX_TIE_TOLERANCE = 0.10  # leaders further apart than this are not near-ties, whatever the spread


@dataclass
class SearchSettings:
    metric: str = "throughput"
    tuner_type: str = "model_based"
    seed: int = 0
    early_stopping: int = 5
    num_trials: int = 50
    num_tuning_micro_batch_sizes: int = 3
    remeasure: int = 2
    memory_limit_bytes: Optional[int] = None
    world_size: int = 1
    device: str = "cpu"
    sampler_target: Optional[Dict[str, Any]] = None

    @property
    def maximize(self) -> bool:
        return self.metric != "latency"


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
    def final_value(self) -> Optional[float]:
        """The median over all measurements of this configuration."""
        if self.value is None:
            return None
        return statistics.median([self.value, *self.repeats])

    @property
    def spread(self) -> float:
        """Relative spread: over repeated measurements if there are any, else of the step times."""
        values = [self.value, *self.repeats] if self.value is not None else []
        if len(values) > 1:
            return (max(values) - min(values)) / statistics.median(values)
        return float(self.result.metrics.get("step_time_spread", 0.0))


@dataclass
class Outcome:
    best: Optional[Measured]
    stage_best: Dict[int, Measured]
    measured: List[Measured]  # in run order, re-measurements folded into their configuration
    experiments: int  # launches actually run in this session (reused results excluded)
    notes: List[str] = field(default_factory=list)


class Budget(Exception):
    """tuner_num_trials experiments have been run."""


def params_key(params: Dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True, default=str)


def result_from_trial(t: optuna.trial.FrozenTrial) -> Result:
    return Result.from_dict(t.user_attrs["result"])


def trial_params(t: optuna.trial.FrozenTrial) -> Dict[str, Any]:
    """A trial's configuration: Optuna's param names are qualified (see space_prefix); the plain
    params are in user_attrs."""
    return dict(t.user_attrs.get("params") or {k.split("/")[-1]: v for k, v in t.params.items()})


class Tuner:
    def __init__(
        self,
        plan: TuningPlan,
        settings: SearchSettings,
        study: optuna.Study,
        make_experiment: Callable[[Dict[str, Any]], Experiment],
        run: Callable[[Experiment], Result],
        observers: Any = (),
    ):
        self.plan, self.s, self.study = plan, settings, study
        self.make_experiment, self.run_experiment = make_experiment, run
        self.observers = list(observers)
        self.memory: Optional[MemoryModel] = None
        self.notes: List[str] = []
        self.launched = 0  # experiments started by this process
        self._fixed_sampler = optuna.samplers.RandomSampler(seed=settings.seed)
        self._measured: Dict[str, Measured] = {}  # params key -> first measurement
        self._order: List[Measured] = []
        self._requeue: List[Dict[str, Any]] = []
        self._load_history()

    # ---- history and resume -------------------------------------------------------------
    def _load_history(self) -> None:
        """Reuse every finished experiment of this study; re-queue those that were interrupted."""
        self.interrupted: List[int] = []
        for t in self.study.get_trials(deepcopy=False):
            if t.state == TrialState.RUNNING:  # its tuner died (SIGKILL, node failure)
                self._mark_interrupted(t.number)
            elif t.user_attrs.get("status") != "interrupted":
                if "result" in t.user_attrs and "duplicate_of" not in t.user_attrs:
                    self._reuse(t)
                continue
            self.interrupted.append(t.number)
            if "repeat_of" not in t.user_attrs and trial_params(t):
                self._requeue.append(trial_params(t))
        self._requeue = [p for p in self._requeue if params_key(p) not in self._measured]

    def _reuse(self, t: optuna.trial.FrozenTrial) -> None:
        m = Measured(trial_params(t), result_from_trial(t), t.number, t.value if t.state == TrialState.COMPLETE else None)
        if "repeat_of" in t.user_attrs:
            base = self._measured.get(params_key(m.params))
            if base is not None and m.value is not None:
                base.repeats.append(m.value)
            return
        self._measured[params_key(m.params)] = m
        self._order.append(m)

    def _mark_interrupted(self, number: int) -> None:
        trial_id = self.study._storage.get_trial_id_from_study_id_trial_number(self.study._study_id, number)
        self.study._storage.set_trial_user_attr(trial_id, "status", "interrupted")
        self.study.tell(number, state=TrialState.FAIL)

    @property
    def experiments(self) -> int:
        """Experiments of this session so far, reused ones included (tuner_num_trials counts these)."""
        return sum(1 + len(m.repeats) for m in self._order)

    # ---- running one configuration -------------------------------------------------------
    def value_of(self, result: Result) -> Optional[float]:
        if result.status != "ok":
            return None
        v = result.metrics.get(METRIC_KEYS[self.s.metric])
        return float(v) if v is not None and math.isfinite(float(v)) else None

    def measure(self, params: Dict[str, Any], trial: Optional[optuna.Trial] = None, repeat_of: Optional[Measured] = None) -> Measured:
        """Run one configuration (or return its earlier measurement) and record it in the study."""
        key = params_key(params)
        if repeat_of is None and key in self._measured:
            if trial is not None:
                self._tell_duplicate(trial, self._measured[key])
            return self._measured[key]
        if self.experiments >= self.s.num_trials and repeat_of is None:
            if trial is not None:
                self.study.tell(trial, state=TrialState.PRUNED)
            raise Budget()
        if trial is None:
            trial = self._ask_fixed(params)
        trial.set_user_attr("params", dict(params))
        exp = self.make_experiment(params)
        if repeat_of is not None:
            exp.name = f"{exp.name}_rep{len(repeat_of.repeats) + 1}"
            trial.set_user_attr("repeat_of", repeat_of.trial_number)
        trial.set_user_attr("name", exp.name)
        self._notify("experiment_started", exp, trial)
        self.launched += 1
        try:
            result = self.run_experiment(exp)
        except BaseException:  # Ctrl-C / SIGTERM: the trial is interrupted, to be run again on resume
            trial.set_user_attr("status", "interrupted")
            self.study.tell(trial, state=TrialState.FAIL)
            raise
        value = self.value_of(result)
        if result.status == "ok" and value is None:
            result.status, result.reason = "failed", f"metrics.json has no {METRIC_KEYS[self.s.metric]}"
        trial.set_user_attr("status", result.status)
        trial.set_user_attr("result", result.to_dict())
        for k, v in result.metrics.items():
            if isinstance(v, (int, float)):
                trial.set_user_attr(f"metric.{k}", v)
        if value is None:
            self.study.tell(trial, state=TrialState.FAIL)
        else:
            self.study.tell(trial, value)
        m = Measured(dict(params), result, trial.number, value)
        if repeat_of is not None:
            if value is not None:
                repeat_of.repeats.append(value)
        else:
            self._measured[key] = m
            self._order.append(m)
        self._observe_memory(m)
        self._notify("experiment_finished", exp, m, self.best())
        return m

    def _ask_fixed(self, params: Dict[str, Any]) -> optuna.Trial:
        """A trial for a configuration the strategy chose itself (no sampler involved)."""
        self.study.sampler = self._fixed_sampler  # also the one whose after_trial sees the tell
        return self.study.ask()

    def _tell_duplicate(self, trial: optuna.Trial, earlier: Measured) -> None:
        trial.set_user_attr("duplicate_of", earlier.trial_number)
        self.study.tell(trial, state=TrialState.PRUNED)

    def _observe_memory(self, m: Measured) -> None:
        peak = m.result.metrics.get("peak_memory_bytes")
        if self.memory is not None and m.result.status in ("ok", "oom"):
            self.memory.observe(m.params["stage"], m.params["micro_batch"], int(peak) if peak else None, m.result.status == "oom")

    def _notify(self, event: str, *args: Any) -> None:
        for observer in self.observers:
            if hasattr(observer, event):
                getattr(observer, event)(*args)

    def note(self, text: str) -> None:
        self.notes.append(text)
        self._notify("note", text)

    # ---- the strategy ----------------------------------------------------------------------
    def tune(self) -> Outcome:
        try:
            self._profile()
            previous: Optional[Measured] = None
            for stage in self.plan.stages:
                best = self._tune_stage(stage)
                if self._stop_after(stage, best, previous):
                    break
                previous = best if best is not None else previous
            self._refit_edge()
        except Budget:
            self.note(f"stopped: tuner_num_trials={self.s.num_trials} experiments run")
        try:
            self._remeasure_leaders()
        except Budget:
            pass
        return self.outcome()

    def base_params(self, stage: int, mbs: int) -> Dict[str, Any]:
        return base_params(self.plan, stage, mbs)

    def _profile(self) -> None:
        """Model-info profiling: peak memory at two micro-batch sizes of the first stage -> the memory model.

        Both runs are ordinary experiments (and usually useful candidates), so profiling costs
        little. One point and a failed second still give a usable model (with the formula's slope).
        """
        points = [self.measure(p) for p in first_experiments(self.plan, self.s.world_size)]
        info = next((p.result.metrics for p in points if p.ok), None)
        if info is None or not info.get("num_params"):
            self.note("model-info profiling got no successful run: the memory model is off, micro-batches are searched by doubling")
            return
        self.memory = MemoryModel(
            num_params=int(info["num_params"]),
            trainable_params=int(info.get("trainable_num_params", info["num_params"])),
            ds_config=self.plan.base_config,
            world_size=self.s.world_size,
            mp_size=self.plan.mp_size,
            limit_bytes=int(self.s.memory_limit_bytes or 0) or None,
            device=self.s.device,
        )
        for m in self._order:
            self._observe_memory(m)
        self._notify("profiled", self.memory, points)

    def micro_batch_cap(self) -> Optional[int]:
        return micro_batch_cap(self.plan, self.s.world_size)

    def _stage_measured(self, stage: int) -> List[Measured]:
        return [m for m in self._order if m.params.get("stage") == stage]

    def _stage_ooms(self, stage: int) -> List[int]:
        return [m.params["micro_batch"] for m in self._stage_measured(stage) if m.result.status == "oom"]

    def _tune_stage(self, stage: int) -> Optional[Measured]:
        if self.memory is not None and not self.memory.fits(stage, self.plan.micro_batch.values[0]):
            self.note(f"z{stage}: skipped, the memory model predicts OOM at micro-batch {self.plan.micro_batch.values[0]}")
            return None
        candidates = self._micro_batch_candidates(stage)
        if not candidates:
            self.note(f"z{stage}: no runnable micro-batch size")
            return self._stage_best(stage)
        space: Dict[str, List[Any]] = {"stage": [stage], "micro_batch": candidates, "gas": [self.plan.gas]}
        space.update(tuned_knobs(self.plan, stage))
        self._notify("stage_started", stage, space)
        self._explore(stage, space)
        self._refine_micro_batch(stage)
        return self._stage_best(stage)

    def _micro_batch_candidates(self, stage: int) -> List[int]:
        rule, cap = self.plan.micro_batch, self.micro_batch_cap()
        if rule.mode == "fixed":
            return list(rule.values)
        if rule.mode == "list":
            fits = [m for m in rule.values if (cap is None or m <= cap) and (self.memory is None or self.memory.fits(stage, m))]
            return sorted(fits)
        top = self._largest_runnable(stage, rule.values[0], cap)
        if top is None:
            return []
        return spaced(rule.values[0], top, self.s.num_tuning_micro_batch_sizes)

    def _largest_runnable(self, stage: int, low: int, cap: Optional[int]) -> Optional[int]:
        """Predict the largest micro-batch that fits, run it, recalibrate; bisect only where the model is wrong."""
        for _ in range(8):
            ok = [m.params["micro_batch"] for m in self._stage_measured(stage) if m.ok]
            bad = self._stage_ooms(stage)
            lo = max(ok) if ok else None
            hi = min(bad) if bad else None
            if lo is not None and ((hi is not None and hi <= lo + max(1, lo // 20)) or (cap is not None and lo >= cap)):
                return lo  # the edge to within 5%
            if hi is not None and hi <= low:
                return None
            guess = self._next_guess(stage, low, lo, hi, cap)
            if guess is None:
                return lo
            m = self.measure(self.base_params(stage, guess))
            if m.result.status not in ("ok", "oom"):
                self.note(f"z{stage}: micro-batch {guess} {m.result.status}; keeping what ran")
                return lo
        return max((m.params["micro_batch"] for m in self._stage_measured(stage) if m.ok), default=None)

    def _next_guess(self, stage: int, low: int, lo: Optional[int], hi: Optional[int], cap: Optional[int]) -> Optional[int]:
        floor = lo + 1 if lo is not None else low
        ceiling = min(x for x in (hi - 1 if hi else None, cap) if x is not None) if (hi or cap) else None
        if ceiling is not None and ceiling < floor:
            return None
        if self.memory is not None:
            predicted = self.memory.max_micro_batch(stage, cap=ceiling)
            if lo is not None and predicted <= lo:
                return None  # the model, calibrated on lo, says nothing larger fits
            guess = max(floor, predicted)
            if ceiling is not None and guess > ceiling:
                guess = ceiling
            if lo is not None and hi is not None:
                guess = max(guess, (lo + hi) // 2)  # a model calibrated on lo creeps up one at a time: bisect
            if hi is not None and len(self._stage_ooms(stage)) >= 2:
                guess = min(guess, (floor + hi) // 2)  # the model was wrong twice here: bisect rather than walk down
            return guess
        if hi is None:  # no model: double until OOM, then bisect
            guess = low if lo is None else lo * 2
            return min(guess, ceiling) if ceiling is not None else guess
        return (lo + hi) // 2 if lo is not None else max(low, hi // 2)

    def _refit_edge(self) -> None:
        """The micro-batch edge was found with each stage's default knobs, but other knobs may use
        less memory (smaller buckets, no contiguous-gradient buffer). For the leaders (the best 3
        results) that sit at the largest micro-batch run with their knobs, predict the largest that
        fits with those knobs from their own measured peak and the fitted per-sample slope, and
        verify it: one experiment per knob combination, at most 3 in all."""
        if self.memory is None or not self.memory.limit or not self.memory.per_sample or self.plan.micro_batch.mode != "min":
            return
        tried: List[Measured] = []
        while len(tried) < 3:
            ok = sorted((m for m in self._order if m.value is not None), key=lambda m: m.final_value, reverse=self.s.maximize)
            guesses = [(m, g) for m in ok[:3] if not any(same_but_micro_batch(m.params, t.params) for t in tried) and (g := self._edge_with_knobs_of(m))]
            if not guesses:
                return
            leader, guess = guesses[0]
            self.note(f"{leader.result.name}: its knobs leave memory room; trying micro-batch {guess}")
            tried.append(leader)
            self.measure({**leader.params, "micro_batch": guess})

    def _same_knobs(self, m: Measured) -> List[Measured]:
        """The runs of m's stage with m's knobs (any micro-batch), m included."""
        return [x for x in self._stage_measured(m.params["stage"]) if same_but_micro_batch(x.params, m.params)]

    def _refine_micro_batch(self, stage: int) -> None:
        """The metric is not always best at the memory edge (CPU runs, communication-bound ones),
        and the candidates are far apart: try the geometric midpoints between the stage's best
        micro-batch and its measured neighbours with the same knobs (one side at the edge, both
        inside), then again around a new best (at most 2 rounds, at most 4 experiments)."""
        if self.plan.micro_batch.mode != "min":
            return
        for _ in range(2):
            best = self._stage_best(stage)
            if best is None:
                return
            b = best.params["micro_batch"]
            sizes = sorted(x.params["micro_batch"] for x in self._same_knobs(best) if x.ok)
            below, above = [x for x in sizes if x < b], [x for x in sizes if x > b]
            mids = {round(math.sqrt(b * n)) for n in (below[-1:] + above[:1])} - set(sizes)
            mids = sorted(x for x in mids if x != b and (self.memory is None or self.memory.fits(stage, x)))
            if not mids:
                return
            self.note(f"z{stage}: refining around the best micro-batch {b}: trying {mids}")
            for mbs in mids:
                self.measure({**best.params, "micro_batch": mbs})
            if self._stage_best(stage) is best:
                return

    def _edge_with_knobs_of(self, m: Measured) -> Optional[int]:
        """A larger micro-batch predicted to fit with m's knobs, if m is the largest run with them."""
        same = self._same_knobs(m)
        peak = m.result.metrics.get("peak_memory_bytes")
        if not peak or m.params["micro_batch"] < max(x.params["micro_batch"] for x in same if x.ok) or self._pick(same) is not m:
            return None  # no peak, or the metric does not grow with the micro-batch here
        guess = m.params["micro_batch"] + int((self.memory.limit - peak) / self.memory.per_sample)
        ooms = [x.params["micro_batch"] for x in same if x.result.status == "oom"]
        for bound in (self.micro_batch_cap(), min(ooms) - 1 if ooms else None):
            guess = min(guess, bound) if bound is not None else guess
        return guess if guess > m.params["micro_batch"] else None

    def _explore(self, stage: int, space: Dict[str, List[Any]]) -> None:
        """The sampler's trials over the stage's space, with the stop rules."""
        prefix = space_prefix(stage, space)
        qualified = {f"{prefix}/{k}": v for k, v in space.items()}
        sampler = build_sampler(self.s.tuner_type, qualified, self.s.seed, self.s.sampler_target)
        dists = {k: CategoricalDistribution(v) for k, v in qualified.items()}
        total = math.prod(len(v) for v in space.values())
        duplicates = 0
        for params in [p for p in self._requeue if p.get("stage") == stage]:
            self._requeue.remove(params)
            self.measure(params)
        while True:
            decided = [m for m in self._measured.values() if in_space_of(m.params, space)]  # run, or skipped as a predicted OOM
            if len(decided) >= total:
                break
            if self._since_stage_improvement(stage) >= self.s.early_stopping:
                self.note(f"z{stage}: early stop after {self.s.early_stopping} experiments without improvement")
                break
            if self._cannot_beat_incumbent(stage, space):
                break
            self.study.sampler = sampler
            trial = self.study.ask(dists)
            params = {k: trial.params[f"{prefix}/{k}"] for k in space}
            if params_key(params) in self._measured:
                self._tell_duplicate(trial, self._measured[params_key(params)])
                self.study.sampler = self._fixed_sampler
                duplicates += 1
                if duplicates > MAX_DUPLICATE_PROPOSALS:
                    break
                continue
            if self.memory is not None and not self.memory.fits(stage, params["micro_batch"]):
                trial.set_user_attr("status", "skipped_predicted_oom")
                trial.set_user_attr("params", params)
                self.study.tell(trial, state=TrialState.PRUNED)
                self.study.sampler = self._fixed_sampler
                self._measured[params_key(params)] = Measured(params, Result("", "oom", reason="predicted OOM, not run"), trial.number, None)
                continue
            self.measure(params, trial)
            self.study.sampler = self._fixed_sampler

    def _since_stage_improvement(self, stage: int) -> int:
        best, since = None, 0
        for m in self._stage_measured(stage):
            if m.value is not None and (best is None or self.better(m.value, best)):
                best, since = m.value, 0
            else:
                since += 1
        return since

    def _cannot_beat_incumbent(self, stage: int, space: Dict[str, List[Any]]) -> bool:
        """model_based only: stop a stage once the cost model says no untried candidate can beat the incumbent."""
        if self.s.tuner_type != "model_based":
            return False
        incumbent = self.best()
        ok_here = [m for m in self._stage_measured(stage) if m.value is not None]
        if incumbent is None or len(ok_here) < 3 or incumbent.params.get("stage") == stage:
            return False
        done = [m for m in self._order if m.value is not None]
        untried = [p for p in product(space) if params_key(p) not in self._measured]
        if not untried:
            return False
        model = CostModel(seed=self.s.seed)
        model.fit([m.params for m in done], [m.value for m in done])
        predicted = model.predict(untried)
        margin = 0.05 + 2 * statistics.median([m.spread for m in done])
        optimistic = max(predicted) * (1 + margin) if self.s.maximize else min(predicted) * (1 - margin)
        if self.better(incumbent.value, optimistic):
            self.note(f"z{stage}: stopped, the cost model predicts no untried candidate beats {incumbent.result.name}")
            return True
        return False

    def _stage_best(self, stage: int) -> Optional[Measured]:
        ok = [m for m in self._stage_measured(stage) if m.value is not None]
        return self._pick(ok)

    def _stop_after(self, stage: int, best: Optional[Measured], previous: Optional[Measured]) -> bool:
        """README: stop when this stage's optimum is no better than the previous stage's, unless the
        memory model says the next stage fits a larger micro-batch than anything measured so far."""
        if best is None or previous is None or self.better(best.final_value, previous.final_value):
            return False
        later = [s for s in self.plan.stages if s > stage]
        if later and self.memory is not None and self.plan.micro_batch.mode == "min":
            largest = max(m.params["micro_batch"] for m in self._order if m.ok)
            if self.memory.max_micro_batch(later[0], cap=self.micro_batch_cap()) > largest:
                return False
        if later:
            self.note(f"z{stage}: no better than z{previous.params['stage']}; higher stages not explored")
        return True

    # ---- noise -----------------------------------------------------------------------------
    def _remeasure_leaders(self) -> None:
        """A single measurement must not crown the winner: re-measure the leaders that are within
        the measured spread of the best, then rank them by their median."""
        leaders = self.near_ties()
        if len(leaders) < 2:
            return
        self.note(f"re-measuring {len(leaders)} near-tied leaders: " + ", ".join(m.result.name for m in leaders))
        for m in leaders:
            while len(m.repeats) < self.s.remeasure:
                before = len(m.repeats)
                self.measure(m.params, repeat_of=m)
                if len(m.repeats) == before:  # the repeat failed; do not loop on it
                    break

    def near_ties(self) -> List[Measured]:
        ok = sorted((m for m in self._order if m.value is not None), key=lambda m: m.value, reverse=self.s.maximize)
        if not ok:
            return []
        best = ok[0]
        tolerance = min(max(best.spread, 0.0), MAX_TIE_TOLERANCE)
        ties = [m for m in ok[1:3] if abs(m.value - best.value) / abs(best.value) <= max(tolerance, min(m.spread, MAX_TIE_TOLERANCE))]
        return [best, *ties] if ties else [best]

    # ---- results -----------------------------------------------------------------------------
    def better(self, a: Optional[float], b: Optional[float]) -> bool:
        if a is None:
            return False
        if b is None:
            return True
        return a > b if self.s.maximize else a < b

    def _pick(self, candidates: List[Measured]) -> Optional[Measured]:
        best = None
        for m in candidates:
            if best is None or self.better(m.final_value, best.final_value):
                best = m
        return best

    def best(self) -> Optional[Measured]:
        return self._pick([m for m in self._order if m.value is not None])

    def outcome(self) -> Outcome:
        stage_best = {s: b for s in self.plan.stages if (b := self._stage_best(s)) is not None}
        return Outcome(self.best(), stage_best, list(self._order), self.launched, list(self.notes))


def space_prefix(stage: int, space: Dict[str, List[Any]]) -> str:
    """Optuna param names are `z1-3fa2c1/micro_batch`: a name may not change its choices within a
    study, and a stage's candidates can differ between sessions that share it (a resume that
    measured a different largest micro-batch)."""
    digest = hashlib.sha1(json.dumps(space, sort_keys=True, default=str).encode()).hexdigest()[:6]
    return f"z{stage}-{digest}"


def spaced(low: int, high: int, n: int) -> List[int]:
    """n micro-batch sizes from low to high inclusive, spaced evenly on a log scale, largest first.

    Log spacing because throughput against micro-batch bends early: on a CPU or a small model the
    best is often a small batch, which even spacing from the largest would step over."""
    if n <= 1 or high <= low:
        return [high]
    ratio = high / low
    return sorted({round(low * ratio ** (i / (n - 1))) for i in range(n)}, reverse=True)


def product(space: Dict[str, List[Any]]) -> List[Dict[str, Any]]:
    combos: List[Dict[str, Any]] = [{}]
    for k, values in space.items():
        combos = [{**c, k: v} for c in combos for v in values]
    return combos


def in_space_of(params: Dict[str, Any], space: Dict[str, List[Any]]) -> bool:
    return set(params) == set(space) and all(params[k] in space[k] for k in space)


def micro_batch_cap(plan: TuningPlan, world_size: int) -> int:
    """The largest micro-batch allowed: max_train_micro_batch_size_per_gpu, and max_train_batch_size if it is set."""
    cap = plan.micro_batch_max
    if plan.max_train_batch_size:
        per_mbs = plan.gas * max(1, world_size // plan.mp_size)
        cap = min(cap, max(1, plan.max_train_batch_size // per_mbs))
    return cap


def first_experiments(plan: TuningPlan, world_size: int) -> List[Dict[str, Any]]:
    """The params of the session's first experiments (the profiling runs): the first stage at the
    smallest micro-batch and at 4x (or the list's two smallest), within the caps. `plan` prints these."""
    rule, cap = plan.micro_batch, micro_batch_cap(plan, world_size)
    sizes = sorted(set(rule.values))[:2] if rule.mode == "list" else [rule.values[0]]
    if rule.mode == "min":
        sizes.append(rule.values[0] * 4)
    sizes = [m for m in sizes if m <= cap] or sizes[:1]
    return [base_params(plan, plan.stages[0], m) for m in sizes]


def base_params(plan: TuningPlan, stage: int, mbs: int) -> Dict[str, Any]:
    """Params of a micro-batch experiment: the stage's tuned knobs at DeepSpeed's defaults (or the first value)."""
    params: Dict[str, Any] = {"stage": stage, "micro_batch": mbs, "gas": plan.gas}
    defaults = deepspeed_zero_defaults(stage)
    for knob, values in tuned_knobs(plan, stage).items():
        params[knob] = defaults[knob] if defaults.get(knob) in values else values[0]
    return params


def deepspeed_zero_defaults(stage: int) -> Dict[str, Any]:
    """DeepSpeed's own default for every zero_optimization knob at this stage (from its config model)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return DeepSpeedZeroConfig(stage=stage).model_dump(by_alias=True)
