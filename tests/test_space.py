"""The tuning plan from every JSON example of the DeepSpeed autotuning README's "Configuring
Tuning Scope" and "Using Autotuning with Hugging Face" sections, copied in as written (trailing
commas and all), with the documented result; and the precedence of the settings."""

from pathlib import Path

import hjson
import pytest
from hydra import compose, initialize_config_dir

from mlautotune.inputs.config import load_ds_config, register_configs, settings
from mlautotune.errors import UserError
from mlautotune.inputs.space import build_plan, experiment_config, experiment_name, knob_combos, plan_text

CONF = Path(__file__).resolve().parents[1] / "conf"


@pytest.fixture(scope="module")
def cfg():
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config")


def plan_of(cfg, text, script_args=(), world_size=2, overrides=(), fast=True):
    ds = hjson.loads(text)
    ds.setdefault("autotuning", {"enabled": True})
    at = {"enabled": True, **ds["autotuning"], **({} if fast else {"fast": False})}
    final = settings(cfg, {**ds, "autotuning": at}, list(overrides))
    return build_plan(ds, final.autotuning, final.space, list(script_args), world_size)


def full(cfg, text, **kw):
    return plan_of(cfg, text, fast=False, **kw)


STAGES_23 = '''{
  "zero_optimization": {
    "stage": [2, 3]
  }
}'''

MBS_MIN_4 = '''{
    "train_micro_batch_size_per_gpu": 4,
    "autotuning": {
        "enabled": true,
    },
    "arg_mappings": {
        "train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
    }
}'''

AUTO_BOTH = '''{
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "autotuning": {
        "enabled": true,
        "arg_mappings": {
            "train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
            "gradient_accumulation_steps ": "--gradient_accumulation_steps"
        }
    }
}'''

MAX_TBS = '''{
    "autotuning": {
        "enabled": true,
        "max_train_batch_size": 1024,
        "arg_mappings": {
          "train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
        }
    }
}'''

MBS_LIST = '''{
  "train_micro_batch_size_per_gpu": [1, 4, 16],
  "gradient_accumulation_steps": 2
}'''

MBS_FIXED = '''{
    "train_micro_batch_size_per_gpu": [4],
}'''

STAGE1_OVERRIDE = '''{
  "zero_optimization": {
    "stage": 1,
    "reduce_bucket_size": [5e7, 5e8],
    "allgather_bucket_size": 5e8,
  }
}'''

HF_EXAMPLE = '''{
  "train_micro_batch_size_per_gpu": "auto",
  "gradient_accumulation_steps": "auto",
  "autotuning": {
    "enabled": true,
    "arg_mappings": {
      "train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
      "gradient_accumulation_steps": "--gradient_accumulation_steps"
    },
  }
}'''


def test_stage_list_explores_only_those_stages(cfg):
    assert plan_of(cfg, STAGES_23).stages == [2, 3]


def test_no_stage_means_stage_0_with_a_hint(cfg):
    plan = plan_of(cfg, MBS_FIXED)
    assert plan.stages == [0]
    assert any('"stage": "all"' in n for n in plan.notices)


def test_all_means_every_stage(cfg):
    assert plan_of(cfg, '{"zero_optimization": {"stage": "all"}}').stages == [0, 1, 2, 3]


def test_integer_micro_batch_is_the_minimum_and_the_flag_is_ignored(cfg):
    plan = plan_of(cfg, MBS_MIN_4, script_args=["--per_device_train_batch_size", "8"])
    assert (plan.micro_batch.mode, plan.micro_batch.values) == ("min", (4,))


def test_auto_takes_the_mapped_flags_and_strips_stray_whitespace(cfg):
    plan = plan_of(cfg, AUTO_BOTH, script_args=["--per_device_train_batch_size", "3", "--gradient_accumulation_steps", "2"])
    assert (plan.micro_batch.mode, plan.micro_batch.values, plan.gas) == ("min", (3,), 2)
    hf = plan_of(cfg, HF_EXAMPLE, script_args=["--per_device_train_batch_size", "1"])
    assert (hf.micro_batch.values, hf.gas) == ((1,), 1)  # gas flag absent -> 1


def test_max_train_batch_size_is_recorded(cfg):
    assert plan_of(cfg, MAX_TBS).max_train_batch_size == 1024


def test_micro_batch_list_and_fixed_gas(cfg):
    plan = plan_of(cfg, MBS_LIST)
    assert (plan.micro_batch.mode, plan.micro_batch.values, plan.gas) == ("list", (1, 4, 16), 2)
    assert experiment_config(plan, 0, 4, {})["gradient_accumulation_steps"] == 2


def test_one_element_list_fixes_the_micro_batch(cfg):
    plan = plan_of(cfg, MBS_FIXED)
    assert (plan.micro_batch.mode, plan.micro_batch.values) == ("fixed", (4,))


