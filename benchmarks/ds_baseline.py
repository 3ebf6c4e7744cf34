"""A model of DeepSpeed's own autotuner (deepspeed/autotuning/, DeepSpeed 0.19.x), for the replay
benchmark only, written from ../shared/reference/deepspeed-autotuner-facts.md and checked line by
line against autotuner.py, tuner/*.py and scheduler.py. It is faithful, defects included; it
imports nothing from the product.

    run(measure, landscape, seed, tuner_type, early_stopping, num_trials) -> the params it declares optimal (or None)

`measure(params) -> (status, metrics, wall_s)` runs one experiment. The rules, each with a test
in tests/test_ds_baseline.py:
1. model-info run: one experiment at micro-batch 1, ZeRO-3; activation memory = the forward-pass
   delta (`activation_mem_per_gpu`). If it fails, nothing is tuned.
2. model states: 2/2/16 bytes per parameter under fp16, 4/4/8 otherwise (bf16 costed as fp32);
   stage >= 1 divides the optimizer states by the GPU count, >= 2 also the gradients, 3 also the
   weights. A stage is tried only if states + activation memory < total memory.
3. micro-batch search per stage: first the minimum micro-batch (1, or the previous stage's max),
   then 1.05x, 1x, 0.95x of (memory - states) // activation memory, then a binary search that
   stops at a 5% plateau (an ok run less than 5% better than the previous ok run).
4. candidate list: from max // 2 to max with stride (max - min) // 3, keeping only sizes whose
   gas = max_train_batch_size_per_gpu // mbs differs from the max's (in practice {max // 2 at
   gas 2, max}); then, from the largest downwards, smaller sizes are tried while each is 5% better
   (the comparison reads the metrics file of the last experiment run before, a DeepSpeed bug).
5. stage rule: stages in order 0..3; a stage whose estimated max is below the largest max so far
   is skipped; in full mode a stage > 0 tunes its knobs only if its best micro-batch is larger
   than the previous best's and its metric not lower; stage 0 never tunes knobs.
6. tuner per stage: a fresh tuner with tuner_num_trials (50) and tuner_early_stopping (5) for each
   stage's knob space; its experiments come in the order of a set of JSON strings (the hash seed:
   here a seeded shuffle). It stops at i >= best_iter + early_stopping.
7. model_based: configs 0 and a random one are marked visited; the first pick is the random one
   (config 0 is never run); then XGBoost rank:pairwise on raw numeric features, refit after every
   experiment, runs the best-ranked unvisited config; failures train the model as 0.
8. failures: scored 0 in the micro-batch records; the declared optimum is the record with the
   highest single measurement, and when every record is a failure, the first failure is declared.
Where the real tool would crash (a metrics file missing when it is read), the model ends the
stage instead. It searches the landscape's knob spaces (the product's conf/space), not DeepSpeed's
own default spaces (its z3 space is 6x larger: defect 10), which favours it.
"""

import itertools
import json
import math
import random
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

PLATEAU = 0.05  # METRIC_PERCENT_DIFF_CONST
MAX_MBS = 1024  # AUTOTUNING_MAX_TRAIN_MICRO_BATCH_SIZE_PER_GPU_DEFAULT
MIN_MBS = 1  # AUTOTUNING_MIN_TRAIN_MICRO_BATCH_SIZE_PER_GPU_DEFAULT
ZERO_DEFAULTS = {  # DeepSpeedZeroConfig defaults, for experiments that name only the stage
    "reduce_bucket_size": 500000000, "allgather_bucket_size": 500000000, "reduce_scatter": True, "contiguous_gradients": True,
    "stage3_prefetch_bucket_size": 50000000, "stage3_param_persistence_threshold": 100000, "stage3_max_live_parameters": 1000000000,
}
XGB_PARAMS = {"max_depth": 3, "gamma": 0.0001, "min_child_weight": 1, "subsample": 1.0, "eta": 0.3, "lambda": 1.0, "alpha": 0,
              "objective": "rank:pairwise", "verbosity": 0, "nthread": 1}


