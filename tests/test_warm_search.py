"""The search with a warm start (search/warm.py): earlier sessions' measurements as its prior, in a real
tuner loop on a real (in-memory) Optuna study, with a landscape for a runner."""

import math
from dataclasses import replace

import optuna

from mlautotune.run.experiment import Experiment, Resources
from mlautotune.search import Tuner
from mlautotune.search.ledger import Measured
from mlautotune.search.warm import Earlier, Today, Warm
from mlautotune.inputs.space import MicroBatchRule

from mlautotune.search.search import Search
from test_search_v3 import GiB, NUM_PARAMS, Sloped, ledger_with, ok, plan_of, settings

PLAN = dict(stages=(0, 1, 2, 3), mbs=MicroBatchRule("min", (1,)))


class Scaled(Sloped):
    """The same landscape, every throughput times `factor` (another driver, a changed argument); with
    `limit`, on a device with that much memory."""

    def __init__(self, factor=1.0, num_params=NUM_PARAMS, limit=4 * GiB):
        super().__init__(limit=limit)
        self.factor, self.num_params = factor, num_params

    def __call__(self, exp):
        r = super().__call__(exp)
        if r.status == "ok":
            r.metrics.update(throughput=r.metrics["throughput"] * self.factor, num_params=self.num_params, trainable_num_params=self.num_params)
        return r


def tune(runner, earlier=None, **kw):
    study = optuna.create_study(direction="maximize")

    def make(params):
        return Experiment(f"z{params['stage']}_mbs{params['micro_batch']}", {}, "w", [], Resources(), dict(params))

    tuner = Tuner(plan_of(**PLAN), settings(**kw), study, make, runner, earlier=earlier)
    return tuner.tune(), tuner


def earlier_of(outcome, same_hardware=True):
    runs = [replace(m, trial_number=-1 - i) for i, m in enumerate(outcome.measured)]
    return Earlier(sessions=["first"], runs=runs, same_hardware=same_hardware)


def test_a_warm_start_on_the_same_hardware_measures_the_earlier_optimum_first_and_few_others():
    cold_runner = Scaled()
    cold, _ = tune(cold_runner)
    warm_runner = Scaled()
    warm, _ = tune(warm_runner, earlier=earlier_of(cold))
    assert warm_runner.calls[0] == dict(cold.best.params), "the earlier optimum is measured first"
    # at most a third of a cold start's experiments (the replay target; the real e2e in test_warm.py holds
    # the second session to 3): beyond the earlier optimum, the model may still look where the earlier session
    # left it unsure (here the sizes next to it, and ZeRO-3 above its largest measured size)
    assert 3 * len(warm_runner.calls) <= len(cold_runner.calls), f"{len(warm_runner.calls)} warm experiments against {len(cold_runner.calls)} cold"
    assert warm.best.params == cold.best.params
    assert any(n.startswith("warm start from first") for n in warm.notes)


def test_a_second_worker_of_a_warm_start_goes_elsewhere_while_the_first_measures_the_earlier_optimum():
    """Two workers on the same hardware: the first claims the earlier optimum; the second, with no
    result of this session yet, takes the best the earlier sessions predict among the rest."""
    cold, _ = tune(Scaled())
    optimum = dict(cold.best.params)
    plan = plan_of(**PLAN)
    ledger = ledger_with(plan, [], pending=[(optimum, None)])
    step = Search(plan, settings(), earlier=earlier_of(cold)).next(ledger)
    assert step is not None and step.params != optimum and step.repeat_of is None
    assert step.params["stage"] == optimum["stage"], "the earlier sessions' best line"


def test_the_first_experiment_of_a_warm_start_is_the_optimum_the_earlier_session_declared():
    """The earlier session declared a configuration that is not its best by median measurement (as
    one declared by posterior mean among near-ties can be). The warm start re-measures what that
    session reported; only when none was declared does it take the best median."""
    cold, _ = tune(Scaled())
    earlier = earlier_of(cold)
    earlier.runs = [replace(m, result=replace(m.result, name=f"experiment{i}")) for i, m in enumerate(earlier.runs)]
    by_median = sorted((m for m in earlier.runs if m.ok), key=lambda m: -m.final_value)
    runner_up = by_median[1]
    plan = plan_of(**PLAN)
    declared = replace(earlier, optima=[runner_up.result.name])
    assert Search(plan, settings(), earlier=declared).next(ledger_with(plan, [])).params == runner_up.params
    assert Search(plan, settings(), earlier=earlier).next(ledger_with(plan, [])).params == by_median[0].params


