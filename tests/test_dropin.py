"""Drop-in for DeepSpeed users (issue 13): every key of DeepSpeed's autotuning section, the README's
sampler lines, --help, a plan that writes nothing, HF Trainer scripts without arg_mappings, the
`mlautotune-deepspeed` entry point and one command-line builder for experiments and cmd_optimal."""

import json
import os
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import hjson
import pytest
from conftest import TINY_MODEL
from hydra import compose, initialize_config_dir
from test_bad_inputs import run_cli

from mlautotune.inputs.config import register_configs, settings
from mlautotune.run.lifeline import release_shared_memory
from mlautotune.search import base_params, first_experiments
from mlautotune.session import is_hf_trainer
from mlautotune.inputs.space import build_plan, experiment_config, experiment_name, plan_text
from mlautotune.workloads import GPT_SCRIPT

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "src" / "mlautotune" / "conf"
HF_SCRIPT = Path(__file__).parent / "scripts" / "hf_trainer_gpt2.py"
# Other sessions on the machine start their experiments' ports at 29500 too; a port of our own avoids the race.
PORT = str(30000 + os.getpid() % 20000)
SRC_ENV = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


@pytest.fixture(scope="module")
def cfg():
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config")


def deepspeed_autotuning_section() -> dict:
    """Every key DeepSpeed's autotuning config reads, with DeepSpeed's own default (from its constants)."""
    from deepspeed.autotuning import constants as C
    from deepspeed.autotuning.config import DeepSpeedAutotuningConfig

    names = vars(C)
    section = {v: names[k + "_DEFAULT"] for k, v in names.items() if k.startswith("AUTOTUNING_") and isinstance(v, str) and k + "_DEFAULT" in names}
    section[C.MODEL_INFO] = dict(C.MODEL_INFO_KEY_DEFAULT_DICT)
    read = {k for k in vars(DeepSpeedAutotuningConfig({})) if k not in ("start_step", "end_step")}  # attributes it never reads from the dict
    assert read <= set(section), read - set(section)  # the generator follows DeepSpeed's config class
    section[C.AUTOTUNING_ENABLED] = True
    return section


def plan_of(cfg, ds, world_size=2, script_args=(), hf_trainer=False):
    final = settings(cfg, ds, [])
    return build_plan(ds, final.autotuning, final.space, list(script_args), world_size, hf_trainer=hf_trainer)


# ---- DeepSpeed's autotuning keys -------------------------------------------------------------
def test_every_deepspeed_autotuning_key_plans(tmp_path):
    section = deepspeed_autotuning_section()
    assert {"max_train_micro_batch_size_per_gpu", "min_train_micro_batch_size_per_gpu", "min_train_batch_size", "model_info", "model_info_path", "metric_path"} <= set(section)
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "autotuning": section}))
    code, out, err = run_cli(tmp_path, ["plan", f"config={tmp_path / 'ds.json'}", "launcher.num_gpus=2"])
    assert code == 0, err
    assert "autotuning.model_info is accepted but not used" in out  # a key we do not use is named, not refused
    assert "first experiments: z0_gas1_tmbspg1, z0_gas1_tmbspg4" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.json"]  # plan writes nothing


def test_deepspeed_step_search_settings_the_search_does_not_read_are_accepted_and_said_so(cfg):
    quiet = plan_of(cfg, {"autotuning": {"enabled": True, "tuner_early_stopping": 5, "num_tuning_micro_batch_sizes": 3}})
    assert not any("tuner_early_stopping" in n or "num_tuning_micro_batch_sizes" in n for n in quiet.notices)  # DeepSpeed's defaults
    told = plan_of(cfg, {"autotuning": {"enabled": True, "tuner_early_stopping": 20, "num_tuning_micro_batch_sizes": 5}})
    assert any(n.startswith("autotuning.tuner_early_stopping=20 is accepted but not used: the search ends by its own stop rule") for n in told.notices)
    assert any(n.startswith("autotuning.num_tuning_micro_batch_sizes=5 is accepted but not used") for n in told.notices)


