"""The tuning plan: which stages, micro-batch sizes, gradient accumulation and ZeRO knob values to explore."""

import copy
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from mlautotune.errors import UserError
from mlautotune.files import safe_name


@dataclass(frozen=True)
class MicroBatchRule:
    """How micro-batch sizes per GPU are chosen (README, "Configuring Train Micro-Batch Size").

    mode "min": values == (m,), tune upwards from m.   mode "list": values are the exact candidates.
    mode "fixed": values == (m,), m only.
    """

    mode: str
    values: Tuple[int, ...]


@dataclass
class TuningPlan:
    stages: List[int]
    # Per stage: zero_optimization knob -> candidate values, in the order to explore. A knob the
    # user fixed has a one-value list. "stage" itself is not a knob here.
    knobs: Dict[int, Dict[str, List[Any]]]
    micro_batch: MicroBatchRule
    gas: int
    max_train_batch_size: Optional[int]
    mp_size: int
    fast: bool
    base_config: Dict[str, Any]  # the user's ds_config: autotuning removed, "auto" resolved, tuned keys removed
    notices: List[str] = field(default_factory=list)  # one-line notices for the user (ignored keys, hints)


# ---- building the plan -----------------------------------------------------------------------
TUNED_TOP_LEVEL = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "autotuning", "arg_mappings")
KNOB_CODES = {
    "reduce_bucket_size": "rbs", "allgather_bucket_size": "agbs", "overlap_comm": "oc", "reduce_scatter": "rs",
    "contiguous_gradients": "cg", "stage3_prefetch_bucket_size": "pfbs", "stage3_param_persistence_threshold": "ppt",
    "stage3_max_live_parameters": "mlp", "stage3_max_reuse_distance": "mrd", "allgather_partitions": "agp",
    "round_robin_gradients": "rrg", "sub_group_size": "sgs",
}


def build_plan(ds_config: Dict[str, Any], at: Any, space: Any, script_args: List[str], world_size: int) -> TuningPlan:
    """The README's tuning-scope rules turned into plain data for the search."""
    notices: List[str] = []
    mappings = {k.strip(): v for k, v in dict(at.arg_mappings or {}).items()}
    zero = ds_config.get("zero_optimization")
    zero = dict(zero) if isinstance(zero, dict) else {}
    stages = _stages(ds_config, zero, notices)
    defaults = {s: {k: list(v) for k, v in dict(space[f"zero{s}"] or {}).items()} for s in stages}
    user_knobs = {k: v for k, v in zero.items() if k != "stage" and not isinstance(v, dict)}
    knobs: Dict[int, Dict[str, List[Any]]] = {}
    for s in stages:
        knobs[s] = dict(defaults[s])
        for k, v in user_knobs.items():
            values = v if isinstance(v, list) else [v]
            for x in values:
                if isinstance(x, bool) or isinstance(x, (int, float)):
                    continue
                raise UserError(f"zero_optimization.{k} has the value {x!r}, which is not a number or true/false.", f"Give {k} a number, a boolean, or a list of them.")
            knobs[s][k] = [_as_int(x) for x in values]
    micro_batch = _micro_batch(ds_config.get("train_micro_batch_size_per_gpu"), mappings, script_args, notices)
    gas = _gas(ds_config.get("gradient_accumulation_steps"), mappings, script_args)
    if "train_batch_size" in ds_config:
        notices.append("train_batch_size is ignored while tuning: it follows from micro-batch x gradient accumulation x GPUs (README).")
    mp = int(at.mp_size)
    smallest = min(micro_batch.values) * gas * max(1, world_size // mp)
    if at.max_train_batch_size is not None and at.max_train_batch_size < smallest:
        raise UserError(
            f"autotuning.max_train_batch_size={at.max_train_batch_size} is smaller than the smallest possible batch {smallest} (micro-batch {min(micro_batch.values)} x gradient accumulation {gas} x {world_size // mp} data-parallel ranks).",
            f"Raise max_train_batch_size to at least {smallest}, or lower the micro-batch.",
        )
    base = {k: v for k, v in ds_config.items() if k not in TUNED_TOP_LEVEL}
    fixed_zero = {k: v for k, v in zero.items() if isinstance(v, dict)}  # offload sections etc., carried unchanged
    base["zero_optimization"] = fixed_zero
    return TuningPlan(stages, knobs, micro_batch, gas, at.max_train_batch_size, mp, bool(at.fast), base, notices)


def _stages(ds_config, zero, notices):
    if "stage" not in zero:
        notices.append('Only ZeRO stage 0 is explored: the ds_config sets no zero_optimization "stage". Add "zero_optimization": {"stage": "all"} to explore stages 0-3.')
        return [0]
    stage = zero["stage"]
    if stage == "all":
        return [0, 1, 2, 3]
    values = stage if isinstance(stage, list) else [stage]
    for s in values:
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= 3:
            raise UserError(f"zero_optimization.stage={stage!r} is not a ZeRO stage.", 'Use 0, 1, 2 or 3, a list of them, or "all".')
    return sorted(set(values))


def _positive_int(value, what: str) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{what} has the value {value!r}, which is not a positive integer.", f"Give {what} a positive integer, a list of them, or \"auto\".")
    return value


