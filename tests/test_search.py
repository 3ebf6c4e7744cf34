"""The search strategy, with the runner swapped for a deterministic landscape (no launches).

The landscape behaves like a real one: peak memory grows linearly with the micro-batch and
shrinks with the ZeRO stage, throughput rises with the micro-batch and falls with the stage,
and a run over the memory limit is an OOM.
"""

import optuna
import pytest

from mlautotune.experiment import Experiment, Resources, Result
from mlautotune.search import SearchSettings, Tuner, spaced
from mlautotune.space import MicroBatchRule, TuningPlan

GiB = 2**30
LIMIT = 4 * GiB
NUM_PARAMS = 50_000_000


class Landscape:
    """Peak = fixed + model states(stage) + per-sample * mbs; throughput saturates with mbs."""

    def __init__(self, per_sample=200 * 2**20, noise=0.0, fail_at=None, spread=0.01):
        self.per_sample, self.noise, self.fail_at, self.spread = per_sample, noise, fail_at, spread
        self.calls = []

    def peak(self, stage, mbs):
        states = NUM_PARAMS * 16 / (1 if stage == 0 else 2 if stage == 1 else 2.5 if stage == 2 else 3)
        return 0.5 * GiB + states + self.per_sample * mbs

    def peak_of(self, params):
        return self.peak(params["stage"], params["micro_batch"])

    def throughput(self, params):
        stage, mbs = params["stage"], params["micro_batch"]
        t = 100 * mbs / (mbs + 4) * (1.0 - 0.07 * stage)
        t *= 1.0 + 0.02 * (params.get("reduce_bucket_size", 5e8) == 5e7) - 0.01 * bool(params.get("overlap_comm"))
        return t * (1 + self.noise * ((hash((stage, mbs, len(self.calls))) % 7) - 3) / 3)

    def __call__(self, exp: Experiment) -> Result:
        p = exp.params
        self.calls.append(dict(p))
        peak = self.peak_of(p)
        if self.fail_at and (p["stage"], p["micro_batch"]) == self.fail_at:
            return Result(exp.name, "failed", {}, "RuntimeError: boom", 20.0, "", 1)
        if peak > LIMIT:
            return Result(exp.name, "oom", {"peak_memory_bytes": peak}, "peak over the limit", 15.0, "", 86)
        tp = self.throughput(p)
        tbs = p["micro_batch"] * p["gas"] * 2
        return Result(
            exp.name, "ok",
            {"throughput": tp, "latency": 1000 * tbs / tp, "FLOPS_per_gpu": tp * 1e9, "peak_memory_bytes": peak,
             "step_time_spread": self.spread, "num_params": NUM_PARAMS, "trainable_num_params": NUM_PARAMS, "train_batch_size": tbs},
            "", 20.0, "", 0,
        )


def make_plan(stages=(0, 1, 2, 3), mbs=MicroBatchRule("min", (1,)), knobs=None, fast=True, max_tbs=None, gas=1):
    return TuningPlan(
        stages=list(stages),
        knobs=knobs or {s: {} for s in stages},
        micro_batch=mbs,
        gas=gas,
        max_train_batch_size=max_tbs,
        mp_size=1,
        fast=fast,
        base_config={"optimizer": {"type": "AdamW"}},
    )


def make_experiment(params):
    name = f"z{params['stage']}_gas{params['gas']}_tmbspg{params['micro_batch']}" + "".join(
        f"_{k[:3]}{v}" for k, v in sorted(params.items()) if k not in ("stage", "micro_batch", "gas")
    )
    return Experiment(name, {}, "train.py", [], Resources(num_gpus=2), dict(params))


def tuner(plan, runner, storage=None, study_name="s", **settings):
    s = SearchSettings(world_size=2, memory_limit_bytes=LIMIT, device="cpu", **settings)
    direction = "minimize" if s.metric == "latency" else "maximize"
    study = optuna.create_study(storage=storage, study_name=study_name, direction=direction, load_if_exists=True)
    return Tuner(plan, s, study, make_experiment, runner), study


def test_spaced_candidates():
    assert spaced(1, 13, 3) == [13, 4, 1]
    assert spaced(1, 64, 4) == [64, 16, 4, 1]
    assert spaced(4, 4, 3) == [4]
    assert spaced(2, 3, 3) == [3, 2]


