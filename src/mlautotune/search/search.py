"""The search: one model, one acquisition, one stop rule.

`Search.next(ledger)` decides afresh from every trial of the study (and the seed), so a resumed
session, or a second worker on the same study, takes up the search where it stands:

1. profiling (profiling.py): the first runs, which give the memory model its points; a stage that
   cannot fit is skipped. What follows stays inside the constrained space (constrained.py).
2. model_based: the model (model.py) is fitted on every measurement; other workers' pending
   experiments are taken as measured at their predicted mean (one predicted above the incumbent is
   then what a new configuration must beat). Every untried configuration (the
   sizes between the ladder's around the incumbent included) and every measured one (a
   re-measurement) is valued by the acquisition (acquisition.py): expected
   gain of the declared optimum per expected second, OOM risk as a cost. The best is measured,
   unless the stop rule (stop.py) says that nothing is likely to beat the incumbent by more than
   1%: then the search ends.
   gridsearch / random: Optuna's GridSampler / RandomSampler over the same space (samplers/
   baselines.py), and any other Optuna sampler through search.sampler; they end with the space or
   the budget.

The declared optimum (model_based) is the measured configuration with the highest posterior mean,
not the luckiest draw; with the other samplers, the best median measurement.
"""

import math
import statistics
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from mlautotune.inputs.space import TuningPlan, tuned_knobs
from mlautotune.search import constrained, savers
from mlautotune.search.acquisition import gain, overlap, per_second, relative
from mlautotune.search.candidates import params_key
from mlautotune.search.ledger import Ledger, Measured
from mlautotune.search.memory import MemoryModel
from mlautotune.search.fits import FitModel
from mlautotune.search.model import MIN_FIT, Z95, Encoder, Observation, ThroughputModel
from mlautotune.search.profiling import Profiling
from mlautotune.search.samplers import make_chooser
from mlautotune.search.samplers.baselines import grid_pick, random_pick
from mlautotune.search.settings import SearchSettings
from mlautotune.search.step import Step, StrategyBase
from mlautotune.search.stop import p_beaten
from mlautotune.search.warm import Earlier, Today, Warm

MARGIN = 0.01  # the stop rule's "better by more than 1%"


