"""A DeepSpeed-equivalent tuner, written from ../shared/reference/deepspeed-autotuner-facts.md
("How it runs"), for the replay benchmark only. It is deliberately faithful, defects included
(bf16 costed as fp32, activation memory from a forward delta, ZeRO over the GPU count, random
first picks then an XGBoost rank:pairwise model on raw numeric features).

    run(landscape_runner, plan, world_size, memory_limit, seed) -> (calls, best_params)
"""

import random
from typing import Any, Dict, List

import numpy as np

from landscape import make_experiment
from mlautotune.search import base_params, product
from mlautotune.space import tuned_knobs


def ds_model_states(num_params: float, stage: int, gpus: int) -> float:
    params, grads, optim = 4 * num_params, 4 * num_params, 8 * num_params  # "4/4/8 otherwise" (bf16 costed as fp32)
    if stage >= 1:
        optim /= gpus
    if stage >= 2:
        grads /= gpus
    if stage >= 3:
        params /= gpus
    return params + grads + optim


def run(runner, plan, world_size: int, memory_limit: float, seed: int = 0, early_stopping: int = 5, num_trials: int = 50):
    rng = random.Random(seed)
    calls: List[Any] = []
    seen: Dict[str, Any] = {}

    def measure(params):
        k = str(sorted(params.items()))
        if k not in seen:
            result = runner(make_experiment(params))
            calls.append((dict(params), result))
            seen[k] = result
        return seen[k]

    def value(r):
        return r.metrics["throughput"] if r.status == "ok" else 0.0  # defect 11: a failure scores 0

    # Model-info run: micro-batch 1, stage 3; "activation memory" is a single forward delta.
    info = measure(base_params(plan, 3, 1)).metrics
    num_params = info.get("num_params", 0)
    activation = max(1.0, 0.5 * (info.get("peak_memory_bytes", 0) - ds_model_states(num_params, 3, world_size)))
    best, best_params, prev_stage_best, prev_max_mbs = 0.0, None, 0.0, 0
    for stage in plan.stages:
        states = ds_model_states(num_params, stage, world_size)
        if states + activation > memory_limit:
            continue
        estimate = int((memory_limit - states) / activation)
        max_ok = 0
        for m in (int(estimate * 1.05), estimate, int(estimate * 0.95)):
            if m >= 1 and measure(base_params(plan, stage, m)).status == "ok":
                max_ok = m
                break
        if not max_ok:  # binary search below the estimate
            lo, hi = 1, max(1, int(estimate * 0.95))
            while lo <= hi and len(calls) < num_trials:
                mid = (lo + hi) // 2
                if measure(base_params(plan, stage, mid)).status == "ok":
                    max_ok, lo = mid, mid + 1
                else:
                    hi = mid - 1
        if not max_ok:
            continue
        stride = max(1, max_ok // 4)
        mbs_list = sorted({max(1, max_ok - i * stride) for i in range(3)}, reverse=True)
        space = {"stage": [stage], "micro_batch": mbs_list, "gas": [plan.gas], **tuned_knobs(plan, stage)}
        candidates = product(space)
        stage_best, since = 0.0, 0
        tried: List[Dict[str, Any]] = []
        while candidates and since < early_stopping and len(calls) < num_trials:
            if len(tried) < 2:
                pick = candidates.pop(rng.randrange(len(candidates)))
            else:
                pick = candidates.pop(int(np.argmax(rank_scores(tried, [value(measure(t)) for t in tried], candidates, seed))))
            tried.append(pick)
            v = value(measure(pick))
            if v > stage_best:
                stage_best, since = v, 0
            else:
                since += 1
            if v > best:
                best, best_params = v, pick
        if stage_best <= prev_stage_best and max_ok <= prev_max_mbs:
            break  # "a higher stage goes on only if it fits a larger micro-batch and is not slower"
        prev_stage_best, prev_max_mbs = max(prev_stage_best, stage_best), max(prev_max_mbs, max_ok)
    return calls, best_params


def rank_scores(tried, values, candidates, seed):
    import xgboost as xgb

    keys = sorted({k for p in tried + candidates for k in p})
    feats = lambda ps: np.array([[float(p.get(k, 0)) for k in keys] for p in ps])  # raw numbers (defect 9)
    model = xgb.XGBRanker(objective="rank:pairwise", n_estimators=30, max_depth=3, random_state=seed, nthread=1)
    model.fit(feats(tried), np.argsort(np.argsort(values)), group=[len(tried)])
    return model.predict(feats(candidates))