def test_stage1_override_gives_exactly_two_by_one(cfg):
    plan = full(cfg, STAGE1_OVERRIDE)
    combos = knob_combos(plan, 1)
    assert combos == [{"reduce_bucket_size": 50000000}, {"reduce_bucket_size": 500000000}]
    ds = experiment_config(plan, 1, 2, combos[0])
    assert ds["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 50000000, "allgather_bucket_size": 500000000}
    assert "autotuning" not in ds and "train_batch_size" not in ds


def test_default_spaces(cfg):
    plan = full(cfg, '{"zero_optimization": {"stage": "all"}}')
    assert len(knob_combos(plan, 0)) == 1
    assert len(knob_combos(plan, 1)) == 9  # the README's 3 x 3
    assert {"overlap_comm", "reduce_scatter", "contiguous_gradients"} <= set(plan.knobs[2])
    assert "allgather_bucket_size" not in plan.knobs[3] and "allgather_partitions" not in plan.knobs[3]
    assert knob_combos(plan_of(cfg, '{"zero_optimization": {"stage": "all"}}'), 2) == [{}]  # fast mode


def test_override_without_stage_applies_to_every_stage_and_offload_is_kept(cfg):
    plan = full(cfg, '{"zero_optimization": {"stage": "all", "overlap_comm": false, "offload_optimizer": {"device": "cpu"}}, "bf16": {"enabled": true}}')
    for s in (0, 1, 2, 3):
        ds = experiment_config(plan, s, 1, {})
        assert ds["zero_optimization"]["overlap_comm"] is False
        assert ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
        assert ds["bf16"] == {"enabled": True}


def test_train_batch_size_is_ignored_with_a_notice(cfg):
    plan = plan_of(cfg, '{"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2}')
    assert any("train_batch_size is ignored" in n for n in plan.notices)
    assert "train_batch_size" not in experiment_config(plan, 0, 2, {})


def test_experiment_names():
    assert experiment_name(1, 1, 3, {}) == "z1_gas1_tmbspg3"
    assert experiment_name(2, 1, 4, {"reduce_bucket_size": 500000000, "overlap_comm": True}) == "z2_gas1_tmbspg4_oc1_rbs5e8"


def test_plan_text_lists_stages_and_sizes(cfg):
    text = plan_text(full(cfg, '{"zero_optimization": {"stage": [1, 2]}, "train_micro_batch_size_per_gpu": [2]}'))
    assert "stages: [1, 2]" in text and "z1: 9 knob combination" in text and "at most 1024" in text


def test_first_experiments_are_the_profiling_runs(cfg):
    """The session's first experiments (plan prints them): the first stage at the smallest micro-batch and 4x, knobs at DeepSpeed's defaults."""
    from mlautotune.search import first_experiments

    plan = full(cfg, '{"zero_optimization": {"stage": [1, 2]}, "train_micro_batch_size_per_gpu": 2}')
    first = first_experiments(plan)
    assert [(p["stage"], p["micro_batch"]) for p in first] == [(1, 2), (1, 8)]
    assert [experiment_name(1, 1, p["micro_batch"], {k: v for k, v in p.items() if k not in ("stage", "micro_batch", "gas")}) for p in first][0] == "z1_gas1_tmbspg2_agbs5e8_rbs5e8"


def test_every_readme_example_keeps_the_deepspeed_zero_model_happy(cfg):
    """Each plan's experiment configs pass DeepSpeed's own zero_optimization model (it forbids unknown keys)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    for text in (STAGES_23, STAGE1_OVERRIDE, MBS_LIST, '{"zero_optimization": {"stage": "all"}}'):
        plan = full(cfg, text)
        for s in plan.stages:
            for combo in knob_combos(plan, s):
                DeepSpeedZeroConfig(**experiment_config(plan, s, 1, combo)["zero_optimization"])


def test_precedence_conf_then_ds_config_then_command_line(cfg, tmp_path):
    ds = {"autotuning": {"enabled": True, "tuner_type": "random", "tuner_num_trials": 7, "metric": "latency"}}
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cli = compose(config_name="config", overrides=["autotuning.tuner_num_trials=3"])
    final = settings(cli, ds, ["autotuning.tuner_num_trials=3"])
    assert final.autotuning.tuner_type == "random"  # the ds_config beats conf
    assert final.autotuning.tuner_num_trials == 3  # the command line beats the ds_config
    assert final.autotuning.metric == "latency" and final.autotuning.start_profile_step == 3  # conf default


def test_hjson_and_stray_whitespace_keys(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text('{\n  // a comment\n  "gradient_accumulation_steps ": 2,\n  "autotuning": {"enabled": true,},\n}')
    assert load_ds_config(p) == {"gradient_accumulation_steps": 2, "autotuning": {"enabled": True}}


def test_max_train_batch_size_below_the_smallest_batch(cfg):
    with pytest.raises(UserError, match="smallest possible batch 8"):
        plan_of(cfg, '{"train_micro_batch_size_per_gpu": 4, "autotuning": {"max_train_batch_size": 4}}')
