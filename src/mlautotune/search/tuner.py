"""The tuner: asks the search (search.py) for the next configuration, claims it as a trial, runs it, records it."""

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import optuna

from mlautotune.run.experiment import Experiment, Result
from mlautotune.run.measure import cut_short_note
from mlautotune.search import savers
from mlautotune.search.candidates import distributions
from mlautotune.search.ledger import Ledger, Measured
from mlautotune.search.search import Search
from mlautotune.search.settings import SearchSettings
from mlautotune.search.step import Step
from mlautotune.search.warm import Earlier
from mlautotune.inputs.space import TuningPlan


@dataclass
class Outcome:
    best: Optional[Measured]
    stage_best: Dict[int, Measured]
    measured: List[Measured]  # in run order, re-measurements folded into their configuration
    experiments: int  # launches actually run in this session (reused results excluded)
    notes: List[str] = field(default_factory=list)
    ties: List[Measured] = field(default_factory=list)  # configurations within the measurement interval of the best, best first
    left: List[str] = field(default_factory=list)  # when the budget stopped the search: what it would have measured next, and why

    @property
    def budget_stopped(self) -> bool:
        """The budget ended the search while it still had something worth measuring."""
        return bool(self.left)


class Tuner:
    def __init__(self, plan: TuningPlan, settings: SearchSettings, study: optuna.Study,
                 make_experiment: Callable[[Dict[str, Any]], Experiment], run: Callable[[Experiment], Result], observers: Any = (),
                 earlier: Optional[Earlier] = None):
        self.plan, self.s, self.study = plan, settings, study
        self.make_experiment, self.run_experiment = make_experiment, run
        self.observers = list(observers)
        self.ledger = Ledger(study, settings.metric, distributions(plan), alone=settings.alone)
        self.strategy = Search(plan, settings, earlier)  # earlier: the warm start's prior (search/warm.py)
        self.launched = 0  # experiments started by this process
        self._told: set = set()  # notes and stages already passed to the observers
        self.left: List[str] = []  # the step the budget stopped: its experiment's name and why it was worth running

    @property
    def interrupted(self) -> List[int]:
        return self.ledger.interrupted

    @property
    def notes(self) -> List[str]:
        return self.strategy.notes

    def note(self, text: str) -> None:
        self.strategy.note(text)
        self._flush_notes()

    def tune(self) -> Outcome:
        while True:
            claimed = self.propose()
            if claimed is None or claimed == "budget":
                if self.ledger.pending:  # other workers are measuring: their results may open new steps, a dead one's trial is run again
                    time.sleep(self.s.poll_seconds)
                    continue
                if claimed == "budget":
                    self.note(f"stopped: tuner_num_trials={self.s.num_trials} experiments run")
                break
            self.run(*claimed)
        return self.outcome()

    def propose(self):
        """The next step claimed as a RUNNING trial: (trial, step), "budget", or None when the
        strategy has nothing (more) worth measuring."""
        while True:
            self.ledger.refresh()
            again = self.ledger.to_run_again()
            said = len(self.strategy.notes)
            step = Step(again[0], "run again: its experiment was cut off") if again else self.strategy.next(self.ledger)
            if step is not None and self.ledger.spent >= self.s.num_trials:  # re-measurements and other workers' running trials count
                del self.strategy.notes[said:]  # what the step would have done ("re-measuring ...") is not done
                self.left = [self.make_experiment(step.params).name + (" again" if step.repeat_of is not None else ""), step.why]
                return "budget"
            self.left = []
            self._flush_notes()
            if step is None:
                return None
            trial = self.ledger.claim(step.params, step.repeat_of)
            if trial is not None:
                return trial, step

    def run(self, trial: optuna.Trial, step: Step) -> Measured:
        params = dict(trial.params)
        stage = params["stage"]
        if ("stage", stage) not in self._told:
            self._told.add(("stage", stage))
            self._notify("stage_started", stage, {"stage": [stage], "micro_batch": [params["micro_batch"]]})
        exp = self.make_experiment(params)
        if step.repeat_of is not None:
            exp.name = f"{exp.name}_rep{len(step.repeat_of.repeats) + 1}"
            trial.set_user_attr("remeasurement_of", step.repeat_of.result.name)  # optuna-dashboard: a repeat, not a duplicate
        trial.set_user_attr("name", exp.name)
        trial.set_user_attr("why", step.why)
        self._notify("experiment_started", exp, trial)
        self.launched += 1
        try:
            result = self.run_experiment(exp)
        except BaseException:  # Ctrl-C / SIGTERM: the trial is interrupted, to be run again on resume
            self.ledger.interrupt(trial)
            raise
        m = self.ledger.record(trial, params, result, step.repeat_of)
        had_model = self.strategy.memory is not None
        self.strategy.memory = self.strategy.memory_model(self.ledger.order)
        if not had_model and self.strategy.memory is not None:
            self._notify("profiled", self.strategy.memory, [m])
        self._notify("experiment_finished", exp, m, self.best())
        if step.repeat_of is not None:
            self._notify("remeasured", step.repeat_of, m)
        self._window_notes([m])
        return m

    def _window_notes(self, runs: List[Measured]) -> None:
        """What the measurements say about the script: a window its end cut short."""
        for m in runs:
            text = cut_short_note(m.result.metrics) if m.ok else None
            if text:
                self.note(text)

    def _flush_notes(self) -> None:
        for text in self.strategy.notes:
            if ("note", text) not in self._told:
                self._told.add(("note", text))
                self._notify("note", text)

    def _notify(self, event: str, *args: Any) -> None:
        for observer in self.observers:
            if hasattr(observer, event):
                getattr(observer, event)(*args)

    @property
    def memory(self):
        return self.strategy.memory

    def best(self) -> Optional[Measured]:
        return self.strategy.best(self.ledger.order)

    def outcome(self) -> Outcome:
        runs = self.ledger.order
        self._window_notes(runs)
        stage_best = {s: b for s in self.plan.stages if (b := self.strategy.best([m for m in runs if m.params["stage"] == s])) is not None}
        best, st = self.best(), self.strategy
        ties = sorted((m for m in runs if m.value is not None and m is not best and st.tied(best, m)), key=lambda m: -st.score(m.final_value)) if best else []
        said = savers.verdict(best, runs, st.score)  # which won, with the memory savers or without, and why
        return Outcome(best, stage_best, list(runs), self.launched, list(self.notes) + ([said] if said else []), ties, list(self.left))
