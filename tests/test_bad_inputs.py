"""Every user mistake: a one-paragraph message naming the problem and the fix, exit status 2, no
traceback, and nothing written. Runs the real command line (`plan`, which validates everything a
tuning session does and launches nothing), in this process: `mlautotune.cli.main` with the
arguments, as the console script calls it. One test also runs a few through a real subprocess.

docs/bad-inputs.md is this table: `python tests/test_bad_inputs.py > docs/bad-inputs.md` rewrites it.
"""

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

OK_AT = {"enabled": True}

# (case, ds_config text or None for "missing file", extra CLI args, expected message fragment)
CASES = [
    ("config file that is not there", None, [], "does not exist"),
    ("JSON that does not parse", '{"train_micro_batch_size_per_gpu": 1,\n  "autotuning": {"enabled": tru}}', [], "line 2, column"),
    ("top level is not an object", "[1, 2]", [], "is not a JSON object"),
    ("autotuning section missing", {"train_micro_batch_size_per_gpu": 1}, [], '"autotuning": {"enabled": true}'),
    ("autotuning not enabled", {"autotuning": {"enabled": False}}, [], '"autotuning": {"enabled": true}'),
    ("unknown key in autotuning", {"autotuning": {"enabled": True, "tuner_typ": "random"}}, [], "unknown key 'tuner_typ'"),
    ("unknown tuner_type", {"autotuning": {"enabled": True, "tuner_type": "bayes"}}, [], "not a known tuner"),
    ("unknown metric", {"autotuning": {"enabled": True, "metric": "speed"}}, [], "not a known metric"),
    ("stage outside 0-3", {"zero_optimization": {"stage": 4}, "autotuning": OK_AT}, [], "is not a ZeRO stage"),
    ("micro-batch not a positive integer", {"train_micro_batch_size_per_gpu": [2, -1], "autotuning": OK_AT}, [], "not a positive integer"),
    ("end_profile_step < start_profile_step", {"autotuning": {"enabled": True, "start_profile_step": 5, "end_profile_step": 3}}, [], "smaller than start_profile_step"),
    ("arg_mappings flag without --", {"autotuning": {"enabled": True, "arg_mappings": {"train_micro_batch_size_per_gpu": "per_device_train_batch_size"}}}, [], "not a command-line flag"),
    ("gradient accumulation list", {"gradient_accumulation_steps": [1, 2], "autotuning": OK_AT}, [], "not supported"),
    ("max_train_batch_size below the smallest batch", {"train_micro_batch_size_per_gpu": 4, "autotuning": {"enabled": True, "max_train_batch_size": 2}}, ["launcher.num_gpus=2"], "smaller than the smallest possible batch"),
    ("non-numeric value in a knob list", {"zero_optimization": {"stage": 1, "reduce_bucket_size": [5e7, "big"]}, "autotuning": OK_AT}, [], "not a number or true/false"),
    ("script that is not there", {"autotuning": OK_AT}, ["script=/nonexistent/train.py"], "does not exist"),
    ("script that is not Python", {"autotuning": OK_AT}, ["script=@TXT@"], "not a Python file"),
    ("hostfile that is not there", {"autotuning": OK_AT}, ["launcher.hostfile=/nonexistent/hostfile"], "does not exist"),
    ("malformed hostfile", {"autotuning": OK_AT}, ["launcher.hostfile=@BADHOSTS@"], "malformed"),
    ("num_gpus larger than the hosts offer", {"autotuning": OK_AT}, ["launcher.hostfile=@HOSTS@", "launcher.num_gpus=8"], "more than the hosts offer"),
    ("results directory that cannot be written", {"autotuning": {"enabled": True, "results_dir": "/proc/mlautotune"}}, [], "cannot be written"),
    ("tracking URI that cannot be parsed", {"autotuning": OK_AT}, ["tracking.tracking_uri=bogus-scheme://x"], "cannot be used"),
    ("memory limit that is not a size", {"autotuning": {"enabled": True, "memory_limit_per_rank": "lots"}}, [], "is not a size"),
    ("script_args with an open quote", {"autotuning": OK_AT}, ["script_args='--name \"x'"], "cannot be split"),
    # ---- issue 13: decoding, size and structure of the file
    ("UTF-16 ds_config (with BOM)", b"\xff\xfe" + '{"autotuning": {"enabled": true}}'.encode("utf-16-le"), [], "UTF-16"),
    ("UTF-32 ds_config (with BOM)", b"\xff\xfe\x00\x00" + '{"autotuning": {"enabled": true}}'.encode("utf-32-le"), [], "UTF-32"),
    ("UTF-16 ds_config without BOM", '{"autotuning": {"enabled": true}}'.encode("utf-16-le"), [], "binary file"),
    ("binary file as ds_config", bytes(range(256)) * 4, [], "binary file"),
    ("Latin-1 ds_config", '{"autotuning": {"enabled": true}, "note": "caf\u00e9"}'.encode("latin-1"), [], "not UTF-8 text"),
    ("huge file as ds_config", "@HUGE@", [], "a ds_config is a few KiB"),
    ("nesting deep enough for a RecursionError", "[" * 200000 + "]" * 200000, [], "nested too deeply"),
    ("nesting deeper than 32 levels", '{"autotuning": {"enabled": true}, "x": ' + "[" * 40 + "]" * 40 + "}", [], "more than 32 levels"),
    ("empty file", "", [], "is empty"),
    ("file of blanks", "  \n\n ", [], "is empty"),
    ("config is a directory", "@DIR@", [], "is a directory"),
    ("config is a symlink loop", "@LOOP@", [], "loops back on itself"),
    ("config= given empty", {"autotuning": OK_AT}, ["config="], "config= is given but empty"),
    ("script= given empty", {"autotuning": OK_AT}, ["script="], "script= is given but empty"),
    ("script is a directory", {"autotuning": OK_AT}, ["script=@TMP@"], "is a directory"),
    ("duplicate autotuning section", '{"autotuning": {"enabled": true}, "autotuning": {"enabled": true, "fast": false}}', [], "'autotuning' twice"),
    ("duplicate key inside autotuning", '{"autotuning": {"enabled": true, "tuner_num_trials": 5, "tuner_num_trials": 9}}', [], "'tuner_num_trials' twice"),
    ("duplicate key differing by whitespace", '{"gradient_accumulation_steps": 1, "gradient_accumulation_steps ": 2, "autotuning": {"enabled": true}}', [], "twice"),
    ("autotuning is not an object", {"autotuning": [True]}, [], "not an object"),
    ('"enabled": "true" (a string)', {"autotuning": {"enabled": "true"}}, [], "the string 'true', not the JSON boolean"),
    ('"enabled": 1', {"autotuning": {"enabled": 1}}, [], '("enabled": 1)'),
    # ---- numbers out of range
    ("1e999 as a number", '{"autotuning": {"enabled": true, "tuner_num_trials": 1e999}}', [], "too large for a float"),
    ("-1e999 as a number", '{"zero_optimization": {"reduce_bucket_size": -1e999}, "autotuning": {"enabled": true}}', [], "too large for a float"),
    ('"1e400" as a memory size', {"autotuning": {"enabled": True, "memory_limit_per_rank": "1e400"}}, [], "larger than any machine's memory"),
    ('memory_limit_per_rank "0"', {"autotuning": {"enabled": True, "memory_limit_per_rank": "0"}}, [], "less than 1 MiB"),
    ("experiment_timeout=nan", {"autotuning": OK_AT}, ["autotuning.experiment_timeout=nan"], "not a positive number of seconds"),
    ("experiment_timeout=inf", {"autotuning": OK_AT}, ["autotuning.experiment_timeout=inf"], "not a positive number of seconds"),
    ("negative experiment_timeout", {"autotuning": {"enabled": True, "experiment_timeout": -5}}, [], "not a positive number of seconds"),
    ("tuner_num_trials 0", {"autotuning": {"enabled": True, "tuner_num_trials": 0}}, [], "tuner_num_trials=0 must be at least 1"),
    ("mp_size=0", {"autotuning": OK_AT}, ["autotuning.mp_size=0"], "mp_size=0 must be at least 1"),
    ("mp_size larger than the world", {"autotuning": {"enabled": True, "mp_size": 4}}, ["launcher.num_gpus=2"], "is larger than the 2 ranks"),
    ("mp_size that does not divide the world", {"autotuning": {"enabled": True, "mp_size": 3}}, ["launcher.hostfile=@HOSTS4@", "launcher.num_gpus=4"], "does not divide the 4 ranks"),
    ("num_nodes=0", {"autotuning": OK_AT}, ["launcher.num_nodes=0"], "num_nodes=0 must be at least 1"),
    ("num_gpus=0", {"autotuning": OK_AT}, ["launcher.num_gpus=0"], "num_gpus=0 must be at least 1"),
    ("master_port=70000", {"autotuning": OK_AT}, ["launcher.master_port=70000"], "is not a TCP port"),
    ("master_port=0", {"autotuning": OK_AT}, ["launcher.master_port=0"], "is not a TCP port"),
    ("max_train_batch_size 0", {"autotuning": {"enabled": True, "max_train_batch_size": 0}}, [], "max_train_batch_size=0 must be at least 1"),
    ("min micro-batch above max", {"autotuning": {"enabled": True, "min_train_micro_batch_size_per_gpu": 64, "max_train_micro_batch_size_per_gpu": 8}}, [], "larger than max_train_micro_batch_size_per_gpu"),
    ("micro-batch above max_train_micro_batch_size_per_gpu", {"train_micro_batch_size_per_gpu": 32, "autotuning": {"enabled": True, "max_train_micro_batch_size_per_gpu": 16}}, [], "above autotuning.max_train_micro_batch_size_per_gpu=16"),
    ("micro-batch list outside the bounds", {"train_micro_batch_size_per_gpu": [64, 128], "autotuning": {"enabled": True, "max_train_micro_batch_size_per_gpu": 32}}, [], "None of the micro-batch sizes [64, 128]"),
    ("min_train_batch_size beyond the largest micro-batch", {"autotuning": {"enabled": True, "min_train_batch_size": 4096, "max_train_micro_batch_size_per_gpu": 64}}, ["launcher.num_gpus=2"], "No micro-batch size fits"),
    ("search.heartbeat_seconds=0", {"autotuning": OK_AT}, ["search.heartbeat_seconds=0"], "heartbeat_seconds=0 must be at least 1"),
    ("search.strategy=v3 (the search has no strategies)", {"autotuning": OK_AT}, ["search.strategy=v3"], "'search.strategy' is not a setting of mlautotune"),
    ("search.stop_probability=0", {"autotuning": OK_AT}, ["search.stop_probability=0"], "search.stop_probability=0 is outside 0..1"),
    ("worker with an empty search.storage", {"autotuning": OK_AT}, ["@FIRST@worker", "search.storage="], "search.storage= is given but empty"),
    ("worker with mode=run", {"autotuning": OK_AT}, ["@FIRST@worker", "mode=run"], "a worker only tunes"),
    ("report of a session that does not exist", {"autotuning": OK_AT}, ["@FIRST@report", "search.session=nope"], "holds no session named 'nope'"),
    ("empty results_dir", {"autotuning": {"enabled": True, "results_dir": ""}}, [], "results_dir or exps_dir is empty"),
    # ---- flags, stages, knobs
    ("arg_mappings flag with a space", {"autotuning": {"enabled": True, "arg_mappings": {"train_micro_batch_size_per_gpu": "--per device"}}}, [], "not a single command-line flag"),
    ("arg_mappings flag with ;", {"autotuning": {"enabled": True, "arg_mappings": {"train_micro_batch_size_per_gpu": "--bs;rm -rf x"}}}, [], "not a single command-line flag"),
    ('"stage": []', {"zero_optimization": {"stage": []}, "autotuning": OK_AT}, [], "stage is an empty list"),
    ('"stage": "2"', {"zero_optimization": {"stage": "2"}, "autotuning": OK_AT}, [], "is not a ZeRO stage"),
    ("empty knob list", {"zero_optimization": {"stage": 1, "reduce_bucket_size": []}, "autotuning": OK_AT}, [], "reduce_bucket_size is an empty list"),
    ("misspelt ZeRO knob", {"zero_optimization": {"stage": 2, "reduce_bucket_sise": 5e8}, "autotuning": OK_AT}, [], "reduce_bucket_sise is not a DeepSpeed ZeRO setting"),
    ("misspelt ZeRO knob in a list", {"zero_optimization": {"stage": 2, "overlap_com": [True, False]}, "autotuning": OK_AT}, [], "overlap_com is not a DeepSpeed ZeRO setting"),
    ("misspelt key in an offload section", {"zero_optimization": {"stage": 2, "offload_optimizer": {"devise": "cpu"}}, "autotuning": OK_AT}, [], "offload_optimizer.devise is not a DeepSpeed ZeRO setting"),
    ("negative bucket size", {"zero_optimization": {"stage": 1, "reduce_bucket_size": [5e8, -5]}, "autotuning": OK_AT}, [], "refused by DeepSpeed"),
    ("fractional bucket size", {"zero_optimization": {"stage": 1, "reduce_bucket_size": 5.5}, "autotuning": OK_AT}, [], "refused by DeepSpeed"),
    ('"auto" knob for a script that is not an HF Trainer', {"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}, "autotuning": OK_AT}, [], "only the Hugging Face Trainer fills in"),
    # ---- commands, storage, sampler
    ("command=Plan", {"autotuning": OK_AT}, ["command=Plan"], "command='Plan' is not a command"),
    ("unknown first word", {"autotuning": OK_AT}, ["@FIRST@Plan"], "'Plan' is not a command"),
    ("garbage search.storage", {"autotuning": OK_AT}, ["search.storage=garbage"], "not a database URL"),
    ("unknown storage scheme", {"autotuning": OK_AT}, ["search.storage=nosuchdb://host/db"], "not a database URL"),
    ("sqlite storage in a missing folder's file", {"autotuning": OK_AT}, ["search.storage=sqlite:///@TXT@/x/optuna.db"], "not a folder"),
    ("sampler that cannot be imported", {"autotuning": OK_AT}, ["search.sampler={_target_: optuna.samplers.NoSuchSampler}"], "cannot be imported"),
    ("sampler that is not an Optuna sampler", {"autotuning": OK_AT}, ["search.sampler={_target_: collections.OrderedDict}"], "is not an Optuna sampler"),
    ("sampler without _target_", {"autotuning": OK_AT}, ["search.sampler={seed: 1}"], "has no _target_"),
    ("misspelt key on the command line", {"autotuning": OK_AT}, ["autotuning.tuner_typ=random"], "'autotuning.tuner_typ' is not a setting of mlautotune"),
    ("1e999 on the command line", {"autotuning": OK_AT}, ["autotuning.tuner_num_trials=1e999"], "autotuning.tuner_num_trials='inf' is not a whole number"),
    ("a word for a number on the command line", {"autotuning": OK_AT}, ["launcher.num_gpus=two"], "launcher.num_gpus='two' is not a whole number"),
    ("a sweep without --multirun", {"autotuning": OK_AT}, ["autotuning.metric=throughput,latency"], "Ambiguous value"),
    # ---- issue 49: values DeepSpeed or MLflow would fail on or misread later
    ('"fast": "no"', {"autotuning": {"enabled": True, "fast": "no"}}, [], 'autotuning.fast is "no" (in quotes: DeepSpeed reads a string, and any non-empty string is true)'),
    ('"fast": "false"', {"autotuning": {"enabled": True, "fast": "false"}}, [], 'autotuning.fast is "false"'),
    ('"overwrite": "false"', {"autotuning": {"enabled": True, "overwrite": "false"}}, [], 'autotuning.overwrite is "false"'),
    ('"tuner_num_trials": "900"', {"autotuning": {"enabled": True, "tuner_num_trials": "900"}}, [], 'autotuning.tuner_num_trials is "900" (in quotes)'),
    ('"tuner_early_stopping": "3"', {"autotuning": {"enabled": True, "tuner_early_stopping": "3"}}, [], "not a whole number"),
    ('"experiment_timeout": "900"', {"autotuning": {"enabled": True, "experiment_timeout": "900"}}, [], 'autotuning.experiment_timeout is "900" (in quotes), not a number'),
    ('"train_micro_batch_size_per_gpu": "16"', {"train_micro_batch_size_per_gpu": "16", "autotuning": OK_AT}, [], 'train_micro_batch_size_per_gpu is "16" (in quotes: DeepSpeed reads a string, not a number)'),
    ('"gradient_accumulation_steps": "3"', {"gradient_accumulation_steps": "3", "autotuning": OK_AT}, [], 'gradient_accumulation_steps is "3"'),
    ('"train_batch_size": 0', {"train_batch_size": 0, "autotuning": OK_AT}, [], "train_batch_size=0 is not a batch size"),
    ('"train_batch_size": -8', {"train_batch_size": -8, "autotuning": OK_AT}, [], "train_batch_size=-8 is not a batch size"),
    ('"train_batch_size": "16"', {"train_batch_size": "16", "autotuning": OK_AT}, [], 'train_batch_size is "16"'),
    ('"fp16": {"enabled": "false"}', {"fp16": {"enabled": "false"}, "autotuning": OK_AT}, [], 'fp16.enabled is "false" (in quotes: DeepSpeed reads a string, and any non-empty string is true)'),
    ('"bf16": {"enabled": "no"}', {"bf16": {"enabled": "no"}, "autotuning": OK_AT}, [], 'bf16.enabled is "no"'),
    ('"wall_clock_breakdown": "false"', {"wall_clock_breakdown": "false", "autotuning": OK_AT}, [], 'wall_clock_breakdown is "false"'),
    ('"steps_per_print": "10"', {"steps_per_print": "10", "autotuning": OK_AT}, [], 'steps_per_print is "10"'),
    ('"fp16": true (not an object)', {"fp16": True, "autotuning": OK_AT}, [], "fp16 is true, not an object"),
    ("zero_optimization as a list", {"zero_optimization": [1, 2], "autotuning": OK_AT}, [], "zero_optimization is [1, 2], not an object"),
    ("zero_optimization as a string", {"zero_optimization": "stage2", "autotuning": OK_AT}, [], 'zero_optimization is "stage2", not an object'),
    ("offload_optimizer to nvme without nvme_path", {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}, "autotuning": OK_AT}, [], "offload_optimizer.device is \"nvme\" but no nvme_path"),
    ("offload_param to nvme without nvme_path", {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "pin_memory": True}}, "autotuning": OK_AT}, [], "offload_param.device is \"nvme\" but no nvme_path"),
    ("offload_optimizer as a string", {"zero_optimization": {"stage": 2, "offload_optimizer": "cpu"}, "autotuning": OK_AT}, [], 'offload_optimizer is "cpu", not an object'),
    ("reduce_bucket_size 0", {"zero_optimization": {"stage": 2, "reduce_bucket_size": 0}, "autotuning": OK_AT}, [], "zero_optimization.reduce_bucket_size is 0"),
    ("allgather_bucket_size 0", {"zero_optimization": {"stage": 2, "allgather_bucket_size": 0}, "autotuning": OK_AT}, [], "zero_optimization.allgather_bucket_size is 0"),
    ("sub_group_size 0", {"zero_optimization": {"stage": 3, "sub_group_size": 0}, "autotuning": OK_AT}, [], "zero_optimization.sub_group_size is 0"),
    ("a 0 in a bucket-size list", {"zero_optimization": {"stage": 2, "reduce_bucket_size": [5e8, 0]}, "autotuning": OK_AT}, [], "reduce_bucket_size is 0"),
    ("experiment_timeout=0", {"autotuning": OK_AT}, ["autotuning.experiment_timeout=0"], "not a positive number of seconds"),
    ("tiny experiment_timeout", {"autotuning": OK_AT}, ["autotuning.experiment_timeout=0.5"], "shorter than a DeepSpeed launch takes"),
    ("final_training_timeout=0", {"autotuning": OK_AT}, ["autotuning.final_training_timeout=0"], "final_training_timeout=0 is not a number of seconds"),
    ("final_training_timeout=nan", {"autotuning": OK_AT}, ["autotuning.final_training_timeout=nan"], "final_training_timeout=nan"),
    ("final_training_timeout negative", {"autotuning": {"enabled": True, "final_training_timeout": -60}}, [], "final_training_timeout=-60"),
    ("end_profile_step beyond any timeout", {"autotuning": {"enabled": True, "end_profile_step": 10**7, "experiment_timeout": 60}}, [], "cannot end within autotuning.experiment_timeout=60 s"),
    ("arg_mappings with an empty key", {"autotuning": {"enabled": True, "arg_mappings": {"": "--batch_size"}}}, [], "arg_mappings has an empty key"),
    ("arg_mappings key that is not tuned", {"autotuning": {"enabled": True, "arg_mappings": {"learning_rate": "--lr"}}}, [], "arg_mappings maps 'learning_rate', which is not a key this session tunes"),
    ("hostfile slots=1.5", {"autotuning": OK_AT}, ["launcher.hostfile=@FRACHOSTS@"], "slots='1.5'"),
    ("hostfile host that is an ssh option", {"autotuning": OK_AT}, ["launcher.hostfile=@EVILHOSTS@"], "names the host '-oProxyCommand=touch${IFS}/tmp/x' on line 1"),
    ("include that is an ssh option", {"autotuning": OK_AT}, ["launcher.include='-oProxyCommand=id'"], "launcher.include='-oProxyCommand=id' names"),
    ("exclude with a shell character", {"autotuning": OK_AT}, ["launcher.exclude='worker-1;id'"], "launcher.exclude='worker-1;id' names 'worker-1;id'"),
    ("empty tracking.experiment_name", {"autotuning": OK_AT}, ["tracking.experiment_name="], "tracking.experiment_name is empty"),
    ("blank tracking.experiment_name", {"autotuning": OK_AT}, ["tracking.experiment_name=' '"], "tracking.experiment_name is empty"),
    ("file:// tracking URI", {"autotuning": OK_AT}, ["tracking.tracking_uri=file:///tmp/mlruns"], "is a file store (a folder), which MLflow 3 refuses"),
    ("folder as tracking URI", {"autotuning": OK_AT}, ["tracking.tracking_uri=./mlruns"], "is a file store"),
    ("in-memory sqlite tracking URI", {"autotuning": OK_AT}, ["tracking.tracking_uri=sqlite://"], "is an in-memory database"),
    ("in-memory sqlite study", {"autotuning": OK_AT}, ["search.storage=sqlite://"], "in-memory sqlite database"),
    ("storage whose driver is not installed", {"autotuning": OK_AT}, ["search.storage=mysql://me:pw@db/optuna"], "needs the mysql driver 'mysqldb', which is not installed"),
    # ---- issue 49: a wrong type names the key and the type it takes
    ('"tuner_num_trials": "many"', {"autotuning": {"enabled": True, "tuner_num_trials": "many"}}, [], 'autotuning.tuner_num_trials is "many" (in quotes), not a whole number'),
    ('"metric": 5', {"autotuning": {"enabled": True, "metric": 5}}, [], "autotuning.metric is 5, not a string"),
    ('"fast": 1', {"autotuning": {"enabled": True, "fast": 1}}, [], "autotuning.fast is 1, not true or false"),
    ('"results_dir": 7', {"autotuning": {"enabled": True, "results_dir": 7}}, [], "autotuning.results_dir is 7, not a string"),
    ('"max_train_batch_size": "big"', {"autotuning": {"enabled": True, "max_train_batch_size": "big"}}, [], "autotuning.max_train_batch_size is \"big\""),
    ('"experiment_timeout": true', {"autotuning": {"enabled": True, "experiment_timeout": True}}, [], "autotuning.experiment_timeout is true, not a number"),
    # ---- issue 51: the full run's planned length (mlautotune's own autotuning keys)
    ("planned_steps 0", {"autotuning": {"enabled": True, "planned_steps": 0}}, [], "autotuning.planned_steps=0 is not a positive whole number"),
    ("negative planned_samples on the command line", {"autotuning": OK_AT}, ["autotuning.planned_samples=-5"], "autotuning.planned_samples=-5 is not a positive whole number"),
    ('"planned_tokens": "1e9"', {"autotuning": {"enabled": True, "planned_tokens": "1e9"}}, [], 'autotuning.planned_tokens is "1e9" (in quotes), not a whole number'),
    ('"planned_steps": 2.5', {"autotuning": {"enabled": True, "planned_steps": 2.5}}, [], "autotuning.planned_steps is 2.5, not a whole number"),
    ("two planned lengths", {"autotuning": {"enabled": True, "planned_steps": 100, "planned_samples": 3200}}, [], "autotuning.planned_steps and autotuning.planned_samples are both given"),
    ('"mp_size": 1.5', {"autotuning": {"enabled": True, "mp_size": 1.5}}, [], "autotuning.mp_size is 1.5, not a whole number"),
    ('"arg_mappings": "x"', {"autotuning": {"enabled": True, "arg_mappings": "x"}}, [], 'autotuning.arg_mappings is "x", not an object'),
    ('"memory_limit_per_rank": true', {"autotuning": {"enabled": True, "memory_limit_per_rank": True}}, [], "autotuning.memory_limit_per_rank is true, not a string"),
    ('"start_profile_step": "3"', {"autotuning": {"enabled": True, "start_profile_step": "3"}}, [], 'autotuning.start_profile_step is "3"'),
    ('"num_tuning_micro_batch_sizes": [3]', {"autotuning": {"enabled": True, "num_tuning_micro_batch_sizes": [3]}}, [], "autotuning.num_tuning_micro_batch_sizes is [3], not a whole number"),
    ('"tuner_type": ["random"]', {"autotuning": {"enabled": True, "tuner_type": ["random"]}}, [], 'autotuning.tuner_type is ["random"], not a string'),
    ('"model_info": "x"', {"autotuning": {"enabled": True, "model_info": "x"}}, [], 'autotuning.model_info is "x", not an object'),
    ("a word for a boolean on the command line", {"autotuning": OK_AT}, ["autotuning.fast=maybe"], "autotuning.fast='maybe' is not true or false"),
    ("a word for a float on the command line", {"autotuning": OK_AT}, ["autotuning.experiment_timeout=long"], "autotuning.experiment_timeout='long' is not a number"),
]