def test_finds_largest_runnable_micro_batch_with_few_runs():
    land = Landscape()
    t, _ = tuner(make_plan(stages=[0]), land, tuner_type="gridsearch")
    out = t.tune()
    top = max(m.params["micro_batch"] for m in out.measured if m.ok)
    assert land.peak(0, top) <= LIMIT < land.peak(0, top + 1)  # the true edge
    assert out.experiments <= 8  # predict and verify, not a blind doubling from 1
    assert out.best.params["micro_batch"] == top  # throughput rises with mbs here


def test_failed_and_oom_are_never_scored_as_zero(tmp_path):
    land = Landscape(fail_at=(0, 4))
    t, study = tuner(make_plan(stages=[0]), land, tuner_type="random")
    out = t.tune()
    for trial in study.trials:
        if trial.user_attrs.get("status") in ("oom", "failed"):
            assert trial.state == optuna.trial.TrialState.FAIL and trial.value is None
    assert out.best.result.status == "ok"


def test_stage_stop_rule_and_ranking_across_stages():
    # Fixed candidates: higher stages cannot fit more, they only cost speed.
    t, _ = tuner(make_plan(mbs=MicroBatchRule("list", (2, 4))), Landscape(), tuner_type="gridsearch")
    out = t.tune()
    assert {m.params["stage"] for m in out.measured} == {0, 1}  # z1 is no better than z0: z2, z3 not explored
    assert out.best.params["stage"] == 0


def test_a_higher_stage_that_fits_a_larger_micro_batch_is_explored():
    # Memory-bound: z1 is slower per sample at equal batch, but fits a larger micro-batch than z0.
    out = tuner(make_plan(stages=[0, 1, 2]), Landscape(), tuner_type="gridsearch")[0].tune()
    assert {0, 1} <= {m.params["stage"] for m in out.measured}
    top = {s: max(m.params["micro_batch"] for m in out.measured if m.ok and m.params["stage"] == s) for s in (0, 1)}
    assert top[1] > top[0]


def test_num_trials_budget_is_a_hard_stop():
    t, _ = tuner(make_plan(), Landscape(), tuner_type="random", num_trials=4)
    out = t.tune()
    assert out.experiments == 4 and len(out.measured) == 4


def test_early_stopping_within_a_stage():
    knobs = {1: {"reduce_bucket_size": [5e7, 5e8, 1e9], "allgather_bucket_size": [5e7, 5e8, 1e9], "overlap_comm": [True, False]}}
    plan = make_plan(stages=[1], mbs=MicroBatchRule("fixed", (4,)), knobs=knobs, fast=False)
    t, _ = tuner(plan, Landscape(), tuner_type="gridsearch", early_stopping=3)
    out = t.tune()
    assert len(out.measured) < 18  # the space has 18 points
    assert any("early stop" in n for n in out.notes)


def test_space_exhaustion_ends_the_stage():
    plan = make_plan(stages=[0], mbs=MicroBatchRule("list", (2, 4, 8)))
    t, _ = tuner(plan, Landscape(), tuner_type="model_based", early_stopping=50)
    out = t.tune()
    assert sorted(m.params["micro_batch"] for m in out.measured) == [2, 4, 8]


def test_readme_micro_batch_rules():
    land = Landscape()
    fixed, _ = tuner(make_plan(stages=[1], mbs=MicroBatchRule("fixed", (4,))), land, tuner_type="gridsearch")
    assert {m.params["micro_batch"] for m in fixed.tune().measured} == {4}
    listed, _ = tuner(make_plan(stages=[1], mbs=MicroBatchRule("list", (1, 4, 16))), land, tuner_type="gridsearch")
    assert {m.params["micro_batch"] for m in listed.tune().measured} <= {1, 4, 16}
    # max_train_batch_size caps mbs * gas * world_size: 24 / (2 * 2 ranks) -> 6
    capped, _ = tuner(make_plan(stages=[0], max_tbs=24, gas=2), land, tuner_type="gridsearch")
    out = capped.tune()
    assert max(m.params["micro_batch"] for m in out.measured) == 6
    assert all(m.params["gas"] == 2 for m in out.measured)


def test_latency_is_minimised():
    t, _ = tuner(make_plan(stages=[0, 1]), Landscape(), tuner_type="gridsearch", metric="latency")
    out = t.tune()
    assert out.best.value == min(m.value for m in out.measured if m.value is not None)


def test_near_ties_are_remeasured_before_the_optimum_is_declared():
    # Throughput is flat at the top (mbs 13 vs 12 within 1%), and the step-time spread is 5%.
    land = Landscape(spread=0.05)
    t, _ = tuner(make_plan(stages=[0], mbs=MicroBatchRule("list", (12, 13))), land, tuner_type="gridsearch", remeasure=2)
    out = t.tune()
    assert any("re-measuring" in n for n in out.notes)
    assert len(out.best.repeats) == 2
    assert len(land.calls) == 2 + 2 * 2


