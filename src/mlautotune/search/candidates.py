"""What can be run: a stage's configurations at DeepSpeed's defaults, its knob combinations, the
micro-batch bounds, and the Optuna distributions every trial's plain params are recorded under."""

import functools
import json
from typing import Any, Dict, List, Optional, Tuple

from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution

from mlautotune.inputs.space import TuningPlan, knob_combos, tuned_knobs

MAX_SIZE = 1 << 16  # micro-batch and gradient accumulation distributions: 1 .. 65536, log scale


def params_key(params: Dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True, default=str)


def base_params(plan: TuningPlan, stage: int, mbs: int) -> Dict[str, Any]:
    """Params of a micro-batch experiment: the stage's tuned knobs at DeepSpeed's defaults (or the first value)."""
    return with_knobs(plan, stage, mbs, base_knobs(plan, stage))


def base_knobs(plan: TuningPlan, stage: int) -> Dict[str, Any]:
    defaults = deepspeed_zero_defaults(stage)
    return {k: defaults[k] if defaults.get(k) in values else values[0] for k, values in tuned_knobs(plan, stage).items()}


def with_knobs(plan: TuningPlan, stage: int, mbs: int, knobs: Dict[str, Any]) -> Dict[str, Any]:
    return {"stage": stage, "micro_batch": int(mbs), "gas": plan.gas_for(mbs), **knobs}


def stage_knob_combos(plan: TuningPlan, stage: int) -> List[Dict[str, Any]]:
    """Every knob combination of the stage, DeepSpeed's defaults first."""
    base = base_knobs(plan, stage)
    combos = knob_combos(plan, stage)
    return [base] + [c for c in combos if c != base]


def knobs_of_params(params: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in params.items() if k not in ("stage", "micro_batch", "gas")}


def distributions(plan: TuningPlan) -> Dict[str, BaseDistribution]:
    """One distribution per plain param name for the whole study, so trials of every stage share
    them (Optuna refuses a name whose distribution changes): stage and sizes as integers, each knob
    as a categorical over its values in all of the plan's stages."""
    # A param that has one value in the session (gas without max_train_batch_size, a single stage) is
    # not searched: its distribution holds that value only, and Optuna's importances rate it 0.
    gas = (1, MAX_SIZE) if plan.max_train_batch_size else (plan.gas, plan.gas)
    dists: Dict[str, BaseDistribution] = {
        "stage": IntDistribution(min(plan.stages), max(plan.stages)),
        "micro_batch": IntDistribution(1, MAX_SIZE, log=True),
        "gas": IntDistribution(*gas, log=True),
    }
    choices: Dict[str, List[Any]] = {}
    for stage in plan.stages:
        for knob, values in (plan.knobs.get(stage) or {}).items():
            for v in values:
                if not any(v == c and type(v) is type(c) for c in choices.setdefault(knob, [])):
                    choices[knob].append(v)
    for knob, values in choices.items():
        dists[knob] = CategoricalDistribution(sorted(values, key=lambda v: (type(v).__name__, v)))
    saver_keys = (["activation_checkpointing"] if plan.checkpointing else []) + (["offload_optimizer", "offload_param"] if plan.offload_device else [])
    dists.update({k: CategoricalDistribution([False, True]) for k in saver_keys})  # memory savers (savers.py): switches
    return dists


def product(space: Dict[str, List[Any]]) -> List[Dict[str, Any]]:
    combos: List[Dict[str, Any]] = [{}]
    for k, values in space.items():
        combos = [{**c, k: v} for c in combos for v in values]
    return combos


@functools.lru_cache(maxsize=None)
def deepspeed_zero_defaults(stage: int) -> Dict[str, Any]:
    """DeepSpeed's own default for every zero_optimization knob at this stage (from its config model)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return DeepSpeedZeroConfig(stage=stage).model_dump(by_alias=True)


def given_params(plan: TuningPlan, ds_config: Dict[str, Any]) -> Tuple[Optional[Dict[str, Any]], str]:
    """The user's starting configuration, the ds_config as given, under the params the search records
    (params, ""), or (None, why the ds_config is no single configuration). Its stage, micro-batch and
    gradient accumulation are the user's; a knob the user leaves out is at DeepSpeed's default."""
    zero = ds_config.get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if isinstance(stage, list) and len(stage) == 1:
        stage = stage[0]
    if not isinstance(stage, int) or isinstance(stage, bool):
        return None, f"the ds_config names the stages {json.dumps(stage)}, not one"
    mbs = given_micro_batch(plan, ds_config)
    if mbs is None:
        return None, f"the ds_config lists the micro-batch sizes {ds_config.get('train_micro_batch_size_per_gpu')}, not one"
    knobs, defaults = {}, deepspeed_zero_defaults(stage)
    user = zero if isinstance(zero, dict) else {}
    for knob in tuned_knobs(plan, stage):
        value = user.get(knob, defaults.get(knob))
        if isinstance(value, list):
            return None, f"the ds_config lists several values of zero_optimization.{knob}, not one"
        knobs[knob] = value
    return {"stage": stage, "micro_batch": int(mbs), "gas": plan.gas, **knobs}, ""


def given_micro_batch(plan: TuningPlan, ds_config: Dict[str, Any]) -> Optional[int]:
    """The ds_config's micro-batch size when it gives one ("auto": the script's flag, as the plan read
    it; none: 1, the smallest), None when it lists several."""
    mbs = ds_config.get("train_micro_batch_size_per_gpu")
    if isinstance(mbs, list):
        return int(mbs[0]) if len(mbs) == 1 else None
    return int(plan.micro_batch.values[0]) if mbs is None or mbs == "auto" else int(mbs)


def given_batch(plan: TuningPlan, ds_config: Dict[str, Any]) -> Optional[int]:
    """The ds_config's samples per optimizer step (micro-batch x gradient accumulation x data-parallel
    ranks), when it gives one micro-batch size."""
    mbs = given_micro_batch(plan, ds_config)
    return mbs * plan.gas * plan.data_parallel if mbs is not None else None