def prepare(tmp_path: Path, ds, extra):
    """Write the case's files; return the command-line arguments after `plan`."""
    cfg = tmp_path / "ds.json"
    (tmp_path / "notes.txt").write_text("not python")
    (tmp_path / "hosts").write_text("localhost slots=2\n")
    (tmp_path / "hosts4").write_text("localhost slots=4\n")
    (tmp_path / "badhosts").write_text("localhost slots=two\n")
    (tmp_path / "frachosts").write_text("localhost slots=1.5\n")
    (tmp_path / "evilhosts").write_text("-oProxyCommand=touch${IFS}/tmp/x slots=1\nlocalhost slots=1\n")
    if ds == "@HUGE@":
        with open(cfg, "wb") as f:
            f.truncate(17 * 2**20)  # sparse: big to stat, no time to write
    elif ds == "@DIR@":
        cfg.mkdir()
    elif ds == "@LOOP@":
        os.symlink(tmp_path / "loop2.json", cfg)
        os.symlink(cfg, tmp_path / "loop2.json")
    elif isinstance(ds, bytes):
        cfg.write_bytes(ds)
    elif ds is not None:
        cfg.write_text(ds if isinstance(ds, str) else json.dumps(ds))
    subs = {"@TXT@": str(tmp_path / "notes.txt"), "@HOSTS4@": str(tmp_path / "hosts4"), "@HOSTS@": str(tmp_path / "hosts"),
            "@BADHOSTS@": str(tmp_path / "badhosts"), "@FRACHOSTS@": str(tmp_path / "frachosts"), "@EVILHOSTS@": str(tmp_path / "evilhosts"), "@TMP@": str(tmp_path)}
    args = [next((a.replace(k, v) for k, v in subs.items() if k in a), a) for a in extra]
    first = [a[len("@FIRST@"):] for a in args if a.startswith("@FIRST@")]
    args = [a for a in args if not a.startswith("@FIRST@")]
    if not any(a.startswith("config=") for a in args):
        args.insert(0, f"config={cfg}")
    return first + args if first else ["plan", *args]