def model_states(num_params: float, stage: int, gpus: int, fp16: bool) -> float:
    """get_instantiation_memory_required_per_gpu: Adam assumed, bf16 costed as fp32 (mp_size 1)."""
    params, grads, optim = (2 * num_params, 2 * num_params, 16 * num_params) if fp16 else (4 * num_params, 4 * num_params, 8 * num_params)
    if stage >= 1:
        optim /= gpus
    if stage >= 2:
        grads /= gpus
    if stage >= 3:
        params /= gpus
    return params + grads + optim


class Crash(Exception):
    """Where DeepSpeed's autotuner would raise: the model ends the stage."""


class DeepSpeedAutotuner:
    def __init__(self, measure: Callable, landscape: Dict[str, Any], seed: int = 0, tuner_type: str = "model_based",
                 early_stopping: int = 5, num_trials: int = 50, num_tuning_micro_batch_sizes: int = 3):
        self.measure, self.land, self.plan = measure, landscape, landscape["plan"]
        self.tuner_type, self.early_stopping, self.num_trials, self.n_mbs = tuner_type, early_stopping, num_trials, num_tuning_micro_batch_sizes
        self.rng = random.Random(seed)  # the hash seed's set order, random.sample
        self.np_rng = np.random.RandomState(seed)  # model_based's np.random
        self.gpus = landscape["world_size"]
        self.gpu_mem = landscape["memory_limit_bytes"]  # total_memory()
        base = self.plan.get("base_config", {})
        self.fp16 = bool(base.get("fp16", {}).get("enabled", False))
        self.gas = self.plan["gas"]
        self.metric = landscape.get("metric", "throughput")
        self.results: Dict[str, Tuple[Dict[str, Any], Optional[float]]] = {}  # experiment name -> (params, value or None)
        self.records: Dict[str, List[Tuple[Dict[str, Any], Optional[float]]]] = {}  # space name -> (params, value)
        self.last_finished: Optional[str] = None

    # ---- running experiments ------------------------------------------------------------------
    def params(self, stage: int, mbs: int, gas: int, knobs: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """An experiment's params; knobs not given are DeepSpeed's defaults (the first value if the space lacks it)."""
        p: Dict[str, Any] = {"stage": stage, "micro_batch": mbs, "gas": gas}
        for k, values in self.plan["knobs"].get(str(stage), {}).items():
            default = ZERO_DEFAULTS.get(k, stage == 3 if k == "overlap_comm" else None)
            p[k] = default if default in values else values[0]
        p.update(knobs or {})
        return p

    def run(self, name: str, params: Dict[str, Any]) -> Optional[float]:
        """run_ds_config: an experiment whose result folder exists is not run again, its result is reused."""
        if name not in self.results:
            status, metrics, _ = self.measure(params)
            self.results[name] = (params, float(metrics[self.metric]) if status == "ok" else None)
        self.last_finished = name
        return self.results[name][1]

    def record(self, space: str, params: Dict[str, Any], value: Optional[float]) -> None:
        self.records.setdefault(space, []).append((params, value))

    def best_record(self, space: str) -> Optional[Tuple[Dict[str, Any], float]]:
        best = None
        for params, value in self.records.get(space, []):
            if value is not None and (best is None or value > best[1]):
                best = (params, value)
        return best

    def declared(self) -> Optional[Dict[str, Any]]:
        """get_best_space_records: the global best over every space's best (a failure's 0 included)."""
        best = None
        for space in self.records:
            b = self.best_record(space)
            if b and (best is None or b[1] > best[1]):
                best = b
        return best[0] if best else None

    # ---- the algorithm --------------------------------------------------------------------------
    def tune(self) -> Optional[Dict[str, Any]]:
        info = self.model_info()
        if info is None:
            return None
        self.num_params, self.activation = info
        mbs = max_mbs = 0
        metric_val = 0.0
        for stage in range(4):
            if self.gpu_mem <= model_states(self.num_params, stage, self.gpus, self.fp16) + self.activation:
                if stage == 3:
                    break
                continue
            if stage not in self.plan["stages"]:
                continue
            try:
                next_max, next_mbs, next_val = self.tune_space(stage, max_mbs, mbs, metric_val)
            except Crash:
                continue
            if stage < 3 and next_mbs > mbs:
                mbs, max_mbs, metric_val = next_mbs, next_max, next_val
        return self.declared()

    def model_info(self) -> Optional[Tuple[float, float]]:
        status, metrics, _ = self.measure(self.params(3, 1, self.gas))
        if status != "ok":
            return None
        activation = metrics.get("activation_mem_per_gpu") or recorded_activation(self.land)
        return float(metrics["num_params"]), float(activation)

    def cap(self) -> int:
        mtbs = self.plan.get("max_train_batch_size")
        return min(MAX_MBS, mtbs // self.gpus) if mtbs else MAX_MBS

    def tune_space(self, stage: int, prev_max_mbs: int, prev_best_mbs: int, prev_best_metric: float) -> Tuple[int, int, float]:
        states = model_states(self.num_params, stage, self.gpus, self.fp16)
        calculated_max = int(self.gpu_mem - states) // max(1, int(self.activation))
        if calculated_max < prev_max_mbs:
            return 0, 0, 0.0
        rule = self.plan["micro_batch"]
        if rule["mode"] in ("list", "fixed"):  # a user list overrides the search
            candidates = sorted(int(m) for m in rule["values"])
            min_mbs, max_mbs, overwritten = candidates[0], candidates[-1], True
            per_gpu = max_mbs * self.gas
        else:
            min_mbs, max_mbs = self.min_max_micro_batch(stage, prev_max_mbs, calculated_max)
            if max_mbs < prev_max_mbs:
                return 0, 0, 0.0
            candidates, per_gpu = self.micro_batch_list(min_mbs, max_mbs)
            overwritten = False
        if not candidates:
            return 0, 0, 0.0
        candidates = self.run_micro_batches(candidates, per_gpu, min_mbs, stage, overwritten)
        fast = self.best_record(f"z{stage}")
        fast_val, fast_mbs = (fast[1], fast[0]["micro_batch"]) if fast else (0.0, 0)
        if self.plan["fast"] or stage == 0:
            return max_mbs, fast_mbs, fast_val
        if fast_mbs <= prev_best_mbs or fast_val < prev_best_metric:
            return max_mbs, fast_mbs, fast_val  # "No need to tune other Zero configuration parameters"
        best_params, best_val = self.run_tuner(stage, candidates, per_gpu)
        if best_params is not None:
            self.record(f"z{stage}_full", best_params, best_val)
        full = self.best_record(f"z{stage}_full")
        if full and full[1] > fast_val:
            return max_mbs, full[0]["micro_batch"], full[1]
        return max_mbs, fast_mbs, fast_val

    def min_max_micro_batch(self, stage: int, min_mbs: int, calculated_max: int) -> Tuple[int, int]:
        """get_min_max_micro_batch_size."""
        if min_mbs > calculated_max:
            return -1, -1
        space = f"z{stage}"
        used: List[int] = []

        def trial(mbs: int) -> Optional[float]:
            value = self.run(f"z{stage}_gas{self.gas}_tmbspg{mbs}", self.params(stage, mbs, self.gas))
            self.record(space, self.params(stage, mbs, self.gas), value if value else 0.0)
            return value

        if min_mbs < 1:
            mbs = int(self.plan["micro_batch"]["values"][0]) if self.plan["micro_batch"]["mode"] == "min" else 1
            if trial(mbs):
                used.append(mbs)
                min_mbs = mbs
            else:
                if mbs == MIN_MBS or not trial(MIN_MBS):
                    return -1, -1
                min_mbs = MIN_MBS
                used.append(MIN_MBS)
        else:
            if not trial(min_mbs):
                return -1, -1
            used.append(min_mbs)
        max_mbs = min(calculated_max, self.cap())
        for mbs in (math.ceil(1.05 * max_mbs), max_mbs, int(0.95 * max_mbs)):
            if mbs > self.cap():
                continue
            if mbs in used:
                return min_mbs, mbs
            if trial(mbs):
                return min_mbs, mbs
        records = self.records.get(space, [])
        prev = min(records, key=lambda r: abs(r[0]["micro_batch"] - min_mbs))[1] if records else None
        low, high = min_mbs, max_mbs
        while low <= high:
            mid = (low + high) // 2
            if mid in used:
                low = mid + 1
                continue
            value = trial(mid)
            if value:
                low = mid + 1
                used.append(mid)
                if prev and (value - prev) / prev < PLATEAU:
                    break  # "performance plateaus"
                prev = value
            else:
                high = mid - 1
        return min_mbs, low - 1

    def micro_batch_list(self, min_mbs: int, max_mbs: int) -> Tuple[List[int], int]:
        """get_tuning_micro_batch_size_list."""
        if min_mbs <= 0 or max_mbs <= 0:
            return [], 0
        mtbs = self.plan.get("max_train_batch_size")
        per_gpu = mtbs // self.gpus if mtbs else max_mbs * self.gas
        min_mbs = max(min_mbs, max_mbs // 2)
        stride = max(1, (max_mbs - min_mbs) // self.n_mbs)
        min_gas = per_gpu // max_mbs
        return [m for m in range(min_mbs, max_mbs, stride) if per_gpu // m != min_gas] + [max_mbs], per_gpu

    def run_micro_batches(self, candidates: List[int], per_gpu: int, min_mbs: int, stage: int, overwritten: bool) -> List[int]:
        """run_tuning_micro_batch_sizes."""
        candidates = sorted(candidates)
        max_mbs, space = candidates[-1], f"z{stage}"
        reused = [m for m in candidates if f"z{stage}_gas{per_gpu // m}_tmbspg{m}" in self.results]
        finished = reused + [m for m in candidates if m not in reused]  # reused results are "finished" when scheduled
        max_val = 0.0
        last_file: Optional[float] = None
        for mbs in finished:
            params = self.params(stage, mbs, per_gpu // mbs)
            value = self.run(f"z{stage}_gas{per_gpu // mbs}_tmbspg{mbs}", params)
            self.record(space, params, value if value is not None else 0.0)
            if mbs == max_mbs and value is not None:
                max_val = value
            last_file = value
        if overwritten:
            return candidates
        low = candidates[-2] + 1 if len(candidates) > 1 else min_mbs
        best_val, best_mbs = max_val, max_mbs
        for mbs in reversed(range(low, max_mbs, max(1, (max_mbs - low) // 3))):
            params = self.params(stage, mbs, per_gpu // mbs)
            if self.run(f"z{stage}_gas{per_gpu // mbs}_tmbspg{mbs}", params):
                if last_file is None:
                    raise Crash("the stale metrics file does not exist")
                value = last_file  # the metrics file read is the last one of the list above (a DeepSpeed bug)
                self.record(space, params, value)
                if value > best_val * (1 + PLATEAU):
                    best_val, best_mbs = value, mbs
                else:
                    break
            else:
                self.record(space, params, 0.0)
                break
        if best_mbs != max_mbs:
            candidates[-1] = best_mbs
        return candidates

    def run_tuner(self, stage: int, candidates: List[int], per_gpu: int) -> Tuple[Optional[Dict[str, Any]], Optional[float]]:
        """_generate_experiments + BaseTuner.tune for the stage's knob space."""
        knobs = self.plan["knobs"].get(str(stage), {})
        exps = [self.params(stage, mbs, per_gpu // mbs, dict(zip(knobs, combo))) for combo in itertools.product(*knobs.values()) for mbs in candidates]
        unique = sorted({json.dumps(e, sort_keys=True) for e in exps})
        self.rng.shuffle(unique)  # remove_dupe_dicts: a set, so the order follows the hash seed
        exps = [json.loads(s) for s in unique]
        picker = ModelBased(exps, self.np_rng) if self.tuner_type == "model_based" else Ordered(exps, self.rng if self.tuner_type == "random" else None)
        best_params, best_val, best_iter, i = None, None, 0, 0
        while i < self.num_trials and picker.has_next():
            params = picker.next()
            value = self.run("tuner:" + json.dumps(params, sort_keys=True), params)
            if best_params is None or best_val is None or (value and value > best_val):
                best_params, best_val, best_iter = params, value, i
            i += 1
            picker.update(params, value)
            if i >= best_iter + self.early_stopping:
                break
        return best_params, best_val


class Ordered:
    """GridSearchTuner (in order) and RandomTuner (random.sample)."""

    def __init__(self, exps: List[Dict[str, Any]], rng: Optional[random.Random]):
        self.exps, self.rng = list(exps), rng

    def has_next(self) -> bool:
        return bool(self.exps)

    def next(self) -> Dict[str, Any]:
        return self.exps.pop(self.rng.randrange(len(self.exps)) if self.rng else 0)

    def update(self, params, value) -> None:
        pass


class ModelBased:
    """ModelBasedTuner: INIT_NUM = 2 visited at start (config 0 and a random one), the random one
    is run first; then the XGBoost ranking, refit after every experiment, failures as 0."""

    def __init__(self, exps: List[Dict[str, Any]], rng: np.random.RandomState):
        self.exps, self.rng = exps, rng
        n = len(exps)
        self.visited, self.trials, self.pt = set(), [], 0
        for _ in range(min(2, n)):
            feature = 0
            while feature in self.visited:
                feature = int(rng.randint(n))
            self.trials.append(feature)
            self.visited.add(feature)
        self.xs: List[List[float]] = []
        self.ys: List[float] = []

    def has_next(self) -> bool:
        return len(self.visited) < len(self.exps)

    def next(self) -> Dict[str, Any]:
        index = None
        while self.pt < len(self.trials):
            index = self.trials[self.pt]
            if index not in self.visited:
                break
            self.pt += 1
        if self.rng.rand() < 0.2:  # "random exploration": only acts while index is already visited
            while index in self.visited:
                index = int(self.rng.randint(len(self.exps)))
        self.visited.add(index)
        return self.exps[index]

    def update(self, params: Dict[str, Any], value: Optional[float]) -> None:
        import xgboost as xgb

        self.xs.append(features(params))
        self.ys.append(value or 0.0)
        y = np.array(self.ys, dtype=np.float32)
        y = y / max(float(y.max()), 1e-9)
        order = self.rng.permutation(len(self.xs))
        booster = xgb.train(XGB_PARAMS, xgb.DMatrix(np.array(self.xs, dtype=np.float32)[order], y[order]))
        estimates = booster.predict(xgb.DMatrix(np.array([features(e) for e in self.exps], dtype=np.float32)))
        self.trials = [int(i) for i in np.argsort(estimates)[::-1]]
        self.pt = 0


def features(params: Dict[str, Any]) -> List[float]:
    """Every numeric leaf, raw (booleans as 0/1), plus train_batch_size (its flattened ds_config)."""
    return [float(v) for _, v in sorted(params.items())] + [float(params["micro_batch"] * params["gas"])]


def recorded_activation(landscape: Dict[str, Any]) -> float:
    """Recorded CPU landscapes carry no forward delta: the stage-3 per-sample slope of the recorded peak
    between its two smallest micro-batches stands in for it (DeepSpeed on CPU would read the RSS)."""
    pts = sorted((p for p in landscape["points"] if p["status"] == "ok" and p["params"]["stage"] == 3), key=lambda p: p["params"]["micro_batch"])
    a = pts[0]
    b = next(p for p in pts if p["params"]["micro_batch"] > a["params"]["micro_batch"] and
             {k: v for k, v in p["params"].items() if k != "micro_batch"} == {k: v for k, v in a["params"].items() if k != "micro_batch"})
    return (b["metrics"]["peak_memory_bytes"] - a["metrics"]["peak_memory_bytes"]) / (b["params"]["micro_batch"] - a["params"]["micro_batch"])


def run(measure: Callable, landscape: Dict[str, Any], seed: int = 0, tuner_type: str = "model_based", early_stopping: int = 5,
        num_trials: int = 50, num_tuning_micro_batch_sizes: int = 3) -> Optional[Dict[str, Any]]:
    return DeepSpeedAutotuner(measure, landscape, seed, tuner_type, early_stopping, num_trials, num_tuning_micro_batch_sizes).tune()
