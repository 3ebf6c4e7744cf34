"""The search, with the runner swapped for a deterministic landscape (no launches).

The landscape behaves like a real one: peak memory grows linearly with the micro-batch and
shrinks with the ZeRO stage, throughput rises with the micro-batch and falls with the stage,
and a run over the memory limit is an OOM.
"""

import io
import math

import optuna
import pytest

from mlautotune.console import Console
from mlautotune.run.experiment import Experiment, Resources, Result
from mlautotune.search import SearchSettings, Tuner
from mlautotune.inputs.space import MicroBatchRule, TuningPlan

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
        data_parallel=2,  # the tuner's world size (tuner())
    )


def make_experiment(params):
    name = f"z{params['stage']}_gas{params['gas']}_tmbspg{params['micro_batch']}" + "".join(
        f"_{k[:3]}{v}" for k, v in sorted(params.items()) if k not in ("stage", "micro_batch", "gas")
    )
    return Experiment(name, {}, "train.py", [], Resources(num_gpus=2), dict(params))


def tuner(plan, runner, storage=None, study_name="s", **settings):
    s = SearchSettings(world_size=2, memory_limit_bytes=LIMIT, **{"device": "cpu", **settings})
    direction = "minimize" if s.metric == "latency" else "maximize"
    study = optuna.create_study(storage=storage, study_name=study_name, direction=direction, load_if_exists=True)
    return Tuner(plan, s, study, make_experiment, runner), study


def test_finds_largest_runnable_micro_batch_with_few_runs():
    land = Landscape()
    t, _ = tuner(make_plan(stages=[0]), land, tuner_type="model_based")
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


def test_each_higher_stage_gets_a_look_and_the_ranking_is_across_stages():
    # Fixed candidates: higher stages cannot fit more, they only cost speed (7% per stage).
    land = Landscape()
    out = tuner(make_plan(mbs=MicroBatchRule("list", (2, 4))), land, tuner_type="model_based")[0].tune()
    assert all(any(c["stage"] == s for c in land.calls) for s in range(4))
    assert len(land.calls) < 8  # not every configuration: a slower stage needs no second size
    assert out.best.params == {"stage": 0, "micro_batch": 4, "gas": 1}


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


def test_listed_sizes_are_all_measured_in_the_stage_searched_on_its_own():
    plan = make_plan(stages=[0], mbs=MicroBatchRule("list", (2, 4, 8)))
    t, _ = tuner(plan, Landscape(), tuner_type="model_based")
    out = t.tune()
    assert sorted(m.params["micro_batch"] for m in out.measured) == [2, 4, 8]


def test_a_size_that_cannot_beat_the_incumbent_is_not_run():
    # 100 m / (m + 4) with the edge at 14: after 1, 4 and 14, the line through 4 and 14 extended
    # left (a concave curve stays under it) puts 2 and 3 below 4: they are never run.
    land = Landscape()
    tuner(make_plan(stages=[0]), land, tuner_type="model_based")[0].tune()
    assert {c["micro_batch"] for c in land.calls}.isdisjoint({2, 3})


