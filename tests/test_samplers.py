"""Choosers (samplers/): one shared suite for every tuner type, then model_based's cost model.

Each chooser picks among untried candidates given the history (params, value or None, status); the
harness here only runs the landscape and reports what happened, it marks nothing on its own.
"""

import itertools
import random
import statistics

import pytest

from mlautotune.search.samplers import ModelBasedSampler, make_chooser
from mlautotune.search.samplers.choosers import RandomChoice
from mlautotune.search.samplers.cost_model import CostModel

SPACE = {"micro_batch": [1, 2, 4, 8, 16, 32], "reduce_bucket_size": [50000000, 500000000, 1000000000], "overlap_comm": [True, False]}
ALL = [dict(zip(SPACE, values)) for values in itertools.product(*SPACE.values())]


def landscape(p):
    """Throughput rises with micro-batch until 16; 32 is out of memory; a sweet spot at 5e8 with overlap."""
    if p["micro_batch"] == 32:
        return None
    return p["micro_batch"] / (p["micro_batch"] + 3) * 100 * (1.1 if p["reduce_bucket_size"] == 500000000 else 1.0) * (1.05 if p["overlap_comm"] else 1.0)


def run(chooser, n, maximize=True, history=()):
    history, seen = list(history), []
    for i in range(n):
        tried = [p for p, _, _ in history]
        untried = [p for p in ALL if p not in tried]
        if not untried:
            break
        p = chooser.choose(untried, history, maximize, len(history))
        assert p in untried
        seen.append(p)
        v = landscape(p)
        history.append((p, (v if maximize else 1000 / v) if v is not None else None, "ok" if v is not None else "oom"))
    return seen


@pytest.mark.parametrize("kind", ["model_based", "gridsearch", "random"])
def test_choices_are_untried_candidates_and_deterministic_given_the_seed(kind):
    a = run(make_chooser(kind, seed=7), 10)
    b = run(make_chooser(kind, seed=7), 10)
    assert a == b and len({tuple(sorted(p.items())) for p in a}) == 10


def test_gridsearch_visits_every_candidate_once_in_an_order_set_by_the_seed():
    a, b = run(make_chooser("gridsearch", seed=1), len(ALL)), run(make_chooser("gridsearch", seed=2), len(ALL))
    assert len({tuple(sorted(p.items())) for p in a}) == len(ALL) and a != b


def test_an_optuna_sampler_chooses_through_a_target():
    seen = run(make_chooser("model_based", seed=3, target={"_target_": "optuna.samplers.TPESampler"}), 6)
    assert len({tuple(sorted(p.items())) for p in seen}) == 6


def percentile_of_choice(chooser, seed):
    """Where the chooser's pick ranks among the untried candidates by true value (1.0 = the best)."""
    import random

    rng = random.Random(seed)
    feasible = [p for p in ALL if landscape(p) is not None]
    history = [(p, landscape(p), "ok") for p in rng.sample(feasible, 10)]
    untried = [p for p in feasible if p not in [h[0] for h in history]]
    choice = chooser.choose(untried, history, True, len(history))
    values = sorted(landscape(p) for p in untried)
    return values.index(landscape(choice)) / (len(values) - 1)


def test_cost_model_choice_beats_random_choice():
    """The greedy pick of the XGBoost cost model, from 10 measured points, lands in the top fifth of
    the untried candidates on average; a random pick (what this test guards against) lands mid-way."""
    model = statistics.mean(percentile_of_choice(ModelBasedSampler(seed=0, explore_every=0), s) for s in range(10))
    rnd = statistics.mean(percentile_of_choice(RandomChoice(seed=s), s) for s in range(10))
    assert model >= 0.8 > rnd + 0.15


def test_model_based_treats_feasibility_as_a_constraint():
    seen = run(ModelBasedSampler(seed=0, explore_every=0), 20)
    later = seen[6:]
    assert sum(p["micro_batch"] == 32 for p in later) <= 1  # 32 OOMs with every knob


def test_model_based_exploration_depends_on_the_seed():
    history = [(p, landscape(p), "ok") for p in ALL[::7] if landscape(p) is not None]
    untried = [p for p in ALL if p not in [h[0] for h in history] and landscape(p) is not None]
    picks = set()
    for seed in range(6):
        sampler = ModelBasedSampler(seed=seed, explore_every=1)
        picks.add(tuple(sorted(sampler.choose(untried, history, True, 0).items())))
        assert sampler.last_choice == "explore"
    assert len(picks) >= 3