def test_a_warm_start_on_other_hardware_profiles_first_and_still_needs_fewer_experiments():
    cold_runner = Scaled()
    cold, _ = tune(cold_runner)
    fresh_runner = Scaled(factor=1.4)
    fresh, _ = tune(fresh_runner)
    warm_runner = Scaled(factor=1.4)
    warm, _ = tune(warm_runner, earlier=earlier_of(cold, same_hardware=False))
    assert warm_runner.calls[:2] == fresh_runner.calls[:2], "other hardware: memory is not known, profiling runs as in a cold session"
    assert len(warm_runner.calls) < len(fresh_runner.calls)
    assert Sloped.throughput(warm.best.params) >= Sloped.throughput(fresh.best.params) / 1.01, "within the stop rule's 1% of what a cold session declares"


def test_a_warm_start_on_another_memory_size_takes_the_earlier_peaks_that_fit_for_profiling():
    """The same accelerator and world size, 3 GiB per rank instead of 4: a run's peak is the same bytes,
    so the earlier runs that peaked under 3 GiB stand in for profiling, and the first experiment is the
    best that the earlier throughputs and peaks predict to fit. Their OOMs, and runs above 3 GiB, say
    nothing of today's limit and are left out."""
    limit = 3 * GiB
    cold, _ = tune(Scaled())
    fresh_runner = Scaled(limit=limit)
    fresh, _ = tune(fresh_runner, memory_limit_bytes=limit)
    warm_runner = Scaled(limit=limit)
    earlier = replace(earlier_of(cold, same_hardware=False), same_ranks=True)
    warm, _ = tune(warm_runner, earlier=earlier, memory_limit_bytes=limit)
    assert fresh_runner.calls[0]["micro_batch"] == 1, "a cold session profiles at the smallest micro-batch"
    first = warm_runner.calls[0]
    assert first["micro_batch"] > 4 and first not in fresh_runner.calls[:2], "no profiling: the earlier peaks are today's"
    assert Scaled.throughput(first) >= max(Scaled.throughput(p) for p in fresh_runner.calls[:2])
    assert len(warm_runner.calls) < len(fresh_runner.calls)
    assert Sloped.throughput(warm.best.params) >= Sloped.throughput(fresh.best.params) / 1.01, "within the stop rule's 1% of what a cold session declares"


class Ranks(Sloped):
    """Sloped's throughput per rank, on `world_size` ranks; each rank's peak is 1 GiB, 0.05 GiB per
    sample and its share of the model states (fp32 weights and gradients, AdamW's two moments: 16
    bytes a parameter, ZeRO-partitioned by stage), as the probe reports it with the world size."""

    def __init__(self, world_size, limit=2 * GiB):
        super().__init__(limit=limit)
        self.world_size = world_size

    def states(self, stage):
        weights, grads, moments = (4 * NUM_PARAMS / (self.world_size if stage >= s else 1) for s in (3, 2, 1))
        return weights + grads + 2 * moments

    def peak(self, p):
        return int(1 * GiB + 0.05 * GiB * p["micro_batch"] + self.states(p["stage"]))

    def __call__(self, exp):
        r = super().__call__(exp)
        if r.status == "ok":
            tp = r.metrics["throughput"] * self.world_size
            r.metrics.update(throughput=tp, latency=1000.0 / tp, world_size=self.world_size)
        return r