def test_micro_batch_bounds_reach_the_plan_and_the_first_experiments(cfg):
    ds = {"train_micro_batch_size_per_gpu": 2, "autotuning": {"enabled": True, "min_train_micro_batch_size_per_gpu": 3, "max_train_micro_batch_size_per_gpu": 8}}
    plan = plan_of(cfg, ds)
    assert plan.micro_batch.values == (3,) and plan.micro_batch_max == 8
    assert plan.micro_batch_cap == 8
    assert [p["micro_batch"] for p in first_experiments(plan)] == [3]  # 4x = 12 is above the maximum
    plan = plan_of(cfg, {"autotuning": {"enabled": True, "min_train_batch_size": 16}})
    assert plan.micro_batch.values == (8,)  # 8 x gas 1 x 2 ranks = 16
    plan = plan_of(cfg, {"train_micro_batch_size_per_gpu": [1, 4, 64], "autotuning": {"enabled": True, "max_train_micro_batch_size_per_gpu": 32}})
    assert plan.micro_batch.values == (1, 4) and any("left out: [64]" in n for n in plan.notices)
    assert plan_of(cfg, {"autotuning": {"enabled": True, "max_train_batch_size": 8}}).micro_batch_cap == 4


def test_max_train_batch_size_tunes_gradient_accumulation_with_the_micro_batch_as_deepspeed_does(cfg):
    """DeepSpeed's autotuner runs each micro-batch at gas = max_train_batch_size_per_gpu // micro-batch
    (autotuner.py, run_tuning_micro_batch_sizes): seen side by side, its z0_gas2_tmbspg15 (max 30, one
    rank) beat gas 1 by 6%, the optimizer step paid once per 30 samples instead of per 15."""
    plan = plan_of(cfg, {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 3, "autotuning": {"enabled": True, "max_train_batch_size": 30}}, world_size=1)
    assert [plan.gas_for(m) for m in (1, 4, 15, 16, 30)] == [30, 7, 2, 1, 1] and plan.micro_batch_cap == 30
    p = base_params(plan, 0, 15)
    assert experiment_name(0, p["gas"], 15, {}) == "z0_gas2_tmbspg15"
    assert experiment_config(plan, 0, 15, {})["gradient_accumulation_steps"] == 2
    assert any("gradient_accumulation_steps 3 is not used while tuning" in n for n in plan.notices)
    assert "gradient accumulation: max_train_batch_size // (micro-batch x data-parallel ranks)" in plan_text(plan)  # what `mlautotune plan` says
    two = plan_of(cfg, {"autotuning": {"enabled": True, "max_train_batch_size": 32}}, world_size=2)
    assert two.gas_for(4) == 4 and two.micro_batch_cap == 16  # 4 x 4 x 2 ranks = 32
    fixed = plan_of(cfg, {"gradient_accumulation_steps": 3, "autotuning": {"enabled": True}})
    assert fixed.gas_for(1) == fixed.gas_for(64) == 3  # no max_train_batch_size: the user's


def test_deepspeed_spelling_of_the_flops_metric_on_the_command_line(tmp_path):
    (tmp_path / "ds.json").write_text('{"autotuning": {"enabled": true}}')
    code, out, err = run_cli(tmp_path, ["plan", f"config={tmp_path / 'ds.json'}", "autotuning.metric=flops"])
    assert code == 0 and "metric: FLOPS" in out, err


@pytest.mark.parametrize("override", ["search.sampler={_target_: optuna.samplers.TPESampler}", "search.sampler._target_=optuna.samplers.TPESampler"])
def test_the_readme_sampler_lines_work(tmp_path, override):
    (tmp_path / "ds.json").write_text('{"autotuning": {"enabled": true}}')
    code, out, err = run_cli(tmp_path, ["--cfg", "job", f"config={tmp_path / 'ds.json'}", override])
    assert code == 0 and "_target_: optuna.samplers.TPESampler" in out, err
    code, out, err = run_cli(tmp_path, ["plan", f"config={tmp_path / 'ds.json'}", override, "search.sampler.n_startup_trials=3"])
    assert code == 0, err


