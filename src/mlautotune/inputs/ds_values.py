"""The ds_config's own values (outside the autotuning section), read as DeepSpeed reads them.

DeepSpeed reads most top-level keys with `get_scalar_param`, which takes a value as it is: the
string "false" is true, "16" is not a number, and a `zero_optimization` that is not an object is
an error inside every experiment. Those are refused before any experiment runs."""

import json
from typing import Any, Dict

from mlautotune.errors import UserError

BOOL, INT, NUMBER = "true or false (a JSON boolean)", "a whole number", "a number"
# key -> what DeepSpeed means by it (deepspeed/runtime/config.py, fp16/bf16 sections)
TOP_LEVEL = {"train_batch_size": INT, "train_micro_batch_size_per_gpu": INT, "gradient_accumulation_steps": INT, "steps_per_print": INT,
             "gradient_clipping": NUMBER, "prescale_gradients": BOOL, "gradient_predivide_factor": NUMBER, "wall_clock_breakdown": BOOL,
             "zero_allow_untested_optimizer": BOOL, "memory_breakdown": BOOL, "dump_state": BOOL}
SECTIONS = {"fp16": {"enabled": BOOL, "auto_cast": BOOL, "loss_scale": NUMBER, "initial_scale_power": INT, "loss_scale_window": INT,
                     "hysteresis": INT, "min_loss_scale": NUMBER},
            "bf16": {"enabled": BOOL}, "amp": {"enabled": BOOL}, "activation_checkpointing": {"partition_activations": BOOL, "cpu_checkpointing": BOOL},
            "flops_profiler": {"enabled": BOOL, "profile_step": INT}}
NONZERO_KNOBS = ("reduce_bucket_size", "allgather_bucket_size", "sub_group_size")  # 0 divides by zero or never fills a bucket


def check_ds_values(ds: Dict[str, Any]) -> None:
    for key, kind in TOP_LEVEL.items():
        if key in ds:
            for value in ds[key] if isinstance(ds[key], list) and key != "train_batch_size" else [ds[key]]:
                _check(key, value, kind)
    if "train_batch_size" in ds and ds["train_batch_size"] != "auto" and ds["train_batch_size"] < 1:
        raise UserError(f"train_batch_size={ds['train_batch_size']} is not a batch size.",
                        "Give a positive whole number, or leave train_batch_size out (while tuning it follows from micro-batch x accumulation x GPUs).")
    for name, keys in SECTIONS.items():
        section = ds.get(name)
        if section is not None and not isinstance(section, dict):
            raise UserError(f"The ds_config's {name} is {json.dumps(section)}, not an object.", f'Write it as an object, e.g. "{name}": {{"enabled": true}}.')
        for key, kind in keys.items():
            if section and key in section:
                _check(f"{name}.{key}", section[key], kind)
    zero = ds.get("zero_optimization")
    if zero is None:
        return
    if not isinstance(zero, dict):
        raise UserError(f"The ds_config's zero_optimization is {json.dumps(zero)}, not an object; DeepSpeed would refuse every experiment.",
                        'Write it as an object, e.g. "zero_optimization": {"stage": [1, 2]} (or "stage": "all").')
    for key in NONZERO_KNOBS:
        values = zero.get(key) if isinstance(zero.get(key), list) else [zero.get(key)]
        if any(v == 0 and not isinstance(v, bool) for v in values):
            raise UserError(f"zero_optimization.{key} is 0; DeepSpeed cannot work with an empty bucket (every experiment would fail or hang).",
                            f"Give {key} a positive number of elements (e.g. 500000000), or leave it out for DeepSpeed's default.")
    for name in ("offload_optimizer", "offload_param"):
        section = zero.get(name)
        if section is not None and not isinstance(section, dict):
            raise UserError(f"zero_optimization.{name} is {json.dumps(section)}, not an object.", f'Write it like "{name}": {{"device": "cpu"}}.')
        if section and section.get("device") == "nvme" and not section.get("nvme_path"):
            raise UserError(f'zero_optimization.{name}.device is "nvme" but no nvme_path is given; DeepSpeed would fail every experiment looking for the swap folder.',
                            f'Add "nvme_path": "/local_nvme" (a folder on the NVMe drive) to zero_optimization.{name}, or use "device": "cpu".')


def _check(key: str, value: Any, kind: str) -> None:
    if value == "auto" and key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping", "fp16.enabled", "bf16.enabled"):
        return  # the HF Trainer fills these in
    ok = isinstance(value, bool) if kind is BOOL else (not isinstance(value, bool) and (isinstance(value, int) if kind is INT else isinstance(value, (int, float))))
    if ok:
        return
    why = " (in quotes: DeepSpeed reads a string, and any non-empty string is true)" if kind is BOOL and isinstance(value, str) else \
          " (in quotes: DeepSpeed reads a string, not a number)" if isinstance(value, str) else ""
    example = "true" if kind is BOOL else "16"
    raise UserError(f"The ds_config's {key} is {json.dumps(value)}{why}, not {kind}.", f"Write it as {kind}, e.g. {example} without quotes.")
