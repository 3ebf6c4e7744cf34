"""Samplers beside the search's own model (samplers/): search.sampler's Optuna chooser, and the XGBoost
cost model behind CostModelSampler.

A chooser picks among untried candidates given the history (params, value or None, status); the
harness here only runs the landscape and reports what happened, it marks nothing on its own.
"""

import itertools

import optuna

from mlautotune.search.samplers import CostModelSampler, make_chooser
from mlautotune.search.samplers.cost_model import CostModel

SPACE = {"micro_batch": [1, 2, 4, 8, 16, 32], "reduce_bucket_size": [50000000, 500000000, 1000000000], "overlap_comm": [True, False]}
ALL = [dict(zip(SPACE, values)) for values in itertools.product(*SPACE.values())]

optuna.logging.set_verbosity(optuna.logging.WARNING)


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


def test_an_optuna_sampler_chooses_untried_candidates_deterministically_given_the_seed():
    target = {"_target_": "optuna.samplers.TPESampler"}
    a, b = run(make_chooser(7, target), 10), run(make_chooser(7, target), 10)
    assert a == b and len({tuple(sorted(p.items())) for p in a}) == 10
    assert run(make_chooser(8, target), 10) != a


def test_the_cost_model_sampler_finds_the_best_point_of_a_plain_study_with_an_oom_corner():
    """CostModelSampler in a plain Optuna study over SPACE (36 points, an OOM a failed trial): after its
    random start-up it runs untried points, and 14 trials find the best with every seed tried
    (Optuna's RandomSampler, seeds 0-9: in none)."""
    def objective(trial):
        v = landscape({k: trial.suggest_categorical(k, v) for k, v in SPACE.items()})
        if v is None:
            raise RuntimeError("out of memory")
        return v

    for seed in range(4):
        study = optuna.create_study(direction="maximize", sampler=CostModelSampler(seed=seed, n_startup_trials=5))
        study.optimize(objective, n_trials=14, catch=(RuntimeError,))
        points = [tuple(t.params.values()) for t in study.trials]
        assert all(p not in points[:i] for i, p in enumerate(points) if i >= 5), "an untried point each time after the start-up"
        assert study.best_params == {"micro_batch": 16, "reduce_bucket_size": 500000000, "overlap_comm": True}, seed


def test_an_oom_rules_out_larger_micro_batches_with_the_same_knobs_only():
    tried = [{"stage": 2, "micro_batch": m, "reduce_bucket_size": 1000000000} for m in (4, 8, 16)]
    model = CostModel().fit_feasibility(tried, [True, True, False])
    p = model.p_feasible([
        {"stage": 2, "micro_batch": 32, "reduce_bucket_size": 1000000000},  # same knobs, larger: infeasible
        {"stage": 2, "micro_batch": 16, "reduce_bucket_size": 50000000},  # smaller buckets may fit: the classifier decides
    ])
    assert p[0] == 0.0 and p[1] > 0.0