# ---- --help ------------------------------------------------------------------------------------
def test_help_fits_a_screen_and_names_the_commands_and_keys(tmp_path):
    for flag in ("--help", "-h"):
        code, out, _ = run_cli(tmp_path, [flag])
        assert code == 0 and len(out.splitlines()) < 40
        for word in ("usage:", "tune", "plan", "experiment", "sync", "config=", "script=", "launcher.num_gpus", "--cfg job", "example"):
            assert word in out
        assert "tuner:" not in out and "space:" not in out  # no groups that cannot be overridden


def test_hydra_own_flags_still_work(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mlautotune", "--cfg", "job"], cwd=tmp_path, capture_output=True, text=True, env=SRC_ENV, timeout=120)
    assert proc.returncode == 0 and "max_train_micro_batch_size_per_gpu: 1024" in proc.stdout, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "mlautotune", "--info"], cwd=tmp_path, capture_output=True, text=True, env=SRC_ENV, timeout=120)
    assert proc.returncode == 0 and "Config search path" in proc.stdout, proc.stderr


# ---- plan writes nothing -----------------------------------------------------------------------
def test_plan_writes_nothing_and_lists_the_search_first_experiments(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": [2, 4, 8], "zero_optimization": {"stage": [1, 2]}, "autotuning": {"enabled": true, "results_dir": "out/r", "exps_dir": "out/e"}}')
    code, out, err = run_cli(tmp_path, ["plan", f"config={tmp_path / 'ds.json'}", "launcher.num_gpus=2"])
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.json"]
    first = next(line for line in out.splitlines() if line.startswith("first experiments:"))
    assert first == "first experiments: z1_gas1_tmbspg2, z1_gas1_tmbspg4"  # a list: its two smallest sizes (the memory slope); then the search


# ---- HF Trainer ----------------------------------------------------------------------------------
HF_DS = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "zero_optimization": {"stage": [0, 1], "reduce_bucket_size": "auto"},
}


def test_hf_trainer_script_is_recognised():
    assert is_hf_trainer(HF_SCRIPT, ["--deepspeed", "ds.json"])
    assert not is_hf_trainer(HF_SCRIPT, ["--deepspeed_config", "ds.json"])
    assert not is_hf_trainer(Path(GPT_SCRIPT), ["--deepspeed", "ds.json"])


def test_hf_auto_values_map_onto_the_trainer_flags_and_pass_through(cfg):
    plan = plan_of(cfg, {**HF_DS, "autotuning": {"enabled": True}}, script_args=["--per_device_train_batch_size", "2"], hf_trainer=True)
    assert plan.arg_mappings == {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size", "gradient_accumulation_steps": "--gradient_accumulation_steps",
                                 "activation_checkpointing": "--gradient_checkpointing"}  # the Trainer's checkpointing switch is a memory saver
    assert plan.micro_batch.values == (2,) and plan.gas == 1
    ds = experiment_config(plan, 1, 4, {})
    assert ds["zero_optimization"]["reduce_bucket_size"] == "auto"  # the Trainer fills it from the hidden size
    assert ds["train_micro_batch_size_per_gpu"] == 4 and "train_batch_size" not in ds


# ---- mlautotune-deepspeed ----------------------------------------------------------------------
def test_pyproject_declares_the_deepspeed_style_console_script():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["mlautotune-deepspeed"] == "mlautotune.deepspeed_cli:main"
    from mlautotune.deepspeed_cli import main

    assert callable(main)


