"""One shared suite for every sampler (as in Optuna's own sampler tests), then model_based specifics.

Trials run on a synthetic landscape with infeasible (OOM) points, through a real Optuna study,
asked and told the way search.py does it.
"""

import itertools

import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from mlautotune.samplers import ModelBasedSampler, build_sampler

SPACE = {"micro_batch": [1, 2, 4, 8, 16, 32], "reduce_bucket_size": [50000000, 500000000, 1000000000], "overlap_comm": [True, False]}
SIZE = 6 * 3 * 2


def landscape(p):
    """Throughput rises with micro-batch until 16; 32 is out of memory; a sweet spot at 5e8 with overlap."""
    if p["micro_batch"] == 32:
        return None
    return p["micro_batch"] / (p["micro_batch"] + 3) * 100 * (1.1 if p["reduce_bucket_size"] == 500000000 else 1.0) * (1.05 if p["overlap_comm"] else 1.0)


def run(sampler, n, direction="maximize", storage=None, history=()):
    study = optuna.create_study(direction=direction, storage=storage)
    for params, value in history:
        study.add_trial(optuna.trial.create_trial(params={}, distributions={}, value=value, user_attrs={"params": params, "status": "ok"}))
    study.sampler = sampler
    dists = {k: CategoricalDistribution(v) for k, v in SPACE.items()}
    seen = []
    for _ in range(n):
        trial = study.ask(dists)
        p = dict(trial.params)
        trial.set_user_attr("params", p)
        seen.append(p)
        value = landscape(p)
        if value is None:
            trial.set_user_attr("status", "oom")
            study.tell(trial, state=TrialState.FAIL)
        else:
            trial.set_user_attr("status", "ok")
            study.tell(trial, value if direction == "maximize" else 1000 / value)
    return study, seen


@pytest.mark.parametrize("kind", ["model_based", "gridsearch", "random"])
def test_proposals_lie_in_the_space(kind):
    _, seen = run(build_sampler(kind, SPACE, seed=1), 12)
    for p in seen:
        assert all(p[k] in SPACE[k] for k in SPACE)


@pytest.mark.parametrize("kind", ["model_based", "gridsearch"])
def test_exhaustive_samplers_visit_the_whole_space_without_repeats(kind):
    _, seen = run(build_sampler(kind, SPACE, seed=3), SIZE)
    keys = {tuple(sorted(p.items())) for p in seen}
    assert len(keys) == SIZE


@pytest.mark.parametrize("kind", ["model_based", "gridsearch", "random"])
def test_deterministic_given_the_seed(kind):
    _, a = run(build_sampler(kind, SPACE, seed=7), 10)
    _, b = run(build_sampler(kind, SPACE, seed=7), 10)
    assert a == b


@pytest.mark.parametrize("kind", ["model_based", "gridsearch", "random"])
def test_failed_trials_are_never_a_value_of_zero(kind, tmp_path):
    study, _ = run(build_sampler(kind, SPACE, seed=0), 20, storage=f"sqlite:///{tmp_path / 's.db'}")
    for t in study.trials:
        if t.user_attrs["status"] == "oom":
            assert t.state == TrialState.FAIL and t.value is None
    assert study.best_value > 0


def trials_to_best(kind, seed):
    best = max(v for p in itertools.product(*SPACE.values()) if (v := landscape(dict(zip(SPACE, p)))) is not None)
    _, seen = run(build_sampler(kind, SPACE, seed=seed), SIZE)
    return next(i for i, p in enumerate(seen, 1) if landscape(p) == best)


def test_model_based_finds_the_best_in_fewer_trials_than_random():
    mb = sorted(trials_to_best("model_based", s) for s in range(5))
    rnd = sorted(trials_to_best("gridsearch", s) for s in range(5))
    assert mb[2] < rnd[2]  # median over seeds
    assert mb[2] <= SIZE // 2