class Search(StrategyBase):
    def __init__(self, plan: TuningPlan, settings: SearchSettings, earlier: Optional[Earlier] = None):
        self.plan, self.s = plan, settings
        today = Today(settings.world_size, plan.base_config, plan.mp_size, settings.device, settings.metric == "throughput")
        self.warm = Warm(earlier, self.score, _noise_var, today) if earlier is not None and earlier.runs else None
        self.kind = "optuna" if settings.sampler_target else settings.tuner_type  # search.sampler: another Optuna sampler
        self.chooser = make_chooser(settings.seed, settings.sampler_target) if self.kind == "optuna" else None
        self.cap, self.low = plan.micro_batch_cap, min(plan.micro_batch.values)
        self.notes: List[str] = []
        self.memory: Optional[MemoryModel] = None
        self.pending_params: List[Dict[str, Any]] = []
        self.pending_repeats: Dict[str, int] = {}
        self.profiling = Profiling(self)
        values: Dict[str, list] = {}
        for stage in plan.stages:
            for k, vs in tuned_knobs(plan, stage).items():
                values.setdefault(k, []).extend(vs)
        values.update(savers.encoder_values(plan))  # the memory savers' switches are inputs like the knobs
        self.encoder = Encoder(values)
        self._fitted: Tuple[Any, Optional[ThroughputModel]] = (None, None)
        self._fits: Tuple[Any, Optional[FitModel]] = (None, None)
        self._memory: Tuple[Any, Optional[MemoryModel]] = (None, None)
        self.all_runs: List[Measured] = []  # the study's runs at the last look

    # ---- the model and the declared optimum -----------------------------------------------
    def memory_runs(self, runs: List[Measured]) -> List[Measured]:
        """The runs whose memory facts hold in this session: with a warm start, the earlier sessions'
        that hold here too (warm.py)."""
        return self.warm.memory_runs(runs, self.s.memory_limit_bytes) if self.warm is not None else runs

    def memory_model(self, runs: List[Measured]):
        """The memory model from these runs (cached while they do not change)."""
        runs = self.memory_runs(runs)
        key = tuple((m.trial_number, m.result.status) for m in runs)
        if self._memory[0] != key:
            self._memory = (key, self.profiling.memory_model(runs))
        return self._memory[1]

    def fit_model(self, runs: List[Measured]) -> FitModel:
        """P(fits) from these runs (cached while they do not change)."""
        runs = self.memory_runs(runs)
        key = tuple((m.trial_number, m.result.status) for m in runs)
        if self._fits[0] != key:
            self._fits = (key, FitModel(self.plan, self.memory_model(runs), runs, self.s.seed))
        return self._fits[1]

    def model(self, runs: List[Measured]) -> Optional[ThroughputModel]:
        """The model fitted on every measurement of these runs (cached while they do not change); its
        memory-pressure input comes from the same runs' P(fits) model."""
        fill = self.fit_model(runs).fill
        obs = [Observation(m.params, math.log(self.score(v)), _noise_var(m)) for m in runs if m.value is not None for v in m.values]
        obs += self.warm.observations(runs) if self.warm is not None else []  # the earlier sessions', offset and blurred (warm.py)
        key = tuple((params_key(o.params), o.log_score, fill(o.params)) for o in obs)
        if self._fitted[0] != key:
            start = self._fitted[1].kernel if self._fitted[1] is not None and len(obs) > MIN_FIT else None
            discrepancy = self.warm.tau0**2 if self.warm is not None else 0.0  # how far an earlier session's landscape may be from today's
            self._fitted = (key, ThroughputModel(self.encoder, self.s.seed, fill, discrepancy).fit(obs, start=start) if obs else None)
        return self._fitted[1]

    def ranked(self, runs: List[Measured]) -> List[Tuple[Measured, float, float]]:
        """Measured configurations with their posterior (mean, sd), best first."""
        ok = [m for m in runs if m.value is not None]
        if not ok:
            return []
        if self.kind != "model_based":
            return sorted(((m, math.log(self.score(m.final_value)), m.interval / Z95) for m in ok), key=lambda t: -t[1])
        known = {m.trial_number for m in self.all_runs}
        fitted_on = self.all_runs if all(m.trial_number in known for m in ok) else runs  # a part of the study: the whole study's model
        mu, sd = self.model(fitted_on).predict([m.params for m in ok])
        return sorted(zip(ok, mu.tolist(), sd.tolist()), key=lambda t: -t[1])

    def best(self, runs: List[Measured]) -> Optional[Measured]:
        if len(runs) >= len(self.all_runs):
            self.all_runs = list(runs)
        ranked = self.ranked(runs)
        return ranked[0][0] if ranked else None

    def tied(self, lead: Measured, other: Measured) -> bool:
        """Their 95% intervals (posterior, model_based; measured, otherwise) overlap."""
        by = {m.trial_number: (mu, sd) for m, mu, sd in self.ranked([lead, other])}
        (a, sa), (b, sb) = by[lead.trial_number], by[other.trial_number]
        return abs(a - b) <= Z95 * (sa + sb)

    # ---- the next step -------------------------------------------------------------------------------
    def next(self, ledger: Ledger) -> Optional[Step]:
        runs, taken = ledger.order, ledger.taken()
        self.all_runs = list(runs)
        self.pending_params = list(ledger.pending.values())
        self.pending_repeats = ledger.pending_repeats
        self.check_warm(runs)
        mem_runs = self.memory_runs(runs)
        self.memory = self.memory_model(runs)
        known = taken | {params_key(m.params) for m in mem_runs}  # what an earlier session on this hardware ran needs no profiling run
        step = self.profiling.step(mem_runs, known)
        if step is None and (offload := savers.bootstrap(self.plan, mem_runs, taken, self.s.device)) is not None:
            return Step(offload, "every stage ran out of memory at the smallest micro-batch: ZeRO-Offload")
        if step is not None or not any(m.ok for m in mem_runs):
            return step
        stages = [s for s in self.plan.stages if self.profiling.feasible(s)]
        fit = self.fit_model(runs)
        said: List[str] = []
        around = self.incumbents(runs) if self.kind == "model_based" else []  # the sizes between the ladder's around them
        space = [(p, q) for p, q in constrained.candidates(self.plan, stages, fit, said, around) if params_key(p) not in taken]
        for text in said:
            self.note(text)
        untried, p_fit = [p for p, _ in space], [q for _, q in space]
        if self.kind == "model_based" and (first := self.warm_first(untried, runs)) is not None:
            return first
        if self.kind == "model_based" and (look := savers.first_look(space, mem_runs, self.pending_params)) is not None:
            return Step(*look)
        if self.kind != "model_based":
            return self.sampler_step(untried, p_fit, runs, taken, ledger)
        return self.acquisition_step(untried, p_fit, runs)

    # ---- the warm start (warm.py) ---------------------------------------------------------------------
    def check_warm(self, runs: List[Measured]) -> None:
        """The warm start ends where a new run shows another model (another parameter count)."""
        if self.warm is not None and (n := self.warm.other_model(runs)) is not None:
            self.note(f"warm start dropped: this session's model has {n:,} parameters, the earlier sessions' {self.warm.num_params:,}; "
                      "their measurements are not used")
            self.warm, self._fitted, self._fits, self._memory = None, (None, None), (None, None), (None, None)
        elif self.warm is not None and any(m.ok for m in runs):
            self.note(f"warm start from {', '.join(self.warm.earlier.sessions)}: {self.warm.describe(runs)}")

    def incumbents(self, runs: List[Measured]) -> List[Dict[str, Any]]:
        """The configurations the space refines around: this session's incumbent, and the earlier
        optimum of a warm start (the first experiment of one on the same hardware)."""
        out = [ranked[0][0].params] if (ranked := self.ranked(runs)) else []
        if self.warm is not None and (best := self.warm.optimum()) is not None:
            out.append(best.params)
        return out

    def warm_first(self, untried: List[Dict[str, Any]], runs: List[Measured]) -> Optional[Step]:
        """On the same hardware, the first experiment measures the earlier optimum again: it tells how
        today's values compare with the earlier ones."""
        if self.warm is None or not self.warm.same_hardware or any(m.trial_number >= 0 and m.ok for m in runs) or self.pending_params:
            return None
        best = self.warm.optimum()
        if best is None or params_key(best.params) not in {params_key(p) for p in untried}:
            return None
        return Step(dict(best.params), f"warm start: the earlier optimum ({', '.join(self.warm.earlier.sessions)}), measured again")

    def acquisition_step(self, untried: List[Dict[str, Any]], p_untried: List[float], runs: List[Measured]) -> Optional[Step]:
        model = self.model(runs).with_fantasies(self.pending_params)
        measured = [m for m in runs if m.value is not None]
        if not measured:  # a warm start on the same hardware whose first result is not in (another worker runs the earlier optimum)
            if not untried:
                return None
            mu, _ = model.predict(untried)
            i = int(np.argmax(mu + np.log(np.maximum(p_untried, 1e-9))))
            return Step(untried[i], f"warm start: the best the earlier sessions predict not yet claimed, P(fits) {p_untried[i]:.2f}")
        params = untried + [m.params for m in measured]
        mu, sd = model.predict(params)
        n = len(untried)
        order = sorted(range(n, len(params)), key=lambda i: -mu[i])
        inc = order[0]
        diff = mu - self.bar(model, mu[inc])
        fits_interval = overlap(mu, sd, np.full(len(params), mu[inc]), np.full(len(params), sd[inc]))
        if len(order) > 1:  # the incumbent measured again is worth what the runner-up may take from it
            up = order[1]
            diff[inc], fits_interval[inc] = mu[up] - mu[inc], overlap(mu[up], sd[up], mu[inc], sd[inc])
        else:
            fits_interval[inc] = False  # nothing to fall back on: measuring the only one again changes no choice
        p_fit = np.array(list(p_untried) + [1.0] * len(measured))
        ok_s, oom_s = self.seconds(self.memory_runs(runs), params)
        noise = model.noise_var + _own_var(runs)  # what one more measurement's noise is: the model's, and the probe's own
        again = np.arange(len(params)) >= n
        g = gain(diff, sd, fits_interval, noise, MARGIN, measured=again)  # a re-measurement counts only what passes the incumbent by the margin
        values = per_second(g, p_fit, ok_s, oom_s)
        chance = p_beaten(model, params[inc], untried, p_fit[:n], [q for i, q in enumerate(params[n:], n) if i != inc], MARGIN, noise,
                          self.s.stop_probability)
        if chance.p < self.s.stop_probability or not np.isfinite(values).any() or values.max() <= 0:
            self.note(f"stopped: the probability that one more measurement shows a configuration better than the best by more than {MARGIN:.0%} "
                      f"is {chance}, under search.stop_probability={self.s.stop_probability:g}")
            return None
        i = int(np.argmax(values))
        why = f"expected gain {relative(g[i]):.2%}{f' beyond {MARGIN:.0%}' if again[i] else ''} over the best, P(fits) {p_fit[i]:.2f}"
        if i < n:
            return Step(untried[i], why)
        m = measured[i - n]
        return Step(m.params, f"measured again: {why}, within the interval of the best", repeat_of=m)

    def bar(self, model: ThroughputModel, incumbent: float) -> float:
        """What a new configuration must beat: the incumbent's posterior mean, or a pending experiment's
        where that is higher. The model takes each pending one as measured at its mean (kriging
        believer), so it may be the declared optimum once its result is in: a worker that ignored it
        would value a configuration for beating what another worker is about to beat."""
        mu_pending, _ = model.predict(self.pending_params)
        return max([incumbent, *mu_pending.tolist()])

    def seconds(self, runs: List[Measured], params: List[Dict[str, Any]]) -> Tuple[List[float], List[float]]:
        """Expected seconds of each candidate's experiment, run and OOM: the medians of its stage's, else of all."""
        def med(xs, default):
            return statistics.median(xs) if xs else default

        ok_all = [m.result.wall_time_s for m in runs if m.ok]
        oom_all = [m.result.wall_time_s for m in runs if m.result.status == "oom"]
        every = med(ok_all, 60.0)
        by_stage = {s: med([m.result.wall_time_s for m in runs if m.ok and m.params["stage"] == s], every) for s in range(4)}
        oom = med(oom_all, every)
        return [max(by_stage[p["stage"]], 1e-3) for p in params], [max(oom, 1e-3)] * len(params)

    def sampler_step(self, untried, p_fit, runs, taken, ledger) -> Optional[Step]:
        """gridsearch, random or another Optuna sampler, over the configurations predicted to fit."""
        untried = [p for p, q in zip(untried, p_fit) if q >= 0.5]
        if not untried:
            return None
        by_key = {params_key(p): p for p in untried}
        if self.kind == "gridsearch":
            choice = by_key[grid_pick(list(by_key), self.s.seed)]
        elif self.kind == "random":
            choice = by_key[random_pick(list(by_key), self.s.seed, ledger.spent)]
        else:
            history = [(m.params, m.value, m.result.status) for m in runs]
            choice = self.chooser.choose(untried, history, self.s.maximize, ledger.spent)
        return Step(choice, f"{self.kind}: a configuration of the space not yet run")


def _own_var(runs: List[Measured]) -> float:
    """The variance (log units) that one more measurement brings of its own, beside the model's
    white noise: the median of this session's measurements' own (their intervals'), 0 if none."""
    own = [_noise_var(m) for m in runs if m.value is not None and m.trial_number >= 0]
    return statistics.median(own) if own else 0.0


def _noise_var(m: Measured) -> float:
    """The measurement's own variance (log units) from its interval; a disturbed window counts four times."""
    sd = m.single_interval / Z95
    return sd**2 * (4.0 if m.result.metrics.get("disturbed") else 1.0)