def test_deepspeed_launcher_arguments_become_the_same_session_settings():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from mlautotune.deepspeed_cli import overrides

    argv = ["--num_gpus", "2", "--num_nodes", "1", "--master_port", "29700", "--no_ssh", "--autotuning", "run",
            "train.py", "--deepspeed-config", "my ds.json", "--name", "it's \\ here", "--steps=3"]
    parsed = {o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(overrides(argv))}
    assert parsed["config"] == "my ds.json" and parsed["script"] == "train.py" and parsed["mode"] == "run"
    assert shlex.split(parsed["script_args"]) == ["--deepspeed-config", "my ds.json", "--name", "it's \\ here", "--steps=3"]
    assert (parsed["launcher.num_gpus"], parsed["launcher.num_nodes"], parsed["launcher.master_port"]) == (2, 1, 29700)
    assert parsed["launcher.launcher_args"] == ["--no_ssh"]


def test_deepspeed_entry_point_without_a_ds_config_is_a_clear_error(tmp_path):
    from mlautotune.deepspeed_cli import main

    code, _, err = run_cli(tmp_path, ["--num_gpus", "2", "train.py", "--epochs", "1"], main=main)
    assert code == 2 and "name no ds_config" in err and "Traceback" not in err


# ---- end to end --------------------------------------------------------------------------------
def optimal_and_measured_commands(results: Path):
    """cmd_optimal.txt, and the measured experiment's plain command with the optimal config's path."""
    optimal = hjson.loads((results / "ds_config_optimal.json").read_text())
    exp = json.loads((results / optimal["mlautotune"]["experiment"] / "exp.json").read_text())
    plain = [str(results / "ds_config_optimal.json") if a == exp["ds_config"] else a for a in exp["plain_cmd"]]
    return (results / "cmd_optimal.txt").read_text().strip(), shlex.join(plain)


