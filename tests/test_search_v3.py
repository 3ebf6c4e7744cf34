"""The search: the model, the acquisition, the stop rule and the samplers (pure logic, no launches).

Hand-made ledgers are real Optuna studies (in memory) written through the Ledger, as the tuner writes them.
"""

import math
import random

import numpy as np
import optuna
import pytest

from mlautotune.run.experiment import Experiment, Resources, Result
from mlautotune.search import SearchSettings, Tuner
from mlautotune.search.acquisition import gain, overlap, per_second
from mlautotune.search.candidates import distributions
from mlautotune.search.ledger import Ledger
from mlautotune.search.samplers import CostModelSampler
from mlautotune.search.search import Search
from mlautotune.inputs.space import MicroBatchRule, TuningPlan

GiB = 2**30
NUM_PARAMS = 50_000_000

optuna.logging.set_verbosity(optuna.logging.WARNING)


def plan_of(stages=(0, 1), mbs=MicroBatchRule("fixed", (4,)), knobs=None, fast=True):
    return TuningPlan(stages=list(stages), knobs=knobs or {s: {} for s in stages}, micro_batch=mbs, gas=1, max_train_batch_size=None,
                      mp_size=1, fast=fast, base_config={"optimizer": {"type": "AdamW"}}, data_parallel=2)


def settings(tuner="model_based", **kw):
    return SearchSettings(tuner_type=tuner, memory_limit_bytes=kw.pop("memory_limit_bytes", 4 * GiB), world_size=kw.pop("world_size", 2),
                          num_trials=kw.pop("num_trials", 50), **kw)


def ok(throughput, mbs=4, interval=0.01, peak=1 * GiB):
    return Result("x", "ok", {"throughput": throughput, "latency": 1000.0 / throughput, "peak_memory_bytes": peak, "interval_rel": interval,
                              "num_params": NUM_PARAMS, "trainable_num_params": NUM_PARAMS}, "", 60.0, "", 0)


def ledger_with(plan, measured, pending=()):
    """A study holding `measured` ((params, Result) or (params, Result, repeat of index)) and `pending` claims (params, repeat of index)."""
    study = optuna.create_study(direction="maximize")
    ledger = Ledger(study, "throughput", distributions(plan), alone=False)
    done = []
    for params, result, *rep in measured:
        repeat_of = done[rep[0]] if rep else None
        trial = ledger.claim(params, repeat_of)
        m = ledger.record(trial, params, result, repeat_of)
        done.append(repeat_of or m)
    for params, rep in pending:
        ledger.claim(params, done[rep] if rep is not None else None)
    ledger.refresh()
    return ledger


Z0, Z1 = {"stage": 0, "micro_batch": 4, "gas": 1}, {"stage": 1, "micro_batch": 4, "gas": 1}


# ---- the acquisition ---------------------------------------------------------------------------------
def test_a_near_tie_is_measured_again_only_while_its_interval_overlaps_the_best():
    plan = plan_of()
    tie = Search(plan, settings()).next(ledger_with(plan, [(Z0, ok(100.0)), (Z1, ok(99.5))]))
    assert tie is not None and tie.repeat_of is not None, "two configurations within each other's interval: one is measured again"
    apart = Search(plan, settings()).next(ledger_with(plan, [(Z0, ok(100.0)), (Z1, ok(70.0))]))
    assert apart is None, "70 against 100 with 1% intervals: nothing is worth another launch, and nothing is left untried"


def test_the_gain_of_a_measurement_is_zero_once_the_intervals_part():
    sd = np.array([0.02, 0.02])
    diff = np.array([-0.01, -0.2])  # a near-tie, and one far below the best
    g = gain(diff, sd, overlap(diff, sd, 0.0, 0.02), noise_var=0.02**2)
    assert g[0] > 0 and g[1] == 0