def test_readme_micro_batch_rules():
    land = Landscape()
    fixed, _ = tuner(make_plan(stages=[1], mbs=MicroBatchRule("fixed", (4,))), land, tuner_type="gridsearch")
    assert {m.params["micro_batch"] for m in fixed.tune().measured} == {4}
    listed, _ = tuner(make_plan(stages=[1], mbs=MicroBatchRule("list", (1, 4, 16))), land, tuner_type="gridsearch")
    assert {m.params["micro_batch"] for m in listed.tune().measured} <= {1, 4, 16}
    # max_train_batch_size, as DeepSpeed's autotuner: each experiment accumulates 24 // (mbs x 2 ranks)
    # steps (the user's gas 2 is not used), up to micro-batch 12 at gas 1
    capped, _ = tuner(make_plan(stages=[0], max_tbs=24, gas=2), land, tuner_type="gridsearch")
    out = capped.tune()
    assert max(m.params["micro_batch"] for m in out.measured) == 12
    assert all(m.params["gas"] == 12 // m.params["micro_batch"] for m in out.measured)
    assert {m.params["gas"] for m in out.measured} > {1}


def test_latency_is_minimised():
    t, _ = tuner(make_plan(stages=[0, 1]), Landscape(), tuner_type="gridsearch", metric="latency")
    out = t.tune()
    assert out.best.value == min(m.value for m in out.measured if m.value is not None)


def test_clear_winner_is_not_remeasured():
    # a user's list of sizes: the first two listed give the memory slope, and 13 is far ahead of 1
    land = Landscape(spread=0.001)
    t, _ = tuner(make_plan(stages=[0], mbs=MicroBatchRule("list", (1, 13))), land, tuner_type="model_based")
    out = t.tune()
    assert out.best.params["micro_batch"] == 13
    assert out.best.repeats == [] and len(land.calls) == 2
    assert out.ties == []


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
    """z1 keeps 300 MiB more per rank than the memory model learns from z0 (bigger buckets): its edge
    is 6 larger than z0's, not 8 as predicted, and throughput still rises there."""

    def peak(self, stage, mbs):
        return super().peak(stage, mbs) + (300 * 2**20 if stage == 1 else 0)

    def throughput(self, params):
        return 100 * params["micro_batch"] / (params["micro_batch"] + 40)  # memory-bound; no cost for z1's partitioning


def test_an_edge_search_that_overshoots_does_not_walk_down_one_by_one():
    land = BufferHungryStage(per_sample=50 * 2**20)  # memory exactly linear, as an accelerator's allocated bytes
    out = tuner(make_plan(stages=[0, 1]), land, tuner_type="gridsearch", device="cuda", num_trials=400)[0].tune()  # the whole grid
    z1 = [m for m in out.measured if m.params["stage"] == 1]
    top = max(m.params["micro_batch"] for m in z1 if m.ok)
    assert land.peak(1, top) <= LIMIT < land.peak(1, top + 1)  # still the true edge
    assert sum(m.result.status == "oom" for m in z1) <= 2  # the OOM's peak recalibrated z1 (it was ~30 too high)


class KnobMemory(Landscape):
    """A small reduce bucket saves 600 MiB per rank (and is 2% faster): the edge moves up with it."""

    def peak_of(self, params):
        return super().peak_of(params) - (600 * 2**20 if params.get("reduce_bucket_size") == 50000000 else 0)


def test_the_best_knobs_get_their_own_micro_batch_edge():
    knobs = {0: {"reduce_bucket_size": [500000000, 50000000]}}
    land = KnobMemory()
    out = tuner(make_plan(stages=[0], knobs=knobs, fast=False), land, tuner_type="gridsearch")[0].tune()
    base_edge = max(m.params["micro_batch"] for m in out.measured if m.ok and m.params["reduce_bucket_size"] == 500000000)
    assert out.best.params["reduce_bucket_size"] == 50000000
    assert out.best.params["micro_batch"] > base_edge  # 600 MiB / 200 MiB per sample: 3 more
    assert land.peak(0, out.best.params["micro_batch"] + 1) - 600 * 2**20 > LIMIT  # and exactly its edge


class TiedKnobsOneFitsMore(KnobMemory):
    """At the default knobs' edge (14), reduce buckets of 2e8 and 5e7 are tied (+10.5% and +10%,
    within the noise); only the smaller one saves memory, and throughput keeps rising with the
    micro-batch, so the 5e7 bucket at its own edge (17) is the best by 13%."""

    def throughput(self, params):
        t = 100 * params["micro_batch"] / (params["micro_batch"] + 40)
        return t * {200000000: 1.105, 50000000: 1.10}.get(params.get("reduce_bucket_size"), 1.0)


def test_knobs_tied_with_the_best_get_their_own_micro_batch_search_too():
    """The old joint step searched along the micro-batch with the single best knobs only (here the
    2e8 bucket, ahead by noise), so the 5e7 bucket's larger edge was never measured."""
    knobs = {0: {"reduce_bucket_size": [500000000, 200000000, 50000000]}}
    land = TiedKnobsOneFitsMore()
    out = tuner(make_plan(stages=[0], knobs=knobs, fast=False), land, tuner_type="gridsearch")[0].tune()
    # 17 fills 99.5% of the limit: under the allocator's soft edge (fits.ALLOCATOR_SLACK) it is a coin flip,
    # and gridsearch runs only what is more likely than not to fit; 16 is past the default knobs' edge (14)
    best = out.best.params
    assert best["reduce_bucket_size"] == 50000000 and best["micro_batch"] in (16, 17)


class PeaksInside(Landscape):
    """CPU-like: throughput peaks at micro-batch 6, far below the memory edge (14)."""

    def throughput(self, params):
        return 100 * math.exp(-math.log(params["micro_batch"] / 6) ** 2)


def test_the_micro_batch_peak_below_the_edge_is_found():
    land = PeaksInside()
    out = tuner(make_plan(stages=[0]), land, tuner_type="model_based")[0].tune()
    assert out.best.params["micro_batch"] == 6
    assert len(out.measured) <= 8  # profiling 2, then the sizes around the peak, not the whole ladder


class PeaksBetween(Landscape):
    """The peak lies between two neighbouring sizes of the ladder (each under 99% of it), far below the
    memory edge."""

    def __init__(self, **kw):
        from mlautotune.search.constrained import ladder

        super().__init__(**kw)
        self.lower, self.upper = [(a, b) for a, b in zip(ladder(1, 1024), ladder(1, 1024)[1:]) if a >= 40][0]
        self.top = round(math.sqrt(self.lower * self.upper))

    def throughput(self, params):
        return 100 * (0.5 + 0.5 * math.exp(-30 * math.log(params["micro_batch"] / self.top) ** 2))


def test_a_peak_between_the_ladders_sizes_is_found():
    land = PeaksBetween(per_sample=20 * 2**20)
    assert land.lower < land.top < land.upper
    assert max(land.throughput({"micro_batch": m}) for m in (land.lower, land.upper)) < 99
    out = tuner(make_plan(stages=[0]), land, tuner_type="model_based")[0].tune()
    assert land.throughput(out.best.params) >= 99, out.best.params


def test_the_sizes_between_are_those_between_the_neighbours_at_least_one_percent_apart():
    from mlautotune.search.constrained import between

    assert between([1, 2, 4, 8], 4) == [3, 4, 5, 6, 7]
    assert between([64, 91, 108, 128], 108)[:9] == list(range(92, 101))  # up to 100, 1% is at most one
    fine = between([512, 609, 724], 609)
    assert 512 < fine[0] <= 518 and 716 <= fine[-1] < 724
    assert all(1.01 * a <= b < 1.01 * a + 1 for a, b in zip(fine, fine[1:]))
    assert between([5], 5) == []


def test_a_configuration_to_refine_around_is_in_the_space_even_off_the_ladder_and_the_fine_sizes():
    """A warm start's earlier optimum can be a size today's ladder and fine sizes both miss (it was
    refined around another incumbent): the space around it holds it, on its own stage only."""
    from mlautotune.search.constrained import between, candidates, ladder

    plan = make_plan(stages=[0, 1], mbs=MicroBatchRule("min", (1,), 1024))
    t, _ = tuner(plan, Landscape(per_sample=2**20), tuner_type="model_based")
    fit = t.strategy.fit_model(t.tune().measured)
    assert 620 not in ladder(1, 1024) and 620 not in between(ladder(1, 1024), 620)
    space = candidates(plan, [0, 1], fit, around=[{"stage": 0, "micro_batch": 620, "gas": 1}])
    line = {p["micro_batch"] for p, _ in space if p["stage"] == 0}
    assert 620 in line and set(between(ladder(1, 1024), 620)) <= line
    assert 620 not in {p["micro_batch"] for p, _ in space if p["stage"] == 1}


def test_the_sizes_around_the_incumbent_are_on_every_knob_set_of_its_stage():
    """The incumbent's knob set is not always the best one, and the best size is often the same for
    knob sets that differ little: the sizes between the ladder's around the incumbent's size are
    candidates on each knob set of its stage (a search that refines the incumbent's line only never
    runs the best knob set at the best size), and on no other stage."""
    from mlautotune.search.candidates import knobs_of_params, stage_knob_combos
    from mlautotune.search.constrained import between, candidates, ladder

    knobs = {0: {}, 1: {"reduce_bucket_size": [500000000, 50000000], "allgather_bucket_size": [500000000, 50000000]}}
    plan = make_plan(stages=[0, 1], mbs=MicroBatchRule("min", (1,), 1024), knobs=knobs, fast=False)
    t, _ = tuner(plan, Landscape(per_sample=2**20), tuner_type="model_based")
    fit = t.strategy.fit_model(t.tune().measured)
    incumbent = {"stage": 1, "micro_batch": 300, "gas": 1, "reduce_bucket_size": 500000000, "allgather_bucket_size": 500000000}
    fine = set(between(ladder(1, 1024), 300))
    assert 300 not in ladder(1, 1024) and len(fine) > 5
    space = [p for p, _ in candidates(plan, [0, 1], fit, around=[incumbent])]
    combos = stage_knob_combos(plan, 1)
    assert len(combos) == 4
    for knob_set in combos:
        sizes = {p["micro_batch"] for p in space if p["stage"] == 1 and knobs_of_params(p) == knob_set}
        assert fine | {300} <= sizes, knob_set
    assert not fine & {p["micro_batch"] for p in space if p["stage"] == 0}


class MidPeakWithKnob(Landscape):
    """GPU-like: throughput peaks at micro-batch 12 with the edge at 24 (200 MiB/sample over 4 GiB),
    and a small reduce bucket is worth 10% in stage 1 only, at every micro-batch."""

    def peak(self, stage, mbs):
        return 0.3 * GiB + NUM_PARAMS * 16 / (1 if stage == 0 else 2) * 0.1 + self.per_sample * mbs + (2 * GiB if stage == 0 else 0)

    def throughput(self, params):
        mbs, stage = params["micro_batch"], params["stage"]
        t = 100 * math.exp(-0.5 * math.log(mbs / 12) ** 2) * (1.0 - 0.02 * stage)
        return t * (1.10 if stage == 1 and params.get("reduce_bucket_size") == 50000000 else 1.0)


def test_peak_before_the_edge_and_the_best_knobs_are_combined():
    """Old search: knobs tuned at log-spaced candidates (1, 4, 20) and refinement with the same knobs
    only, so micro-batch 12 and the small bucket were never measured together."""
    land = MidPeakWithKnob()
    knobs = {0: {}, 1: {"reduce_bucket_size": [500000000, 50000000], "allgather_bucket_size": [500000000, 50000000]}}
    out = tuner(make_plan(stages=[0, 1], knobs=knobs, fast=False), land, tuner_type="model_based")[0].tune()
    best = max(land.throughput(dict(stage=1, micro_batch=m, reduce_bucket_size=50000000)) for m in range(1, 30))
    assert land.throughput(out.best.params) >= 0.99 * best
    assert out.best.params["stage"] == 1 and out.best.params["reduce_bucket_size"] == 50000000
    assert 11 <= out.best.params["micro_batch"] <= 13


class Sawtooth(Landscape):
    """max_train_batch_size 64 on 2 ranks: each experiment accumulates 32 // micro-batch steps, so
    throughput is a sawtooth along the micro-batch (a fixed cost per micro-step, and the optimizer
    step paid once per accumulated batch): highest at each accumulation's largest size."""

    def throughput(self, params):
        mbs, gas = params["micro_batch"], params["gas"]
        return mbs * gas * 2 / (gas * (0.05 + 0.01 * mbs) + 0.5) * (1.0 - 0.05 * params["stage"])


def test_with_max_train_batch_size_each_size_runs_the_accumulation_that_fills_the_batch_most():
    """On a sawtooth (a size below the largest at its accumulation carries fewer samples per step at the
    same cost) with edges between the sizes that fill the batch, every experiment runs the accumulation
    that fills the batch most for its size, and the best that fits is found."""
    land = Sawtooth(per_sample=180 * 2**20)  # edges at 15 (z0), 17 and 18: between the sizes that fill the batch
    plan = make_plan(max_tbs=64)
    out = tuner(plan, land, tuner_type="model_based")[0].tune()
    ok = [m.params for m in out.measured if m.ok]
    assert ok and all(p["gas"] == 32 // p["micro_batch"] for p in ok)
    assert {m for m in range(1, 33) if plan.fills_batch(m)} == {1, 2, 3, 4, 5, 6, 8, 10, 16, 32}
    fit = [dict(stage=s, micro_batch=m, gas=32 // m) for s in range(4) for m in range(1, 33) if land.peak(s, m) <= LIMIT]
    assert land.throughput(out.best.params) >= 0.99 * max(map(land.throughput, fit))


class BehindWithKnob(Landscape):
    """Stage 1 is 4% behind stage 0 with its default knobs (beyond the noise), and its small reduce
    bucket is worth 10%: stage 1 with it is the best."""

    def throughput(self, params):
        t = 100 * (1.0 - 0.04 * params["stage"])
        return t * (1.10 if params["stage"] == 1 and params.get("reduce_bucket_size") == 50000000 else 1.0)


def test_a_stage_behind_the_lead_gets_one_look_at_its_knobs():
    """The cost model had not seen stage 1's knobs varied (stage 0 has none), so it predicted stage
    1's knob combinations at stage 1's default value, 4% behind: no knob of stage 1 was ever tried."""
    land = BehindWithKnob()
    plan = make_plan(stages=[0, 1], mbs=MicroBatchRule("fixed", (8,)), knobs={0: {}, 1: {"reduce_bucket_size": [500000000, 50000000]}}, fast=False)
    out = tuner(plan, land, tuner_type="model_based")[0].tune()
    assert out.best.params["stage"] == 1 and out.best.params["reduce_bucket_size"] == 50000000


class TiedStagesKnobInTheRicher(Landscape):
    """Stages 1 and 2 within 0.5% of each other (stage 1 ahead, inside one measurement's noise);
    stage 2 has five knobs and overlap_comm is worth 10% there, stage 1 has two bucket sizes worth
    nothing."""

    def throughput(self, params):
        t = 100 * (1.0 - 0.005 * (params["stage"] - 1))
        return t * (1.10 if params["stage"] == 2 and params.get("overlap_comm") else 1.0)


def test_of_stages_tied_for_the_lead_the_one_with_more_knob_combinations_is_searched_first():
    """The knob search went to the stage whose one measurement came out highest, stage 1 here, and
    spent its early-stop budget on bucket sizes that change nothing before it looked at stage 2."""
    land = TiedStagesKnobInTheRicher(spread=0.03)
    buckets = {"reduce_bucket_size": [500000000, 50000000], "allgather_bucket_size": [500000000, 50000000]}
    knobs = {1: dict(buckets), 2: {**buckets, "overlap_comm": [False, True], "reduce_scatter": [True, False], "contiguous_gradients": [True, False]}}
    plan = make_plan(stages=[1, 2], mbs=MicroBatchRule("fixed", (8,)), knobs=knobs, fast=False)
    out = tuner(plan, land, tuner_type="model_based")[0].tune()
    first_knob_run = next(c for c in land.calls if len(c) > 3 and any(c[k] != knobs[c["stage"]][k][0] for k in knobs[c["stage"]]))
    assert first_knob_run["stage"] == 2, land.calls
    assert out.best.params["stage"] == 2 and out.best.params["overlap_comm"] is True


class SaturatingWithKnob(Landscape):
    """Throughput saturates with the micro-batch (flat from about 10), and a small reduce bucket is
    worth 10% in stage 1 only."""

    def throughput(self, params):
        t = 100 * (1 - 0.5 * math.exp(-params["micro_batch"] / 2))
        return t * (1.10 if params["stage"] == 1 and params.get("reduce_bucket_size") == 50000000 else 1.0)


def test_a_stage_that_leads_by_its_knobs_does_not_search_its_default_knob_line_on_its_own():
    """Once the small bucket put stage 1 in the lead, the old search bracketed stage 1's default-knob
    line on its own (10 and 14 below its one look at 20), which cannot hold the optimum: that line is
    the knob line's prior, and the line below it prices it."""
    land = SaturatingWithKnob(per_sample=150 * 2**20)
    knobs = {0: {}, 1: {"reduce_bucket_size": [500000000, 50000000]}}
    out = tuner(make_plan(stages=[0, 1], knobs=knobs, fast=False), land, tuner_type="model_based")[0].tune()
    assert out.best.params["stage"] == 1 and out.best.params["reduce_bucket_size"] == 50000000
    default_line = {c["micro_batch"] for c in land.calls if c["stage"] == 1 and c["reduce_bucket_size"] == 500000000}
    knob_line = {c["micro_batch"] for c in land.calls if c["stage"] == 1 and c["reduce_bucket_size"] == 50000000}
    assert len(default_line) < len(knob_line), land.calls


BIG = 400_000_000


class OnlyStage3Fits(Landscape):
    """A large model (fp32 AdamW, 2 ranks): z0 runs out of memory at micro-batch 1, z1's model
    states alone (4 + 4 + 8/2 bytes per parameter) exceed the 4 GiB limit, z2 cannot fit one sample,
    z3 fits about 26."""

    params = BIG  # the model's parameter count, as its runs report it

    def peak(self, stage, mbs):
        return 0.25 * GiB + {0: 16, 1: 12, 2: 10, 3: 8}[stage] * self.params + 30 * 2**20 * mbs

    def __call__(self, exp):
        result = super().__call__(exp)
        for k in ("num_params", "trainable_num_params"):
            if k in result.metrics:
                result.metrics[k] = self.params
        return result


def test_no_profile_case_the_memory_model_comes_from_the_first_stage_that_runs():
    """z0 OOMs at micro-batch 1 (the old search's profiling failed and the model stayed off, so
    every stage doubled from 1)."""
    land = OnlyStage3Fits()
    t, _ = tuner(make_plan(), land, tuner_type="model_based")
    out = t.tune()
    assert land.calls[0] == {"stage": 0, "micro_batch": 1, "gas": 1} and land.calls[1]["stage"] == 3
    assert t.memory is not None and t.memory.num_params == BIG
    assert 1 not in {c["stage"] for c in land.calls}  # z1's model states alone exceed the limit: no experiment
    # z2 misses micro-batch 1 by 0.1%: the memory model cannot know that, so z2, never seen, is a risk the
    # acquisition may take (here at 10, 3, 2, then 1, each OOM priced as the launch it costs, each size once),
    # not a stage skipped unseen
    z2 = [c["micro_batch"] for c in land.calls if c["stage"] == 2]
    assert len(z2) <= 4 and len(set(z2)) == len(z2), z2
    assert any("z1: skipped, its model states alone" in n for n in out.notes)
    assert sum(m.result.status == "oom" for m in out.measured) <= 7  # z0's profiling OOM, z2's tries, at most two at z3's edge
    true_best = max(land.throughput(dict(stage=3, micro_batch=m)) for m in range(1, 200) if land.peak(3, m) <= LIMIT)
    assert out.best.value >= 0.99 * true_best


EXTRA_AT_3 = int(1.2 * GiB)  # what ZeRO-3 holds that no other stage does (prefetch and gathered weights, say)
MID = 300_000_000


class Stage3HoldsMore(OnlyStage3Fits):
    """z0 runs out of memory; z3 runs, but it holds 1.2 GiB that z2 does not. The memory model, whose fixed
    part comes from z3's run, predicts z2 to run out of memory at micro-batch 1; in truth z2 fits about 32
    samples, and it is the fastest stage there."""

    params = MID

    def peak(self, stage, mbs):
        return super().peak(stage, mbs) + (EXTRA_AT_3 if stage == 3 else 0)


def test_a_stage_the_memory_model_only_predicts_to_run_out_of_memory_still_gets_its_chance():
    """A prediction of OOM is a risk, priced by P(fits), not a reason to skip the stage: the search that
    skipped every stage predicted to OOM at the smallest size never ran z2 here, and declared z3 (26% slower)."""
    land = Stage3HoldsMore()
    out = tuner(make_plan(), land, tuner_type="model_based")[0].tune()
    assert any(c["stage"] == 2 for c in land.calls), land.calls
    true_best = max(land.throughput(dict(stage=s, micro_batch=m)) for s in (1, 2, 3) for m in range(1, 200) if land.peak(s, m) <= LIMIT)
    assert out.best.params["stage"] == 2 and out.best.value >= 0.98 * true_best


SMALL_FIT = 388_000_000  # z2 holds 10 bytes per parameter: it fits 4 samples under the limit, z3 about 29


class Stage2FitsFew(OnlyStage3Fits):
    """z0 and z1 cannot hold the model; z2 fits micro-batch 4 at most and z3 fits 29, where it is
    faster than z2 can be anywhere."""

    params = SMALL_FIT


def test_every_launched_trial_has_its_plain_params_in_the_study(tmp_path):
    knobs = {1: {"reduce_bucket_size": [500000000, 50000000], "overlap_comm": [True, False]}, 3: {"reduce_bucket_size": [500000000, 50000000]}}
    t, study = tuner(make_plan(stages=[1, 3], knobs=knobs, fast=False), Landscape(), f"sqlite:///{tmp_path / 'o.db'}", tuner_type="random")
    t.tune()
    df = study.trials_dataframe()
    launched = df[df["user_attrs_name"].notna()]
    assert len(launched) >= 5
    for col in ("params_stage", "params_micro_batch", "params_gas"):
        assert launched[col].notna().all()
    z1 = launched[launched["params_stage"] == 1]
    assert z1["params_reduce_bucket_size"].notna().all() and z1["params_overlap_comm"].notna().all()
    assert not [c for c in df.columns if c.startswith("params_") and "/" in c]  # no stage-qualified names


def test_a_trial_left_running_by_a_dead_process_is_interrupted_through_the_public_api(tmp_path):
    storage = f"sqlite:///{tmp_path / 'o.db'}"
    t, study = tuner(make_plan(stages=[0]), Landscape(), storage)
    dead = t.ledger.claim({"stage": 0, "micro_batch": 1, "gas": 1})  # its process dies here
    again, study = tuner(make_plan(stages=[0]), Landscape(), storage)
    assert again.interrupted == [dead.number]
    frozen = study.trials[dead.number]
    assert frozen.state == optuna.trial.TrialState.FAIL and frozen.params == {"stage": 0, "micro_batch": 1, "gas": 1}
    out = again.tune()
    assert {"stage": 0, "micro_batch": 1, "gas": 1} in [m.params for m in out.measured]  # run again


def test_a_dead_workers_trial_is_run_again_first_even_where_the_strategy_would_not_go(tmp_path):
    """Worker B dies holding micro-batch 3 of stage 0, a size the strategy never proposes on its own:
    once B's trial is failed (stale heartbeat), worker A runs it again before anything new."""
    storage = f"sqlite:///{tmp_path / 'o.db'}"
    a, study = tuner(make_plan(stages=[0]), Landscape(), storage, alone=False, poll_seconds=0)
    b, _ = tuner(make_plan(stages=[0]), Landscape(), storage, alone=False, poll_seconds=0)
    odd = {"stage": 0, "micro_batch": 3, "gas": 1}
    dead = b.ledger.claim(odd)
    first = a.propose()
    assert first[0].params != odd  # still running: taken
    a.run(*first)
    study.tell(dead.number, state=optuna.trial.TrialState.FAIL)  # what fail_stale_trials does once B stops beating
    trial, step = a.propose()
    assert trial.params == odd and "again" in step.why
    a.run(trial, step)
    out = a.tune()
    assert [m.params for m in out.measured].count(odd) == 1  # once, not again and again
    assert odd not in [p for p in a.ledger.to_run_again()]


def test_two_workers_never_run_the_same_params(tmp_path):
    """Two tuners on one study, interleaved: each proposes while the other's trial is RUNNING."""
    storage = f"sqlite:///{tmp_path / 'o.db'}"
    knobs = {0: {}, 1: {"reduce_bucket_size": [500000000, 50000000], "allgather_bucket_size": [500000000, 50000000]}}
    plan = make_plan(stages=[0, 1], knobs=knobs, fast=False)
    a, study = tuner(plan, Landscape(), storage, alone=False, poll_seconds=0)
    b, _ = tuner(plan, Landscape(), storage, alone=False, poll_seconds=0)
    run_in_step(a, b)
    launched = [tuple(sorted(t.params.items())) for t in study.trials if "name" in t.user_attrs and "repeat_of" not in t.user_attrs]
    assert len(launched) == len(set(launched)) >= 4


def run_in_step(*workers, rounds: int = 12) -> None:
    """Every worker proposes while the others' claims are RUNNING, then all run what they claimed."""
    for _ in range(rounds):
        claimed = [(w, c) for w in workers if isinstance(c := w.propose(), tuple)]
        if not claimed:
            return
        params = [c[0].params for _, c in claimed]
        assert all(p != q for i, p in enumerate(params) for q in params[i + 1:])
        for worker, (trial, step) in claimed:
            worker.run(trial, step)


def test_a_simultaneous_claim_of_the_same_params_goes_to_the_lower_trial_number(tmp_path):
    storage = f"sqlite:///{tmp_path / 'o.db'}"
    a, study = tuner(make_plan(stages=[0]), Landscape(), storage, alone=False)
    b, _ = tuner(make_plan(stages=[0]), Landscape(), storage, alone=False)
    p = {"stage": 0, "micro_batch": 4, "gas": 1}
    first, second = a.ledger.claim(p), b.ledger.claim(p)
    assert first is not None and second is None
    assert study.trials[-1].state == optuna.trial.TrialState.PRUNED and study.trials[-1].user_attrs["duplicate_of"] == first.number


def test_a_claim_of_the_same_params_still_being_written_by_an_earlier_trial_is_waited_for(tmp_path, monkeypatch):
    """Worker A has asked for its trial, and Optuna has set its stage but not yet its micro-batch
    when worker B claims the same params: B waits for A's claim to be complete and yields to it.
    (The wait's limit is raised: on a loaded machine A's writes can take longer than CLAIM_WAIT_S,
    and what is tested is the waiting, not how long it lasts.)"""
    import threading

    from mlautotune.search import ledger as ledger_module
    from mlautotune.search.ledger import Fixed

    monkeypatch.setattr(ledger_module, "CLAIM_WAIT_S", 60.0)

    storage = f"sqlite:///{tmp_path / 'o.db'}"
    a, study = tuner(make_plan(stages=[0]), Landscape(), storage, alone=False)
    b, _ = tuner(make_plan(stages=[0]), Landscape(), storage, alone=False)
    p = {"stage": 0, "micro_batch": 4, "gas": 1}
    a.ledger.study.sampler = Fixed(p)
    early = a.ledger.study.ask({"stage": a.ledger.dists["stage"]})

    def finish_a_claim():
        for k in ("micro_batch", "gas"):
            early.suggest_int(k, 1, 1 << 16, log=True)
        early.set_user_attr("params", p)

    threading.Timer(0.5, finish_a_claim).start()
    assert b.ledger.claim(p) is None
    assert study.trials[-1].state == optuna.trial.TrialState.PRUNED and study.trials[-1].user_attrs["duplicate_of"] == early.number


@pytest.mark.parametrize("storage_delay", [0.0, 0.3])
def test_a_claim_its_worker_died_writing_is_waited_for_once(tmp_path, monkeypatch, storage_delay):
    """Worker A died between `ask` and its params: its trial stays RUNNING, half-written, until its
    heartbeat fails it. Worker B waits CLAIM_WAIT_S for it once, not at each of its claims, and
    looks again at least once even when the storage answers slower than CLAIM_WAIT_S (a loaded
    host: a first read of 0.3 s used to give up without a second look)."""
    from mlautotune.search import ledger as ledger_module
    from mlautotune.search.ledger import Fixed

    storage = f"sqlite:///{tmp_path / 'o.db'}"
    a, study = tuner(make_plan(stages=[0]), Landscape(), storage, alone=False)
    b, _ = tuner(make_plan(stages=[0]), Landscape(), storage, alone=False)
    a.ledger.study.sampler = Fixed({"stage": 0})
    a.ledger.study.ask({"stage": a.ledger.dists["stage"]})  # A dies here
    monkeypatch.setattr(ledger_module, "CLAIM_WAIT_S", 0.2)
    sleeps = []
    real_sleep = ledger_module.time.sleep
    monkeypatch.setattr(ledger_module.time, "sleep", lambda s: (sleeps.append(s), real_sleep(s)))
    real_get_trials = b.ledger.study.get_trials
    monkeypatch.setattr(b.ledger.study, "get_trials", lambda *a, **k: (real_sleep(storage_delay), real_get_trials(*a, **k))[1])
    first = b.ledger.claim({"stage": 0, "micro_batch": 4, "gas": 1})
    waited = len(sleeps)
    second = b.ledger.claim({"stage": 0, "micro_batch": 8, "gas": 1})
    assert first is not None and second is not None and waited > 0 and len(sleeps) == waited


def test_a_failed_first_run_does_not_end_the_session():
    """A crash that is not an OOM (a port clash, a flaky collective) at the first size: the
    profiling goes on with the next size instead of giving up with no result."""
    land = Landscape(fail_at=(0, 1))
    out = tuner(make_plan(stages=[0], mbs=MicroBatchRule("list", (1, 2, 4, 6))), land, tuner_type="gridsearch")[0].tune()
    assert out.best is not None and sorted(c["micro_batch"] for c in land.calls) == [1, 2, 4, 6]


def test_the_trial_budget_counts_re_measurements():
    """tuner_num_trials caps launches: a near-tied leader is not re-measured past the budget."""
    land = Landscape(spread=0.05)  # a near-tie that is re-measured with budget to spare
    out = tuner(make_plan(stages=[0], mbs=MicroBatchRule("list", (12, 13))), land, tuner_type="model_based")[0].tune()
    assert len(land.calls) > 2  # two configurations, so one was measured again
    land = Landscape(spread=0.05)
    t, _ = tuner(make_plan(stages=[0], mbs=MicroBatchRule("list", (12, 13))), land, tuner_type="model_based", num_trials=2)
    out = t.tune()
    assert len(land.calls) == 2 and out.best is not None
    # a re-measurement the budget stops is not reported as made: it is what was left
    assert out.notes == ["stopped: tuner_num_trials=2 experiments run"] and out.left[0].endswith(" again")


# ---- several workers: proposals while other trials are in flight ---------------------------------------
def workers(plan, n=2, land=None, **settings):
    storage = optuna.storages.InMemoryStorage()
    return [tuner(plan, land or Landscape(), storage, alone=False, poll_seconds=0, **settings)[0] for _ in range(n)]


def test_a_second_worker_goes_to_a_stage_nobody_is_measuring():
    a, b = workers(make_plan(stages=[0, 1, 2]))
    for _ in range(3):  # profiling runs to completion, then both ask at once
        a.run(*a.propose())
    first, second = a.propose(), b.propose()
    assert first[0].params["stage"] != second[0].params["stage"]


def test_a_pending_re_measurement_is_not_proposed_twice():
    """Two near-tied leaders (10% step-time spread): while one worker re-measures one of them, the
    other worker does not re-measure the same one."""
    a, b = workers(make_plan(stages=[0], mbs=MicroBatchRule("list", (12, 13))), n=2, land=Landscape(spread=0.10), tuner_type="model_based")
    for _ in range(2):
        a.run(*a.propose())
    first = a.propose()
    assert first[1].repeat_of is not None
    second = b.propose()
    assert second is None or second[1].params != first[1].params


def test_a_claim_still_being_written_by_another_worker_is_neither_taken_nor_run_again():
    """Optuna's `ask` creates the trial RUNNING and sets its params one by one: another worker that
    reads the study in between sees a trial with no params or some of them. It is not pending (CI on
    b8522d6: KeyError 'stage'), and if its worker dies there, there is nothing to run again."""
    a, b = workers(make_plan(stages=[0, 1]))
    for _ in range(3):  # profiling done: the next choice spreads the workers over the stages
        a.run(*a.propose())
    study = a.ledger.study
    empty, partial = study.ask(), study.ask({"micro_batch": a.ledger.dists["micro_batch"]})
    first = b.propose()
    assert isinstance(first, tuple) and b.ledger.pending == {}
    b.run(*first)
    for t in (empty, partial):
        study.tell(t, state=optuna.trial.TrialState.FAIL)  # their worker died mid-claim
    assert b.ledger.to_run_again() == []  # nothing to run again
    after = b.propose()
    assert after is None or (after[1].why != "run again: its experiment was cut off" and set(after[0].params) == {"stage", "micro_batch", "gas"})


def test_the_budget_counts_other_workers_pending_trials():
    a, b = workers(make_plan(stages=[0, 1]), num_trials=2)
    assert isinstance(a.propose(), tuple) and isinstance(b.propose(), tuple)
    assert a.propose() == "budget"


def test_workers_that_each_profiled_a_stage_measure_one_second_memory_point_between_them():
    """Four workers start together: the first stage at micro-batch 1 and 4 (the slope), two other stages
    at 1. Once those are in, the per-sample slope needs no more sizes: each worker used to take its
    own first result as "the first" and profile its own stage again."""
    ws = workers(make_plan(), n=4)
    claimed = [w.propose() for w in ws]
    assert sorted((c[0].params["stage"], c[0].params["micro_batch"]) for c in claimed) == [(0, 1), (0, 4), (1, 1), (3, 1)]
    for w, c in reversed(list(zip(ws, claimed))):  # the last stage's finishes first
        w.run(*c)
    nxt = [w.propose() for w in ws]
    seconds = [c[1] for c in claimed + nxt if isinstance(c, tuple) and c[1].why.startswith("profiling") and c[0].params["micro_batch"] == 4]
    assert len(seconds) == 1


class ScriptBroken(Landscape):
    """The script raises at import: every experiment fails the same way, whatever its configuration."""

    def __call__(self, exp):
        self.calls.append(dict(exp.params))
        return Result(exp.name, "failed", {}, "rank 0: ModuleNotFoundError: No module named 'x'\nexit code 1; last lines of stderr.log:\n...", 2.0, "", 1)


def test_the_same_script_error_in_two_stages_ends_the_session_before_the_other_stages_are_launched():
    """Without it, a four-stage session launched 8 experiments (2 sizes x 4 stages) that all raised the
    same ModuleNotFoundError. Now the second stage's failure with the same error ends it, with a note
    that names the error and how to start again."""
    land = ScriptBroken()
    out = tuner(make_plan(), land, tuner_type="gridsearch")[0].tune()
    assert out.best is None and len(land.calls) == 3 and len({c["stage"] for c in land.calls}) == 2
    assert any("ModuleNotFoundError" in n and "overwrite=true" in n for n in out.notes)
    # different errors per stage may be the configurations': every stage is still tried
    class StageErrors(ScriptBroken):
        def __call__(self, exp):
            r = super().__call__(exp)
            r.reason = f"rank 0: RuntimeError: stage {exp.params['stage']} unsupported"
            return r

    land = StageErrors()
    tuner(make_plan(), land, tuner_type="gridsearch")[0].tune()
    assert {c["stage"] for c in land.calls} == {0, 1, 2, 3}

    class MixedEnds(ScriptBroken):  # a bare exit code in one stage, an early end in another: not one error
        def __call__(self, exp):
            r = super().__call__(exp)
            if exp.params["stage"] == 0:
                r.reason = "exit code 1; last lines of stderr.log:\n..."
            else:
                r.status, r.reason = "incomplete", "the script ended before the measurement window"
            return r

    land = MixedEnds()
    tuner(make_plan(), land, tuner_type="gridsearch")[0].tune()
    assert {c["stage"] for c in land.calls} == {0, 1, 2, 3}


class ShortScript(Landscape):
    """A script that trains too few steps (how many depends on the batch, as an epoch's do): every
    window is closed by its end, short of the target."""

    def __call__(self, exp: Experiment) -> Result:
        r = super().__call__(exp)
        if r.status == "ok":
            r.metrics.update(window_cut_by_script=True, target_reached=False, last_measured_step=10 + len(self.calls))
        return r


def test_windows_cut_short_by_the_script_give_one_note_with_advice():
    plan = make_plan(stages=[0])
    t, _ = tuner(plan, ShortScript())
    said = io.StringIO()
    t.observers.append(Console("throughput", 50, stream=said))
    out = t.tune()
    advice = [n for n in out.notes if "script ended before" in n]
    assert len(advice) == 1 and "more steps" in advice[0]
    assert said.getvalue().count(advice[0]) == 1  # on the console once, though every experiment was cut short
    assert sum(m.ok for m in out.measured) > 1
    out = tuner(plan, Landscape())[0].tune()  # windows that ended at their target or budget: no advice
    assert not [n for n in out.notes if "script ended" in n]


def test_a_process_killed_between_a_trials_status_and_its_result_leaves_it_to_run_again(tmp_path):
    """The ledger writes a finished experiment's result and status one attribute at a time; a process
    SIGKILLed in between leaves a trial with an outcome but no result. Resumed, it is cut off like any
    other: run again once, not taken as an earlier claim of the same params (the resume then claimed
    it as a duplicate again and again, and never ended)."""
    storage = f"sqlite:///{tmp_path / 'o.db'}"
    params = {"stage": 0, "micro_batch": 1, "gas": 1}
    t, study = tuner(make_plan(stages=[0]), Landscape(), storage)
    dead = t.ledger.claim(params)
    dead.set_user_attr("status", "ok")  # its process dies here, before the result is written
    again, study = tuner(make_plan(stages=[0]), Landscape(), storage)
    assert again.interrupted == [dead.number]
    claimed = again.propose()
    assert isinstance(claimed, tuple) and claimed[0].params == params and "again" in claimed[1].why
    again.run(*claimed)
    out = again.tune()
    assert [m.params for m in out.measured].count(params) == 1
