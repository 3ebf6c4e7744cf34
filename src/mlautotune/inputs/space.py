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
    max: int = 1024  # autotuning.max_train_micro_batch_size_per_gpu: no candidate above it


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
    arg_mappings: Dict[str, str] = field(default_factory=dict)  # the user's, plus the HF Trainer's flags for "auto" batch keys
    hf_trainer: bool = False  # a Hugging Face Trainer script: it resolves the ds_config's other "auto" values itself
    data_parallel: int = 1  # data-parallel ranks (world size / mp_size)
    # Memory savers the search may switch on (search/savers.py): activation checkpointing through the
    # script's flag (arg_mappings["activation_checkpointing"]), and ZeRO-Offload to this device ("cpu",
    # or "nvme" where the user's ds_config names an nvme_path); None: not tuned.
    checkpointing: bool = False
    offload_device: Optional[str] = None
    nvme_path: Optional[str] = None

    def gas_for(self, mbs: int) -> int:
        """An experiment's gradient accumulation. With max_train_batch_size, as DeepSpeed's autotuner:
        the most steps that keep the global batch within it, so gradient accumulation is tuned with
        the micro-batch (z0_gas2_tmbspg15 for 30 on one rank); else the user's."""
        if self.max_train_batch_size:
            return max(1, self.max_train_batch_size // (int(mbs) * self.data_parallel))
        return self.gas

    def fills_batch(self, mbs: int) -> bool:
        """With max_train_batch_size, whether mbs is the largest micro-batch at its gradient accumulation
        (64, 32, 21, 16, ... on one rank for 64). A smaller one at the same accumulation runs as many
        steps on fewer samples, so the search measures it only at a memory edge (constrained.py).
        Without it, every size."""
        return not self.max_train_batch_size or mbs == self.micro_batch_cap or self.gas_for(mbs + 1) < self.gas_for(mbs)

    @property
    def micro_batch_cap(self) -> int:
        """The largest micro-batch allowed: max_train_micro_batch_size_per_gpu, and with max_train_batch_size
        the micro-batch that fills it at gradient accumulation 1 (gas_for)."""
        if self.max_train_batch_size:
            return min(self.micro_batch_max, max(1, self.max_train_batch_size // self.data_parallel))
        return self.micro_batch_max

    @property
    def micro_batch_max(self) -> int:
        """autotuning.max_train_micro_batch_size_per_gpu (DeepSpeed's default 1024): the search stays at or below it."""
        return self.micro_batch.max


# ---- building the plan -----------------------------------------------------------------------
HF_MAPPINGS = {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size", "gradient_accumulation_steps": "--gradient_accumulation_steps"}
CHECKPOINTING_KEY = "activation_checkpointing"  # arg_mappings key of the script's activation checkpointing flag
HF_CHECKPOINTING_FLAG = "--gradient_checkpointing"
OFFLOAD_KEYS = ("offload_optimizer", "offload_param")
BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
UNUSED_KEYS = {
    "metric_path": "mlautotune's probe writes each experiment's metrics.json itself",
    "model_info": "mlautotune measures the parameter count and memory in its first experiments",
    "model_info_path": "mlautotune measures the parameter count and memory in its first experiments",
}
# DeepSpeed's step-search settings, accepted with their DeepSpeed meaning and default; the search has
# its own stop rule and ladder (docs/search.md), so a value other than the default gets a notice.
NOT_READ_BY_SEARCH = {
    "tuner_early_stopping": (5, "the search ends by its own stop rule, search.stop_probability (docs/search.md)"),
    "num_tuning_micro_batch_sizes": (3, "the search chooses among every allowed micro-batch size (docs/search.md)"),
}
TUNED_TOP_LEVEL = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "autotuning", "arg_mappings")
KNOB_CODES = {
    "reduce_bucket_size": "rbs", "allgather_bucket_size": "agbs", "overlap_comm": "oc", "reduce_scatter": "rs",
    "contiguous_gradients": "cg", "stage3_prefetch_bucket_size": "pfbs", "stage3_param_persistence_threshold": "ppt",
    "stage3_max_live_parameters": "mlp", "stage3_max_reuse_distance": "mrd", "allgather_partitions": "agp",
    "round_robin_gradients": "rrg", "sub_group_size": "sgs",
    "activation_checkpointing": "ac", "offload_optimizer": "oo", "offload_param": "op",
}


def build_plan(ds_config: Dict[str, Any], at: Any, space: Any, script_args: List[str], world_size: int, hf_trainer: bool = False) -> TuningPlan:
    """The README's tuning-scope rules turned into plain data for the search."""
    notices = [f"autotuning.{k} is accepted but not used: {why}." for k, why in UNUSED_KEYS.items() if at.get(k) is not None]
    notices += [f"autotuning.{k}={at.get(k)} is accepted but not used: {why}." for k, (default, why) in NOT_READ_BY_SEARCH.items()
                if at.get(k, default) != default]
    mappings = {k.strip(): v.strip() for k, v in dict(at.arg_mappings or {}).items()}
    if hf_trainer or any(ds_config.get(k) == "auto" for k in BATCH_KEYS):
        added = {k: v for k, v in HF_MAPPINGS.items() if k not in mappings}
        mappings = {**HF_MAPPINGS, **mappings}  # the Trainer's (and the bundled workload's) own flags
        if added and not hf_trainer:
            notices.append("the ds_config uses \"auto\": " + ", ".join(f"{k} is passed as {v}" for k, v in added.items()) + " (the HF Trainer's flags); set autotuning.arg_mappings if the script uses other flags.")
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
            if not values:
                raise UserError(f"zero_optimization.{k} is an empty list.", f"Give {k} a value, or a list of at least one.")
            for x in values:
                if isinstance(x, bool) or isinstance(x, (int, float)) or (x == "auto" and hf_trainer):
                    continue
                if x == "auto":
                    raise UserError(f'zero_optimization.{k} is "auto", which only the Hugging Face Trainer fills in (this script does not use it).', f"Give {k} a number, or leave it out for DeepSpeed's default.")
                raise UserError(f"zero_optimization.{k} has the value {x!r}, which is not a number or true/false.", f"Give {k} a number, a boolean, or a list of them.")
            knobs[s][k] = [_as_int(x) for x in values]
    fixed_zero = {k: v for k, v in zero.items() if isinstance(v, dict)}  # offload sections etc., carried unchanged
    tuned = {*BATCH_KEYS, "stage", CHECKPOINTING_KEY, *(k for s in knobs for k in knobs[s])}
    for key in dict(at.arg_mappings or {}):
        if key.strip() not in tuned:
            raise UserError(f"arg_mappings maps {key!r}, which is not a key this session tunes, so its flag would never be set.",
                            f"Map a tuned key ({', '.join(sorted(tuned))}) to the script's flag, or drop the entry.")
    for s in stages:
        check_zero_config(s, knobs[s], fixed_zero)
    gas = _gas(ds_config.get("gradient_accumulation_steps"), mappings, script_args)
    mp = int(at.mp_size)
    dp = max(1, world_size // mp)
    micro_batch = _micro_batch(ds_config.get("train_micro_batch_size_per_gpu"), mappings, script_args, notices)
    micro_batch = _bounded(micro_batch, at, gas * dp, notices)
    if "train_batch_size" in ds_config:
        notices.append("train_batch_size is ignored while tuning: it follows from micro-batch x gradient accumulation x GPUs (README).")
    smallest = min(micro_batch.values) * dp
    if at.max_train_batch_size is not None and at.max_train_batch_size < smallest:
        raise UserError(
            f"autotuning.max_train_batch_size={at.max_train_batch_size} is smaller than the smallest possible batch {smallest} (micro-batch {min(micro_batch.values)} x gradient accumulation 1 x {dp} data-parallel ranks).",
            f"Raise max_train_batch_size to at least {smallest}, or lower the micro-batch.",
        )
    if at.max_train_batch_size is not None:
        notices.append(f"gradient accumulation is tuned with the micro-batch: each experiment accumulates max_train_batch_size // (micro-batch x {dp} data-parallel ranks) steps, as DeepSpeed's autotuner does"
                       + (f" (gradient_accumulation_steps {gas} is not used while tuning)" if gas != 1 else "")
                       + "; only each accumulation's largest micro-batch is measured (and the largest that fits).")
    base = {k: v for k, v in ds_config.items() if k not in TUNED_TOP_LEVEL}
    base["zero_optimization"] = fixed_zero
    if hf_trainer and CHECKPOINTING_KEY not in mappings:
        mappings[CHECKPOINTING_KEY] = HF_CHECKPOINTING_FLAG
    checkpointing = _checkpointing_tuned(mappings, script_args, notices)
    offload_device, nvme_path = _offload_device(fixed_zero)
    return TuningPlan(stages, knobs, micro_batch, gas, at.max_train_batch_size, mp, bool(at.fast), base, notices, mappings, hf_trainer, dp,
                      checkpointing, offload_device, nvme_path)


def _checkpointing_tuned(mappings: Dict[str, str], script_args: List[str], notices: List[str]) -> bool:
    """Activation checkpointing is tuned where a flag is mapped to it and the script's arguments do not set it already."""
    flag = mappings.get(CHECKPOINTING_KEY)
    if flag is None:
        return False
    if any(a == flag or a.startswith(flag + "=") for a in script_args):
        notices.append(f"activation checkpointing is not tuned: the script arguments set {flag} already.")
        return False
    return True


def _offload_device(zero_sections: Dict[str, Any]) -> Tuple[Optional[str], Optional[str]]:
    """Where the search may offload to: none where the user's ds_config offloads already (then it is
    the user's), NVMe where one of its offload sections names an nvme_path, else the CPU."""
    sections = [zero_sections.get(k) or {} for k in OFFLOAD_KEYS]
    if any(str(sec.get("device", "none")).lower() != "none" for sec in sections):
        return None, None
    nvme = next((str(sec["nvme_path"]) for sec in sections if sec.get("nvme_path")), None)
    return ("nvme", nvme) if nvme else ("cpu", None)


def _bounded(rule: MicroBatchRule, at: Any, per_micro_batch: int, notices: List[str]) -> MicroBatchRule:
    """DeepSpeed's bounds: min/max_train_micro_batch_size_per_gpu, and min_train_batch_size (micro-batch x gas x data-parallel ranks)."""
    low = max(int(at.min_train_micro_batch_size_per_gpu), -(-int(at.min_train_batch_size) // per_micro_batch))
    high = int(at.max_train_micro_batch_size_per_gpu)
    bounds = f"[{low}, {high}] (autotuning.min/max_train_micro_batch_size_per_gpu, min_train_batch_size)"
    if low > high:
        raise UserError(f"No micro-batch size fits the bounds {bounds}.", "Lower min_train_batch_size or min_train_micro_batch_size_per_gpu, or raise max_train_micro_batch_size_per_gpu.")
    if rule.mode == "min":
        start = max(rule.values[0], low)
        if start > high:
            raise UserError(f"The smallest micro-batch to tune, {rule.values[0]}, is above autotuning.max_train_micro_batch_size_per_gpu={high}.", "Lower train_micro_batch_size_per_gpu, or raise max_train_micro_batch_size_per_gpu.")
        return MicroBatchRule("min", (start,), high)
    kept = tuple(m for m in rule.values if low <= m <= high)
    if not kept:
        raise UserError(f"None of the micro-batch sizes {list(rule.values)} is within {bounds}.", "Change the list or the bounds.")
    if len(kept) < len(rule.values):
        notices.append(f"micro-batch sizes outside {bounds} are left out: {sorted(set(rule.values) - set(kept))}.")
    return MicroBatchRule(rule.mode, kept, high)


def check_zero_config(stage: int, knobs: Dict[str, List[Any]], sections: Dict[str, Any]) -> None:
    """Every knob value against DeepSpeed's own zero_optimization model (it forbids unknown keys), as each experiment will be."""
    import pydantic
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    first = {k: v[0] for k, v in knobs.items() if v[0] != "auto"}
    variants = [first] + [{**first, k: x} for k, values in knobs.items() for x in values[1:] if x != "auto"]
    for variant in variants:
        try:
            DeepSpeedZeroConfig(**{**variant, **sections, "stage": stage})
        except pydantic.ValidationError as e:
            err = e.errors()[0]
            key = ".".join(str(p) for p in err["loc"]) or "?"
            if err["type"] == "extra_forbidden":
                raise UserError(f"zero_optimization.{key} is not a DeepSpeed ZeRO setting; DeepSpeed would refuse every experiment.", "Check its spelling against DeepSpeed's zero_optimization documentation (e.g. reduce_bucket_size, overlap_comm, contiguous_gradients).")
            raise UserError(f"zero_optimization.{key}={err.get('input')!r} is refused by DeepSpeed at stage {stage}: {err['msg']}.", f"Give {key} a value DeepSpeed accepts.")


def _stages(ds_config, zero, notices):
    if "stage" not in zero:
        notices.append('Only ZeRO stage 0 is explored: the ds_config sets no zero_optimization "stage". Add "zero_optimization": {"stage": "all"} to explore stages 0-3.')
        return [0]
    stage = zero["stage"]
    if stage == "all":
        return [0, 1, 2, 3]
    values = stage if isinstance(stage, list) else [stage]
    if not values:
        raise UserError("zero_optimization.stage is an empty list.", 'Use 0, 1, 2 or 3, a list of them, or "all".')
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
    from mlautotune.inputs.scriptargs import get_flag

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
    knobs = {k: v for k, v in knobs.items() if k != CHECKPOINTING_KEY}  # a script flag (experiment_args), not a ds_config key
    for key in OFFLOAD_KEYS:
        if knobs.pop(key, False):
            section = {**dict(zero.get(key) or {}), "device": plan.offload_device, "pin_memory": True}
            zero[key] = {**section, "nvme_path": plan.nvme_path} if plan.offload_device == "nvme" else section
    zero.update({k: _as_int(v) for k, v in knobs.items()})
    cfg["zero_optimization"] = zero
    cfg["train_micro_batch_size_per_gpu"] = int(mbs)
    cfg["gradient_accumulation_steps"] = plan.gas_for(mbs)
    return cfg


def plan_text(plan: TuningPlan) -> str:
    rule = {"min": f"from {plan.micro_batch.values[0]} up to the largest that fits", "list": f"exactly {list(plan.micro_batch.values)}", "fixed": f"fixed at {plan.micro_batch.values[0]}"}[plan.micro_batch.mode]
    lines = [
        f"stages: {plan.stages}  ({'fast mode: stage and micro-batch only' if plan.fast else 'full mode: ZeRO knobs too'})",
        f"micro-batch per GPU: {rule} (at most {plan.micro_batch_max}{f', and max_train_batch_size // {plan.data_parallel} data-parallel ranks' if plan.max_train_batch_size else ''})",
        f"gradient accumulation: {'max_train_batch_size // (micro-batch x data-parallel ranks)' if plan.max_train_batch_size else plan.gas}",
        f"max_train_batch_size: {plan.max_train_batch_size}   mp_size: {plan.mp_size}",
    ]
    for s in plan.stages:
        tuned = tuned_knobs(plan, s)
        combos = knob_combos(plan, s)
        lines.append(f"z{s}: {len(combos)} knob combination(s) per micro-batch" + ("; tuned: " + ", ".join(f"{k} {v}" for k, v in tuned.items()) if tuned else ""))
    savers = ([f"activation checkpointing ({plan.arg_mappings[CHECKPOINTING_KEY]})"] if plan.checkpointing else []) + (
        [f"ZeRO-Offload to {plan.offload_device} (offload_optimizer at stages 1-3, offload_param at stage 3)"] if plan.offload_device else [])
    if savers:
        lines.append("memory savers, tried only where the memory model says they let a larger micro-batch fit: " + "; ".join(savers))
    return "\n".join(lines)