def test_a_warm_start_on_another_world_size_moves_the_earlier_peaks_by_zero_s_states():
    """An earlier session on 8 ranks, today 2, the same accelerator and 2 GiB per rank: the model
    states per rank of ZeRO 1-3 grow fourfold, so a peak measured on 8 ranks would not fit here. Moved
    by the states' difference, the earlier runs that then fit stand in for profiling: the first
    experiment is the best they predict to fit, and it fits. The throughput, 4 times lower on a
    quarter of the ranks, is scaled by the world sizes before a configuration is measured in both."""
    cold, _ = tune(Ranks(8), world_size=8, memory_limit_bytes=2 * GiB)
    fresh_runner = Ranks(2)
    fresh, _ = tune(fresh_runner, world_size=2, memory_limit_bytes=2 * GiB)
    warm_runner = Ranks(2)
    earlier = replace(earlier_of(cold, same_hardware=False), same_accelerator=True)
    warm, _ = tune(warm_runner, earlier=earlier, world_size=2, memory_limit_bytes=2 * GiB)
    assert fresh_runner.calls[0]["micro_batch"] == 1, "a cold session profiles at the smallest micro-batch"
    first = warm_runner.calls[0]
    assert first["micro_batch"] > 4 and first not in fresh_runner.calls[:2], "no profiling: the moved peaks are today's"
    assert warm_runner.calls and Ranks(2)(Experiment("x", {}, "w", [], Resources(), first)).status == "ok", "the moved peaks fit"
    moved = [m.result.metrics["peak_memory_bytes"] + Ranks(2).states(m.params["stage"]) - Ranks(8).states(m.params["stage"]) for m in earlier.runs if m.ok]
    raw = [m.result.metrics["peak_memory_bytes"] for m in earlier.runs if m.ok]
    assert any(r <= 2 * GiB < x for r, x in zip(raw, moved)), "some earlier runs fit only on 8 ranks: taken as they are, they would mislead"
    assert len(warm_runner.calls) < len(fresh_runner.calls)
    assert Sloped.throughput(warm.best.params) >= Sloped.throughput(fresh.best.params) / 1.01, "within the stop rule's 1% of what a cold session declares"


def test_the_throughput_of_another_world_size_is_scaled_and_paired_without_gas():
    """8 ranks then, 2 now, a fixed global batch: gas follows the world size, so the configuration of
    the same stage, micro-batch and knobs is the pair; the samples per second scale with the ranks."""
    then = Earlier(["first"], [_measured(-1, {"stage": 1, "micro_batch": 4, "gas": 1}, 400.0)], same_hardware=False, same_accelerator=True)
    then.runs[0].result.metrics["world_size"] = 8
    today = Today(world_size=2, ds_config={}, mp_size=1, device="cuda", scales=True)
    warm = Warm(then, lambda v: v, lambda m: (m.single_interval / 1.96) ** 2, today)
    assert math.isclose(warm.observations([])[0].log_score, math.log(100.0)), "400 samples/s on 8 ranks: 100 on 2, before any pair"
    c, _, pairs = warm.offset([_measured(0, {"stage": 1, "micro_batch": 4, "gas": 4}, 110.0)])
    assert pairs == 1 and math.isclose(c, math.log(1.1))
    latency = Warm(then, lambda v: v, lambda m: 0.0, today._replace(scales=False))
    assert math.isclose(latency.observations([])[0].log_score, math.log(400.0)), "another metric: not scaled"


def test_a_new_run_of_another_model_drops_the_warm_start():
    cold, _ = tune(Scaled())
    runner = Scaled(num_params=2 * NUM_PARAMS)
    warm, tuner = tune(runner, earlier=earlier_of(cold))
    assert any(n.startswith("warm start dropped") for n in warm.notes)
    assert tuner.strategy.warm is None


def _measured(number, params, throughput, interval=0.01):
    return Measured(params, ok(throughput, mbs=params["micro_batch"], interval=interval), number, throughput)


def test_the_offset_and_spread_come_from_the_configurations_measured_in_both():
    configs = [{"stage": s, "micro_batch": 4, "gas": 1} for s in range(4)]
    earlier = Earlier(["first"], [_measured(-1 - i, p, 100.0 + 10 * i) for i, p in enumerate(configs)], same_hardware=False)
    warm = Warm(earlier, lambda v: v, lambda m: (m.single_interval / 1.96) ** 2)
    c, tau2, pairs = warm.offset([])
    assert (c, pairs) == (0.0, 0) and math.isclose(tau2, 0.25**2)
    same = [_measured(i, p, 1.2 * (100.0 + 10 * i)) for i, p in enumerate(configs[:3])]  # 20% faster, alike
    c, tau2_alike, pairs = warm.offset(same)
    assert pairs == 3 and math.isclose(c, math.log(1.2), rel_tol=1e-6) and tau2_alike < 0.25**2 / 2
    moved = [_measured(i, p, f * (100.0 + 10 * i)) for i, (p, f) in enumerate(zip(configs[:3], (1.0, 1.4, 0.8)))]  # the order changed
    _, tau2_moved, _ = warm.offset(moved)
    assert tau2_moved > tau2_alike
    obs = warm.observations(same)
    assert len(obs) == 4 and all(math.isclose(o.log_score, math.log(100.0 + 10 * i) + c) for i, o in enumerate(obs))