def run_in_process(tmp_path: Path, argv) -> tuple:
    """(exit status, stderr) of `mlautotune <argv>` run in this process, in tmp_path."""
    code, _, err = run_cli(tmp_path, argv)
    return code, err


def run_cli(tmp_path: Path, argv, main=None) -> tuple:
    """(exit status, stdout, stderr) of `main(argv)` (default: `mlautotune`'s) run in this process, in tmp_path."""
    if main is None:
        from mlautotune.cli import main

    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(tmp_path)
    code = 0
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                main(list(argv))
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except Exception:  # noqa: BLE001 - a crash is what the test looks for
                import traceback

                traceback.print_exc()
                code = 1
    finally:
        os.chdir(here)
    return code, out.getvalue(), err.getvalue()


def error_lines(stderr: str) -> list:
    return [line for line in stderr.splitlines() if line.startswith("mlautotune: error:")]


@pytest.mark.parametrize("case,ds,extra,fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_a_clear_error(tmp_path, case, ds, extra, fragment):
    code, stderr = run_in_process(tmp_path, prepare(tmp_path, ds, extra))
    assert code == 2, stderr
    assert "Traceback" not in stderr
    lines = error_lines(stderr)
    assert len(lines) == 1, stderr
    assert fragment in lines[0]
    assert "\n" not in lines[0]
    leftovers = {p.name for p in tmp_path.iterdir()} - {"ds.json", "notes.txt", "hosts", "hosts4", "badhosts", "frachosts", "evilhosts", "loop2.json"}
    assert not leftovers, f"plan wrote {leftovers}"


def test_the_console_script_gives_the_same_answer_in_a_subprocess(tmp_path):
    """The real process: exit status 2, one paragraph, no traceback (UTF-16, unknown command)."""
    for ds, extra, fragment in ((b"\xff\xfe" + "{}".encode("utf-16-le"), [], "UTF-16"), ({"autotuning": OK_AT}, ["@FIRST@Plan"], "not a command")):
        argv = prepare(tmp_path, ds, extra)
        proc = subprocess.run([sys.executable, "-m", "mlautotune", *argv], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert fragment in error_lines(proc.stderr)[0]


def test_a_typo_in_an_override_is_an_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mlautotune", "plan", "autotuning.tuner_typ=random"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "tuner_typ" in proc.stderr and "Traceback" not in proc.stderr


HOSTILE = """
## Hostile inputs beyond `plan` (tests/test_hostile_inputs.py)

Each runs through a real entry point (`mlautotune tune`, `mlautotune-deepspeed`, the MLproject's
`mlflow run` entry point) and is checked for exit status 2, one paragraph, no traceback, no password
in what is printed, and no user file moved.

- **Host names.** Every host of a hostfile (and of `launcher.include`/`exclude`) must be a host name
  (letters, digits, `-` and `_`, dot-separated, not starting with `-`) or an IP address, and `slots=` a
  whole number of at least 1, before anything reaches ssh, pdsh or DeepSpeed's runner. A test plants
  `-oProxyCommand=touch${IFS}MARK` as the first host of a real `tune` and checks that MARK never appears.
- **The results folder is the tool's own.** `autotuning.results_dir` may not be the working folder,
  the training script's folder, the MLflow tracking store's folder or the Optuna storage's folder,
  nor a folder holding files mlautotune did not write (a folder of a previous session may be resumed
  even with other files in it, but not archived). `overwrite=true` archives only the tool's own
  entries (session.json, summary.txt, trials.csv, plots, optuna.db, ... and experiment folders holding
  the cmd.txt or exp.json written before each launch) into `previous_sessions/`; anything else stays.
- **Stores.** An unreachable PostgreSQL/MySQL server (named by host and port, connect timeout 5 s), a
  driver that is not installed (`mysql://` without mysqlclient), a sqlite study in a folder that cannot
  be written, an in-memory `sqlite://` study, a file-store (`file://` or folder) or in-memory tracking
  URI: one paragraph each, with the URL's password masked everywhere, Hydra's lines included (no
  exception reaches Hydra's "Error executing job with overrides" report).
- **Hydra itself.** A launcher or sweeper plugin that is not installed (`hydra/launcher=joblib`), a
  `hydra.run.dir`/`hydra.sweep.dir` that cannot be made, `-m` with a command other than `tune`,
  `+key=value`/`~key` (keys added to or deleted from the schema), and in a multirun every swept value
  of the wrong type or key: each refused before Hydra runs the job.
- **The drop-in.** `mlautotune-deepspeed` with an unknown flag, no script, `--num_gpus two` or
  `--autotuning bogus`: DeepSpeed's own parser's complaint as one paragraph, not argparse's usage block.
- **Secrets.** cmd.txt and exp.json hold the command with secret flags' values masked (only
  cmd_optimal.txt must run as it is); after each experiment its stdout.log and stderr.log are
  rewritten with every known secret value masked (a token among the script's arguments, the tracking
  URI's password, any environment variable whose name marks a secret, such as `HF_TOKEN`).
  A multirun's job folders, `multirun.yaml` and console lines show no URL password.
- **Logs and tracking outages.** An experiment's log longer than 4 MiB keeps its first and last 2 MiB,
  with a line saying how many bytes were cut (on disk and in MLflow). A tracking server that is down
  or never answers is tried once (2 attempts, MLflow's own retries off, a 10 s timeout); then the
  session goes on untracked and `mlautotune sync` fills MLflow in later.
- **Interrupts and a full disk.** A second Ctrl-C (or SIGTERM) while the partial report is written only
  says it is being written; the parent run always ends KILLED. A full disk, also under the Optuna
  study's sqlite file, ends the session FAILED with the reason, no run left RUNNING, exit status 1.
- **Detached processes.** Every process an experiment starts carries `MLAUTOTUNE_EXPERIMENT=<token>`
  in its environment; when the experiment ends, any that left its process group (a `setsid` daemon)
  is killed and named in the experiment's launches.log.
"""

ACCEPTED = """
## Accepted, not errors (tests/test_dropin.py)

- Every key of DeepSpeed's autotuning section (`min/max_train_micro_batch_size_per_gpu`,
  `min_train_batch_size`, `metric_path`, `model_info`, `model_info_path`, ...); the three it does not
  use get a warning that names the key, and so do `tuner_early_stopping` and
  `num_tuning_micro_batch_sizes` when set to other than DeepSpeed's default (the search does not
  read them: docs/search.md).
- `metric=flops` (or `FLOPS`, `Throughput`) in the file or on the command line.
- `'search.sampler={_target_: optuna.samplers.TPESampler}'` and `search.sampler._target_=...` (plus
  `search.sampler.<argument>=...`).
- `"auto"` batch keys without `arg_mappings`: passed as the HF Trainer's `--per_device_train_batch_size`
  and `--gradient_accumulation_steps`; HF's other `"auto"` values for an HF Trainer script.
"""


if __name__ == "__main__":  # regenerate docs/bad-inputs.md
    import tempfile

    print("# Bad inputs and their messages\n")
    print("Every case below is run by `tests/test_bad_inputs.py` through `mlautotune plan`; each exits with status 2")
    print("with this one paragraph and no traceback, and `plan` writes nothing.\n")
    print("| bad input | message |\n|---|---|")
    for case, ds, extra, _ in CASES:
        with tempfile.TemporaryDirectory() as d:
            code, stderr = run_in_process(Path(d), prepare(Path(d), ds, extra))
            err = error_lines(stderr)
            msg = err[0].replace(os.path.realpath(d), "<tmp>").replace(d, "<tmp>").replace("|", "\\|") if err else "(no message)"
        print(f"| {case.replace('|', '/')} | {msg} |")
    print(HOSTILE)
    print(ACCEPTED)