@pytest.mark.e2e
@pytest.mark.timeout(1500)
def test_deepspeed_style_command_tunes_a_config_with_every_deepspeed_autotuning_key(tmp_path):
    """`mlautotune-deepspeed --num_gpus 2 gpt.py --deepspeed ds.json` with DeepSpeed's whole autotuning section."""
    section = {**deepspeed_autotuning_section(), "tuner_num_trials": 2}
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
                                                  "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "autotuning": section}))
    env = {**SRC_ENV, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    proc = subprocess.run([sys.executable, "-m", "mlautotune.deepspeed_cli", "--num_gpus", "2", "--master_port", PORT, str(GPT_SCRIPT), "--deepspeed", "ds.json", *TINY_MODEL],
                          cwd=tmp_path, capture_output=True, text=True, env=env, timeout=1400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = tmp_path / "autotuning_results"
    assert len([d for d in results.iterdir() if (d / "exp.json").exists()]) == 2
    cmd, measured = optimal_and_measured_commands(results)
    assert cmd == measured
    assert cmd.startswith("deepspeed --num_gpus 2 ")


@pytest.mark.e2e
@pytest.mark.timeout(1800)
def test_hf_trainer_script_tunes_with_auto_and_no_arg_mappings_and_its_optimal_command_runs(tmp_path):
    ds = {**HF_DS, "autotuning": {"enabled": True, "tuner_num_trials": 2, "start_profile_step": 2, "end_profile_step": 4, "experiment_timeout": 400,
                                  "max_train_micro_batch_size_per_gpu": 16}}
    (tmp_path / "ds.json").write_text(json.dumps(ds, indent=2))
    script_args = "--deepspeed ds.json --output_dir out --max_steps 8 --report_to none --save_strategy no --logging_steps 100"
    proc = subprocess.run([sys.executable, "-m", "mlautotune", "config=ds.json", f"script={HF_SCRIPT}", f"script_args='{script_args}'",
                           "launcher.num_gpus=2", f"launcher.master_port={PORT}", "tracking.enabled=false", "measure.budget_s=1"],
                          cwd=tmp_path, capture_output=True, text=True, env=SRC_ENV, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = tmp_path / "autotuning_results"
    runs = [json.loads((d / "exp.json").read_text())["params"]["micro_batch"] for d in results.iterdir() if (d / "exp.json").exists()]
    ok = [json.loads((d / "exp.json").read_text())["params"]["micro_batch"] for d in results.iterdir()
          if (d / "result.json").exists() and json.loads((d / "result.json").read_text())["status"] == "ok"]
    assert len(runs) == 2 and max(runs) <= 16, runs  # max_train_micro_batch_size_per_gpu bounds the search
    assert len(set(ok)) >= 2, (runs, ok)  # micro-batches other than the script's default pass HF's ds_config check
    cmd, measured = optimal_and_measured_commands(results)
    assert cmd == measured and "--per_device_train_batch_size" in cmd
    env = {**SRC_ENV, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    try:
        run = subprocess.run(shlex.split(cmd), cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
    finally:  # the user's own run, without mlautotune: DeepSpeed leaves its CPU all-reduce buffers in /dev/shm
        argv = shlex.split(cmd)
        release_shared_memory(argv[argv.index("--master_port") + 1] if "--master_port" in argv else 29500)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "train_runtime" in run.stdout + run.stderr


def test_cmd_optimal_is_the_experiment_command_with_arg_mappings_at_any_depth(tmp_path):
    """One builder: cmd_optimal maps nested keys (like DeepSpeed's get_val_by_key) exactly as the experiment did."""
    from mlautotune.commands import optimal_cmd
    from mlautotune.run.experiment import plain_command
    from mlautotune.session import open_session

    ds = {"zero_optimization": {"stage": [1, 2]}, "train_micro_batch_size_per_gpu": 2,
          "autotuning": {"enabled": True, "arg_mappings": {"stage": "--zero_stage", "train_micro_batch_size_per_gpu": "--per_device_train_batch_size"}}}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"config={tmp_path / 'ds.json'}", "launcher.num_gpus=2", "launcher.master_port=29777", f"autotuning.results_dir={tmp_path / 'r'}"])
    session = open_session(cfg, dry_run=True)
    params = first_experiments(session.plan)[1]
    exp = session.make_experiment(params)
    optimal_path = str(session.results_dir / "ds_config_optimal.json")
    cmd = optimal_cmd(session, params, exp.ds_config)
    assert cmd == shlex.join(plain_command(exp, optimal_path))
    args = shlex.split(cmd)
    assert args[args.index("--zero_stage") + 1] == "1" and args[args.index("--per_device_train_batch_size") + 1] == "8"
    assert args[args.index("--deepspeed_config") + 1] == optimal_path and args[:3] == ["deepspeed", "--num_gpus", "2"]
    assert args[args.index("--master_port") + 1] == "29777"  # the user's port; experiments take free ports from it


def test_cfg_job_shows_the_settings_the_ds_config_gives(tmp_path):
    """`--cfg job` prints the effective settings, the ds_config's autotuning section merged in."""
    (tmp_path / "ds.json").write_text('{"autotuning": {"enabled": true, "tuner_num_trials": 7, "metric": "latency"}}')
    code, out, err = run_cli(tmp_path, ["--cfg", "job", f"config={tmp_path / 'ds.json'}", "autotuning.tuner_type=random"])
    assert code == 0, err
    assert "  enabled: true" in out and "  tuner_num_trials: 7" in out and "  metric: latency" in out and "  tuner_type: random" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.json"]


def test_mlflow_run_passes_a_multirun_flag_in_overrides_to_hydra():
    """`mlflow run . -P overrides="-m autotuning.tuner_type=model_based,random"`: Hydra's flags go before
    the overrides, which Hydra's own parser requires (it said "unrecognized arguments")."""
    from hydra._internal.utils import get_args_parser

    from mlautotune.mlproject import overrides

    argv = overrides(["config=", "mode=tune", "num_gpus=2", "overrides=-m autotuning.tuner_type=model_based,random"])
    args = get_args_parser().parse_args(argv)
    assert args.multirun and sorted(args.overrides) == ["autotuning.tuner_type=model_based,random", "launcher.num_gpus=2", "mode=tune"]