def test_a_near_tie_that_cannot_pass_the_best_by_the_margin_is_worth_almost_nothing():
    """Two sizes 0.05% apart, each measured a few times (latent sd 1%, a 2% sd per measurement):
    resolving them cannot change the answer by the 1% the stop rule asks for, so their gain is a
    thousandth of that of a configuration the model knows little about (sd 5%) at the same mean;
    without the margin it would be a twelfth."""
    diff, sd = np.array([-0.0005, -0.0005]), np.array([0.01, 0.05])
    noise = 0.02**2
    with_margin = gain(diff, sd, [True, True], noise, margin=0.01)
    without = gain(diff, sd, [True, True], noise)
    assert with_margin[0] < 2e-3 * with_margin[1]
    assert without[0] > 5e-2 * without[1]


def test_an_untried_configuration_counts_a_rise_under_the_margin_a_re_measurement_does_not():
    """The search climbs to the best by steps often under 1% each (a size between two measured ones,
    one knob more): an untried configuration the model places 0.5% above the best is worth running,
    while resolving a measured near-tie by less than the 1% the stop rule asks for is worth almost
    nothing."""
    diff, sd = np.array([0.005, 0.005]), np.array([0.01, 0.01])
    g = gain(diff, sd, [True, True], noise_var=0.01**2, margin=0.01, measured=[False, True])
    assert g[0] > 0.003 and g[1] < 0.2 * g[0]


def test_an_oom_risky_candidate_loses_to_an_equal_safe_one():
    values = per_second(np.array([0.05, 0.05]), p_fit=[0.5, 1.0], seconds_ok=[60.0, 60.0], seconds_oom=[50.0, 50.0])
    assert values[1] > values[0]


def test_the_memory_model_makes_the_size_at_the_edge_riskier_than_the_one_below():
    plan = plan_of(stages=(0,), mbs=MicroBatchRule("min", (1,)))
    peak = lambda m: int(2 * GiB + m * 0.2 * GiB)  # noqa: E731  (edge at 10 for a 4 GiB limit)
    runs = [({"stage": 0, "micro_batch": 1, "gas": 1}, ok(10.0, peak=peak(1))), ({"stage": 0, "micro_batch": 4, "gas": 1}, ok(30.0, peak=peak(4)))]
    search = Search(plan, settings())
    ledger = ledger_with(plan, runs)
    search.next(ledger)
    from mlautotune.search.fits import FitModel

    fit = FitModel(plan, search.memory, ledger.order)
    p = {m: fit.p_fit({"stage": 0, "micro_batch": m, "gas": 1}) for m in (4, 8, 10, 13, 16)}
    assert p[4] == 1.0 and p[8] > p[10] > p[13] > p[16] and p[8] > 0.75 and p[16] < 0.1


def test_pending_trials_change_the_next_choice():
    plan = plan_of()
    measured = [(Z0, ok(100.0)), (Z1, ok(99.5))]
    alone = Search(plan, settings()).next(ledger_with(plan, measured))
    assert alone.repeat_of is not None
    index = 0 if alone.params == Z0 else 1
    busy = Search(plan, settings()).next(ledger_with(plan, measured, pending=[(alone.params, index)]))
    assert busy is None or busy.params != alone.params, "another worker is measuring that one again: this worker goes elsewhere"