def test_model_based_explores_on_schedule():
    sampler = ModelBasedSampler(SPACE, seed=0, explore_every=4)
    choices = []
    study = optuna.create_study(direction="maximize")
    study.sampler = sampler
    dists = {k: CategoricalDistribution(v) for k, v in SPACE.items()}
    for _ in range(9):
        trial = study.ask(dists)
        p = dict(trial.params)
        choices.append(sampler.last_choice)
        v = landscape(p)
        study.tell(trial, v) if v is not None else study.tell(trial, state=TrialState.FAIL)
    assert choices[:2] == ["startup", "startup"]
    assert choices[3] == "explore" and choices[7] == "explore" and choices[4] == "greedy"


def test_model_based_avoids_what_the_feasibility_model_rules_out():
    _, seen = run(ModelBasedSampler(SPACE, seed=0, explore_every=0), 20)
    later = seen[8:]
    assert sum(p["micro_batch"] == 32 for p in later) <= 1


def test_model_based_learns_from_trials_of_other_stages_with_other_knobs():
    history = [({"stage": 0, "micro_batch": m}, landscape({"micro_batch": m, "reduce_bucket_size": 0, "overlap_comm": False})) for m in (1, 4, 16)]
    _, seen = run(ModelBasedSampler(SPACE, seed=0, n_startup=2, explore_every=0), 1, history=history)
    assert seen[0]["micro_batch"] == 16  # the cost model carried over what micro-batch does


def test_model_based_minimises_when_the_direction_is_minimise():
    _, seen = run(ModelBasedSampler(SPACE, seed=0, explore_every=0), 10, direction="minimize")
    later = [landscape(p) for p in seen[4:]]
    best = max(v for p in itertools.product(*SPACE.values()) if (v := landscape(dict(zip(SPACE, p)))) is not None)
    assert max(v for v in later if v is not None) >= 0.9 * best  # low latency = high throughput


def test_exploration_takes_the_farthest_of_the_promising_candidates():
    history = [({"micro_batch": m, "reduce_bucket_size": 500000000, "overlap_comm": True}, landscape({"micro_batch": m, "reduce_bucket_size": 500000000, "overlap_comm": True})) for m in (2, 4, 8, 16)]
    study, _ = run(ModelBasedSampler(SPACE, seed=0), 0, history=history)
    sampler = ModelBasedSampler(SPACE, seed=0)
    finished = study.get_trials(deepcopy=False)
    tried = {tuple(sorted(p.items())) for p, _ in history}
    untried = [c for c in sampler.candidates() if tuple(sorted(c.items())) not in tried]
    scores = sampler.scores(untried, finished, maximize=True)
    sampler._proposals = sampler.explore_every - 1  # the next proposal is an exploring one
    study.sampler = sampler
    trial = study.ask({k: CategoricalDistribution(v) for k, v in SPACE.items()})
    assert sampler.last_choice == "explore"
    chosen = untried.index(dict(trial.params))
    assert scores[chosen] >= sorted(scores)[len(scores) // 2 - 1]  # among the better half, never micro-batch 1
    assert trial.params["micro_batch"] != 1
    assert (trial.params["reduce_bucket_size"], trial.params["overlap_comm"]) != (500000000, True)  # away from what was tried


def test_an_oom_rules_out_larger_micro_batches_with_the_same_knobs_only():
    from mlautotune.samplers.cost_model import CostModel

    tried = [{"stage": 2, "micro_batch": m, "reduce_bucket_size": 1000000000} for m in (4, 8, 16)]
    model = CostModel().fit_feasibility(tried, [True, True, False])
    p = model.p_feasible([
        {"stage": 2, "micro_batch": 32, "reduce_bucket_size": 1000000000},  # same knobs, larger: infeasible
        {"stage": 2, "micro_batch": 16, "reduce_bucket_size": 50000000},  # smaller buckets may fit: the classifier decides
    ])
    assert p[0] == 0.0 and p[1] > 0.0