def test_model_based_minimises_when_asked():
    seen = run(ModelBasedSampler(seed=0, explore_every=0), 10, maximize=False)
    best = max(v for p in ALL if (v := landscape(p)) is not None)
    assert max(v for p in seen[4:] if (v := landscape(p)) is not None) >= 0.9 * best  # low latency = high throughput


def test_model_based_learns_from_trials_of_other_stages_with_other_knobs():
    history = [({"stage": 0, "micro_batch": m}, landscape({"micro_batch": m, "reduce_bucket_size": 0, "overlap_comm": False}), "ok") for m in (1, 4, 16)]
    untried = [dict(p, stage=1) for p in ALL if p["reduce_bucket_size"] == 500000000 and p["overlap_comm"] and p["micro_batch"] < 32]
    choice = ModelBasedSampler(seed=0, explore_every=0).choose(untried, history, True, 3)
    assert choice["micro_batch"] == 16  # the cost model carried over what micro-batch does


def test_an_oom_rules_out_larger_micro_batches_with_the_same_knobs_only():
    tried = [{"stage": 2, "micro_batch": m, "reduce_bucket_size": 1000000000} for m in (4, 8, 16)]
    model = CostModel().fit_feasibility(tried, [True, True, False])
    p = model.p_feasible([
        {"stage": 2, "micro_batch": 32, "reduce_bucket_size": 1000000000},  # same knobs, larger: infeasible
        {"stage": 2, "micro_batch": 16, "reduce_bucket_size": 50000000},  # smaller buckets may fit: the classifier decides
    ])
    assert p[0] == 0.0 and p[1] > 0.0



KNOBS = {"overlap_comm": [False, True], "reduce_bucket_size": [50000000, 500000000, 1000000000], "contiguous_gradients": [False, True],
         "reduce_scatter": [False, True]}
COMBOS = [dict(zip(KNOBS, values), stage=2, micro_batch=8, gas=1) for values in itertools.product(*KNOBS.values())]


def knob_value(p):
    """Knob effects of 1-2% each, under the +-3% noise of one measurement; they add up (to 7% at best)."""
    bucket = {50000000: 1.02, 500000000: 1.0, 1000000000: 0.99}[p["reduce_bucket_size"]]
    return 100 * (1.02 if p["overlap_comm"] else 1) * bucket * (1.02 if p["contiguous_gradients"] else 1) * (1.01 if p["reduce_scatter"] else 1)


def test_model_based_adds_up_knob_effects_under_the_noise_and_picks_the_best_untried_combination_more_often():
    """100 seeded sessions: 6 of the 24 knob combinations of a stage measured once with +-3% noise, then
    one greedy choice. Adding up each knob value's mean effect (knob_effects) finds the best untried
    combination in 34 of them (mean shortfall 1.6%); the XGBoost regressor alone, in 25 (2.0%)."""
    hits, shortfall = 0, []
    for trial in range(100):
        rng = random.Random(trial)
        measured = rng.sample(COMBOS, 6)
        history = [(p, knob_value(p) * (1 + rng.uniform(-0.03, 0.03)), "ok") for p in measured]
        untried = [c for c in COMBOS if c not in measured]
        chooser = ModelBasedSampler(seed=trial % 4)
        n = next(n for n in range(10, 20) if (n + trial % 4) % chooser.explore_every)  # a greedy choice, not an exploring one
        choice = chooser.choose(untried, history, True, n)
        best = max(untried, key=knob_value)
        hits += choice == best
        shortfall.append(1 - knob_value(choice) / knob_value(best))
    assert hits >= 30 and statistics.mean(shortfall) < 0.018, (hits, statistics.mean(shortfall))


def test_knob_effects_only_where_the_candidates_share_a_stage_and_micro_batch_with_three_measured():
    from mlautotune.search.samplers.model_based import knob_effects

    done = [(p, knob_value(p)) for p in COMBOS[:3]]
    assert knob_effects(COMBOS[3:], done[:2], True) is None  # two measured: no effects yet
    assert knob_effects(COMBOS[3:] + [dict(COMBOS[3], micro_batch=4)], done, True) is None  # two slices
    predicted = knob_effects(COMBOS[3:], done, True)
    assert predicted is not None and len(predicted) == len(COMBOS) - 3
    assert knob_effects(COMBOS[3:], [(p, -v) for p, v in done], False).tolist() == pytest.approx(predicted.tolist())  # minimising: the same order