def test_a_pending_trial_predicted_above_the_best_is_what_a_new_candidate_must_beat():
    """Stage 2 with overlap_comm is untried, and the knobs' measured effect puts it above the best; another
    worker is measuring it. Taken as measured at its mean, it may be the declared optimum once its result
    is in: the next candidate's gain counts from it, not from the incumbent below it."""
    knobs = {"overlap_comm": [False, True]}
    plan = plan_of(stages=(1, 2), knobs={1: dict(knobs), 2: dict(knobs)}, fast=False)
    a1 = {"stage": 1, "micro_batch": 4, "gas": 1, "overlap_comm": False}
    b1, a2 = {**a1, "overlap_comm": True}, {**a1, "stage": 2}
    b2 = {**a2, "overlap_comm": True}
    measured = [(a1, ok(100.0)), (b1, ok(120.0)), (a2, ok(118.0)), (a1, ok(101.0), 0), (b1, ok(121.0), 1)]
    bars, bests = {}, {}
    for pending in ((), ((b2, None),)):
        search = Search(plan, settings())
        ledger = ledger_with(plan, measured, pending=pending)
        search.next(ledger)
        model = search.model(ledger.order).with_fantasies(search.pending_params)
        mu, _ = model.predict([a1, b1, a2, b2])
        bests[len(pending)] = float(max(mu[:3]))
        bars[len(pending)] = search.bar(model, bests[len(pending)])
    assert bars[0] == pytest.approx(bests[0])
    assert mu[3] > bests[1] and bars[1] == pytest.approx(mu[3])


# ---- the stop rule, in a real tuner loop ---------------------------------------------------------------
class Flat:
    """Every configuration the same throughput (within +-0.5%), memory growing with the micro-batch; a
    run whose peak passes `limit` runs out of memory."""

    def __init__(self, slope=None, limit=4 * GiB):
        self.calls = []
        self.limit = limit

    @staticmethod
    def peak(p) -> int:
        return int(1 * GiB + p["micro_batch"] * 0.05 * GiB + (3 - p["stage"]) * 0.2 * GiB)

    def __call__(self, exp: Experiment) -> Result:
        p = exp.params
        self.calls.append(dict(p))
        peak = self.peak(p)
        if peak > self.limit:
            return Result(exp.name, "oom", {"peak_memory_bytes": peak}, "oom", 40.0, "", 86)
        wobble = 1 + 0.005 * math.sin(7 * len(self.calls))
        return ok(100.0 * wobble, mbs=p["micro_batch"], interval=0.01, peak=peak)


def tune(plan, runner, tuner="model_based", **kw):
    study = optuna.create_study(direction="maximize")

    def make(params):
        return Experiment(f"z{params['stage']}_mbs{params['micro_batch']}", {}, "w", [], Resources(), dict(params))

    return Tuner(plan, settings(tuner, **kw), study, make, runner).tune()


def test_the_stop_rule_ends_the_search_on_a_flat_landscape():
    runner = Flat()
    out = tune(plan_of(stages=(0, 1, 2, 3), mbs=MicroBatchRule("min", (1,))), runner)
    # about 90 configurations, every one within noise of the others: the stop rule ends it well before the
    # budget of 50 (a rule that asks whether an untried configuration's latent value, not one more measurement
    # of it, may pass the best by 1% never does: each of dozens keeps a ~1% spread under the model's prior)
    assert len(runner.calls) < 35, f"{len(runner.calls)} experiments on a flat landscape"
    assert any(n.startswith("stopped: the probability") for n in out.notes)


def test_the_stop_rule_counts_candidates_that_rise_and_fall_together_once():
    """Twenty copies of one untried configuration rise and fall together under the model: they are
    as likely to pass the best as the one alone (taken as independent, about 0.95 against 0.15)."""
    from mlautotune.search.model import Encoder, Observation, ThroughputModel
    from mlautotune.search.stop import p_beaten

    def at(stage, mbs):
        return {"stage": stage, "micro_batch": mbs, "gas": 1}

    runs = [(at(0, 1), 10.0), (at(0, 2), 18.0), (at(0, 4), 30.0), (at(0, 8), 44.0), (at(1, 4), 29.0)]
    model = ThroughputModel(Encoder({}), 0).fit([Observation(p, math.log(v)) for p, v in runs])
    best, other = at(0, 8), at(1, 8)
    one = p_beaten(model, best, [other], [1.0], [], 0.01, 1e-4).p
    twenty = p_beaten(model, best, [other] * 20, [1.0] * 20, [], 0.01, 1e-4).p
    assert 0.05 < one < 0.3
    assert abs(twenty - one) < 0.03 < 0.5 * (1 - (1 - one) ** 20)
    for threshold in (0.05, 0.5):  # given the threshold, the answer is a bound on the same side of it
        assert (p_beaten(model, best, [other] * 20, [1.0] * 20, [], 0.01, 1e-4, threshold).p < threshold) == (twenty < threshold)
    low, high = (p_beaten(model, best, [other] * 20, [1.0] * 20, [], 0.01, 1e-4, t) for t in (0.05, 0.999))
    assert str(low).startswith("at least ") and str(high).startswith("at most "), "a bound that decided is said to be one"