def _from_flag(key, mappings, script_args, notices):
    from mlautotune.scriptargs import get_flag

    flag = mappings.get(key)
    if flag is None:
        raise UserError(f'{key} is "auto", but arg_mappings does not map it to a flag of the script.', f'Add "arg_mappings": {{"{key}": "--your_flag"}} to the autotuning section, or give {key} a number.')
    value = get_flag(script_args, flag)
    if value is None:
        notices.append(f'{key} is "auto" and the script arguments have no {flag}: using 1.')
        return 1
    try:
        return _positive_int(int(value), f"{flag} (mapped from {key})")
    except ValueError:
        raise UserError(f"The script argument {flag} {value!r} is not an integer.", f"Pass {flag} <positive integer>.")


def _micro_batch(value, mappings, script_args, notices) -> MicroBatchRule:
    key = "train_micro_batch_size_per_gpu"
    if value is None:
        return MicroBatchRule("min", (1,))
    if value == "auto":
        return MicroBatchRule("min", (_from_flag(key, mappings, script_args, notices),))
    if isinstance(value, list):
        if not value:
            raise UserError(f"{key} is an empty list.", "Give at least one micro-batch size.")
        sizes = tuple(sorted({_positive_int(v, key) for v in value}))
        return MicroBatchRule("fixed" if len(value) == 1 else "list", sizes)
    return MicroBatchRule("min", (_positive_int(value, key),))


def _gas(value, mappings, script_args) -> int:
    key = "gradient_accumulation_steps"
    if value is None:
        return 1
    if isinstance(value, list):
        raise UserError(f"{key} is a list ({value}); tuning gradient accumulation over a list is not supported (README).", f"Give {key} one number, or \"auto\".")
    if value == "auto":
        return _from_flag(key, mappings, script_args, [])
    return _positive_int(value, key)


def _as_int(x):
    return int(x) if isinstance(x, float) and x.is_integer() else x


def tuned_knobs(plan: TuningPlan, stage: int) -> Dict[str, List[Any]]:
    """The knobs that vary in this stage (none in fast mode), names sorted."""
    if plan.fast:
        return {}
    return {k: list(v) for k, v in sorted(plan.knobs[stage].items()) if len(v) > 1}


def fixed_knobs(plan: TuningPlan, stage: int) -> Dict[str, Any]:
    """Knobs with one value: the user's fixed settings (and, in fast mode, the user's only)."""
    return {k: v[0] for k, v in plan.knobs[stage].items() if len(v) == 1}


def knob_combos(plan: TuningPlan, stage: int) -> List[Dict[str, Any]]:
    combos: List[Dict[str, Any]] = [{}]
    for k, values in tuned_knobs(plan, stage).items():
        combos = [{**c, k: v} for c in combos for v in values]
    return combos


def _code_value(v: Any) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, (int, float)) and abs(v) >= 1e4:
        mantissa, exp = f"{float(v):e}".split("e")
        return f"{float(mantissa):g}e{int(exp)}"
    return f"{v:g}" if isinstance(v, float) else str(v)


def experiment_name(stage: int, gas: int, mbs: int, knobs: Dict[str, Any]) -> str:
    name = f"z{stage}_gas{gas}_tmbspg{mbs}"
    for k in sorted(knobs):
        code = KNOB_CODES.get(k) or "".join(part[0] for part in k.split("_") if part)
        name += f"_{code}{_code_value(knobs[k])}"
    return safe_name(name)  # a folder name: only [A-Za-z0-9._-], whatever the user's key names


def experiment_config(plan: TuningPlan, stage: int, mbs: int, knobs: Dict[str, Any]) -> Dict[str, Any]:
    cfg = copy.deepcopy(plan.base_config)
    zero = dict(cfg.get("zero_optimization") or {})
    zero["stage"] = stage
    zero.update(fixed_knobs(plan, stage) if stage in plan.knobs else {})
    zero.update({k: _as_int(v) for k, v in knobs.items()})
    cfg["zero_optimization"] = zero
    cfg["train_micro_batch_size_per_gpu"] = int(mbs)
    cfg["gradient_accumulation_steps"] = int(plan.gas)
    return cfg


def plan_text(plan: TuningPlan) -> str:
    rule = {"min": f"from {plan.micro_batch.values[0]} up to the largest that fits", "list": f"exactly {list(plan.micro_batch.values)}", "fixed": f"fixed at {plan.micro_batch.values[0]}"}[plan.micro_batch.mode]
    lines = [
        f"stages: {plan.stages}  ({'fast mode: stage and micro-batch only' if plan.fast else 'full mode: ZeRO knobs too'})",
        f"micro-batch per GPU: {rule}",
        f"gradient accumulation: {plan.gas}",
        f"max_train_batch_size: {plan.max_train_batch_size}   mp_size: {plan.mp_size}",
    ]
    names = []
    for s in plan.stages:
        tuned = tuned_knobs(plan, s)
        combos = knob_combos(plan, s)
        lines.append(f"z{s}: {len(combos)} knob combination(s) per micro-batch" + ("; tuned: " + ", ".join(f"{k} {v}" for k, v in tuned.items()) if tuned else ""))
        names += [experiment_name(s, plan.gas, m, c) for m in plan.micro_batch.values for c in combos[:3]]
    lines.append("first experiments: " + ", ".join(names[:5]))
    return "\n".join(lines)
