"""P(fits) (search/fits.py): the memory model as a prior, corrected by every run and OOM of every knob set.

Pure logic: hand-made results in a real (in-memory) Optuna study through the Ledger, the memory
model that profiling builds from them, and the posterior over its errors.
"""

import pytest

from mlautotune.run.experiment import Result
from mlautotune.search import fits
from mlautotune.search.fits import FitModel
from mlautotune.search.candidates import distributions
from mlautotune.search.ledger import Ledger
from mlautotune.search.search import Search
from mlautotune.search import SearchSettings
from mlautotune.inputs.space import MicroBatchRule, TuningPlan

import optuna

GiB = 2**30
NUM_PARAMS = 50_000_000
KNOBS = {"reduce_bucket_size": [50_000_000, 500_000_000], "overlap_comm": [True, False]}

optuna.logging.set_verbosity(optuna.logging.WARNING)


def plan_of():
    return TuningPlan(stages=[2], knobs={2: dict(KNOBS)}, micro_batch=MicroBatchRule("min", (1,)), gas=1, max_train_batch_size=None,
                      mp_size=1, fast=False, base_config={"optimizer": {"type": "AdamW"}}, data_parallel=2)


def result(status, peak=None):
    metrics = {"num_params": NUM_PARAMS, "trainable_num_params": NUM_PARAMS}
    if status == "ok":
        metrics.update(throughput=10.0, latency=100.0, interval_rel=0.01, peak_memory_bytes=peak)
    return Result("x", status, metrics, "", 60.0, "", 0)


def params(mbs, rb=500_000_000, oc=False):
    return {"stage": 2, "micro_batch": mbs, "gas": 1, "reduce_bucket_size": rb, "overlap_comm": oc}


def fit_of(runs, limit=8 * GiB):
    """The FitModel the search builds from these (params, Result) runs."""
    plan = plan_of()
    study = optuna.create_study(direction="maximize")
    ledger = Ledger(study, "throughput", distributions(plan), alone=True)
    for p, r in runs:
        ledger.record(ledger.claim(p, None), p, r, None)
    ledger.refresh()
    search = Search(plan, SearchSettings(memory_limit_bytes=limit, world_size=2))
    return FitModel(plan, search.memory_model(ledger.order), ledger.order)


def peak(mbs):  # 2 GiB + 0.01 GiB per sample: the memory model's line puts the edge near 600 at 8 GiB
    return int(2 * GiB + mbs * 0.01 * GiB)


PROFILED = [(params(1), result("ok", peak(1))), (params(4), result("ok", peak(4)))]


def test_what_ran_fits_at_every_smaller_size_and_an_oom_bounds_every_larger_one():
    fit = fit_of(PROFILED + [(params(64), result("ok", peak(64))), (params(256), result("oom"))])
    assert fit.p_fits(params(1), [32, 64]) == [1.0, 1.0]
    assert fit.p_fits(params(1), [256, 400]) == [0.0, 0.0]
    assert fit.p_fits(params(1, rb=50_000_000), [400]) < [1.0], "fewer buffers: not a fact, but the same memory's evidence"


def test_an_oom_of_one_knob_set_lowers_every_knob_set_near_it():
    before = fit_of(PROFILED)
    after = fit_of(PROFILED + [(params(300), result("oom"))])
    other = params(1, rb=50_000_000, oc=True)  # other buffers: no hard fact applies
    assert before.p_fits(other, [300])[0] > 0.9
    assert after.p_fits(other, [300])[0] < 0.5 < after.p_fits(other, [32])[0]


def test_unforeseen_ooms_move_the_edge_by_more_than_one_size_each():
    """The memory model is confident of an edge near 600; OOMs at 512 and then 431 say it is wrong: the
    size far below them must become more likely to fit than the size just below, and no size near them
    may stay near-certain."""
    one = fit_of(PROFILED + [(params(512), result("oom"))])
    two = fit_of(PROFILED + [(params(512), result("oom")), (params(431), result("oom"))])
    p_one, p_two = one.p_fits(params(1, oc=True), [362]), two.p_fits(params(1, oc=True), [362, 128])
    assert p_two[0] < p_one[0] and p_two[0] < 0.8
    assert p_two[1] > p_two[0] and p_two[1] > 0.5


def test_a_measured_peak_pins_the_edge_and_the_memory_pressure_grows_with_the_size():
    fit = fit_of(PROFILED)
    p = fit.p_fits(params(1), [300, 500, 600, 700, 900])
    assert p[0] > 0.9 and p[0] >= p[1] > p[2] > p[3] >= p[4] and p[4] < fits.WRONG_SHARE  # far beyond: only the slopes that say the model is wrong
    assert fit.edge(params(1)) == pytest.approx(600, rel=0.1)
    fills = [fit.fill(params(m)) for m in (1, 100, 400)]
    assert fills[0] < fills[1] < fills[2] < 1.0 and fills[0] == pytest.approx(peak(1) / (8 * GiB), rel=0.05)


def test_without_a_memory_limit_only_what_ran_out_is_ruled_out():
    fit = fit_of(PROFILED + [(params(256), result("oom"))], limit=None)
    p = fit.p_fits(params(1), [128, 256])
    assert p[1] == 0.0 and 0.5 < p[0] < 1.0, "some limit exists (an OOM happened): below it, likely but not certain"
    assert fit.fill(params(128)) == 0.0