class NoisyFlat(Flat):
    """Flat, but every measurement is a fresh draw with a 4% interval (sd 2%), as the probe reports it."""

    def __init__(self):
        super().__init__()
        self.rng = random.Random(0)

    def __call__(self, exp):
        r = super().__call__(exp)
        if r.status == "ok":
            tp = 100.0 * (1 + 0.02 * self.rng.gauss(0, 1))
            r.metrics.update(throughput=tp, latency=1000.0 / tp, interval_rel=0.04)
        return r


def test_the_stop_rule_counts_the_probes_own_noise_in_what_one_more_measurement_can_show():
    """A measurement with a 4% interval moves a posterior mean less than the model's white noise alone
    says: near-ties on a noisy flat landscape cannot be told apart, and the search ends well before a
    budget of 100 (about 50 experiments; taking the noise of one more measurement as the white noise
    alone, it runs 85)."""
    runner = NoisyFlat()
    out = tune(plan_of(stages=(0, 1, 2, 3), mbs=MicroBatchRule("min", (1,))), runner, num_trials=100)
    assert len(runner.calls) < 65, f"{len(runner.calls)} experiments on a noisy flat landscape"
    assert any(n.startswith("stopped: the probability") for n in out.notes)


class Sloped(Flat):
    """Throughput rising with the micro-batch and falling with the stage."""

    @staticmethod
    def throughput(p):
        """The noise-free throughput of these params."""
        return 100 * p["micro_batch"] / (p["micro_batch"] + 6) * (1 - 0.05 * p["stage"])

    def __call__(self, exp):
        r = super().__call__(exp)
        if r.status == "ok":
            tp = self.throughput(exp.params)
            r.metrics.update(throughput=tp, latency=1000.0 / tp)
        return r


def test_gridsearch_and_random_are_optunas_samplers_and_make_other_experiments_than_model_based():
    plan = plan_of(stages=(0, 1, 2, 3), mbs=MicroBatchRule("min", (1,)))
    calls = {}
    for tuner in ("model_based", "gridsearch", "random"):
        runner = Sloped()
        tune(plan, runner, tuner, num_trials=12)
        calls[tuner] = [tuple(sorted(c.items())) for c in runner.calls]
    assert calls["model_based"] != calls["gridsearch"] != calls["random"] != calls["model_based"]
    for tuner in ("gridsearch", "random"):
        assert len(set(calls[tuner])) == len(calls[tuner]), f"{tuner} ran a configuration twice"


# ---- the XGBoost cost model as a plain Optuna sampler -----------------------------------------------------
def test_the_cost_model_sampler_works_in_a_plain_optuna_study():
    def objective(trial):
        a = trial.suggest_categorical("a", [1, 2, 4, 8, 16])
        b = trial.suggest_categorical("b", [True, False])
        c = trial.suggest_categorical("c", ["x", "y", "z"])
        return -((math.log2(a) - 3) ** 2) + (0.5 if b else 0.0) + {"x": 0.0, "y": 0.3, "z": -0.2}[c]

    study = optuna.create_study(direction="maximize", sampler=CostModelSampler(seed=0, n_startup_trials=5))
    study.optimize(objective, n_trials=14)
    points = [tuple(t.params.values()) for t in study.trials]
    assert all(p not in points[:i] for i, p in enumerate(points) if i >= 5), "an untried point each time after the start-up"
    assert study.best_params == {"a": 8, "b": True, "c": "y"}