def test_clear_winner_is_not_remeasured():
    land = Landscape(spread=0.001)
    t, _ = tuner(make_plan(stages=[0], mbs=MicroBatchRule("list", (1, 13))), land, tuner_type="gridsearch")
    out = t.tune()
    assert out.best.repeats == [] and len(land.calls) == 2


def test_resume_reuses_finished_experiments_and_requeues_the_interrupted_one(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    plan = make_plan(stages=[0, 1])

    class Interrupt(Landscape):
        def __call__(self, exp):
            if len(self.calls) == 3:
                self.calls.append(dict(exp.params))
                raise KeyboardInterrupt
            return super().__call__(exp)

    first = Interrupt()
    t1, _ = tuner(plan, first, storage, tuner_type="gridsearch")
    with pytest.raises(KeyboardInterrupt):
        t1.tune()
    interrupted = first.calls[-1]

    second = Landscape()
    t2, study = tuner(plan, second, storage, tuner_type="gridsearch")
    assert len(t2.interrupted) == 1
    out = t2.tune()
    finished_before = first.calls[:-1]
    assert not any(c in second.calls for c in finished_before)  # nothing that finished ran twice
    assert interrupted in second.calls  # the interrupted one ran again
    names = [m.result.name for m in out.measured]
    assert len(names) == len(set(names))

    fresh, _ = tuner(plan, Landscape(), tuner_type="gridsearch")
    assert out.best.params == fresh.tune().best.params  # same answer as an uninterrupted session


class BufferHungryStage(Landscape):
    """z1 keeps 1.5 GiB more per rank than the memory model learns from z0 (bigger buckets)."""

    def peak(self, stage, mbs):
        return super().peak(stage, mbs) + (1.5 * GiB if stage == 1 else 0)


def test_an_edge_search_that_overshoots_does_not_walk_down_one_by_one():
    land = BufferHungryStage(per_sample=50 * 2**20)
    out = tuner(make_plan(stages=[0, 1]), land, tuner_type="gridsearch", num_tuning_micro_batch_sizes=1)[0].tune()
    z1 = [m for m in out.measured if m.params["stage"] == 1]
    top = max(m.params["micro_batch"] for m in z1 if m.ok)
    assert land.peak(1, top) <= LIMIT < land.peak(1, top + 1)  # still the true edge
    assert sum(m.result.status == "oom" for m in z1) <= 2  # the OOM's peak recalibrated z1 (it was ~30 too high)


class KnobMemory(Landscape):
    """A small reduce bucket saves 600 MiB per rank (and is 2% faster): the edge moves up with it."""

    def peak_of(self, params):
        return super().peak_of(params) - (600 * 2**20 if params.get("reduce_bucket_size") == 50000000 else 0)


def test_the_leaders_knobs_get_their_own_micro_batch_edge():
    knobs = {0: {"reduce_bucket_size": [500000000, 50000000]}}
    land = KnobMemory()
    out = tuner(make_plan(stages=[0], knobs=knobs, fast=False), land, tuner_type="gridsearch")[0].tune()
    base_edge = max(m.params["micro_batch"] for m in out.measured if m.ok and m.params["reduce_bucket_size"] == 500000000)
    assert out.best.params["reduce_bucket_size"] == 50000000
    assert out.best.params["micro_batch"] > base_edge  # 600 MiB / 200 MiB per sample: 3 more
    assert any("leave memory room" in n for n in out.notes)


class PeaksInside(Landscape):
    """CPU-like: throughput peaks at micro-batch 6, far below the memory edge (14)."""

    def throughput(self, params):
        import math

        return 100 * math.exp(-math.log(params["micro_batch"] / 6) ** 2)


def test_the_micro_batch_is_refined_between_far_apart_candidates():
    land = PeaksInside()
    out = tuner(make_plan(stages=[0]), land, tuner_type="gridsearch")[0].tune()
    measured = {m.params["micro_batch"] for m in out.measured}
    assert {1, 4, 14} <= measured  # the README's candidates: the edge and log-spaced ones below it
    assert out.best.params["micro_batch"] in (5, 6, 7) and out.best.value >= 0.95 * 100
    assert any("refining around the best micro-batch 4" in n for n in out.notes)
    assert len(out.measured) <= 3 + 2 + 4 + 2  # profiling/edge, candidates, at most 4 refinements
