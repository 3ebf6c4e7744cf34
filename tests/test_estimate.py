"""The full-run estimate's arithmetic (track/estimate.py), the planned length and sequence length read
from the inputs (inputs/planned.py), and the user's starting configuration (search/candidates.py)."""

import pytest
from omegaconf import OmegaConf

from mlautotune.inputs.config import AutotuningConf
from mlautotune.inputs.planned import Planned, planned_length, sequence_length
from mlautotune.inputs.space import build_plan
from mlautotune.run.experiment import Result
from mlautotune.search.candidates import given_batch, given_params
from mlautotune.search.ledger import Measured
from mlautotune.search.tuner import Outcome
from mlautotune.track.estimate import Hours, duration, full_run, planned_samples, run_hours, saved_hours, throughput_of
from mlautotune.track.report import write_reports


def measured(name, value, interval=0.05, repeats=(), trial=0, tbs=8, metric="throughput", throughput=None):
    metrics = {"throughput": value if throughput is None else throughput, "interval_rel": interval, "train_batch_size": tbs, metric: value}
    return Measured({"stage": 0, "micro_batch": tbs, "gas": 1}, Result(name, "ok", metrics, "", 10.0, "", 0), trial, value, list(repeats))


def test_hours_carry_the_step_times_interval():
    h = run_hours(samples=3600 * 100, throughput=100.0, interval_rel=0.05)
    assert h == Hours(pytest.approx(1.0), pytest.approx(0.95), pytest.approx(1.05))
    assert run_hours(3600, 1.0, 1.5).low == 0.0  # never negative hours


def test_hours_saved_take_the_worst_case_of_both_intervals():
    start, opt = Hours(44.0, 42.0, 46.0), Hours(31.0, 30.0, 32.0)
    s = saved_hours(start, opt)
    assert (s.mid, s.low, s.high) == (13.0, 10.0, 16.0)
    assert saved_hours(opt, opt, same=True) == Hours(0.0, 0.0, 0.0)  # one measurement: it saves exactly nothing
    # intervals that overlap: the saving may be nothing or a loss, and the interval says so
    assert saved_hours(Hours(10.0, 9.0, 11.0), Hours(9.5, 9.0, 10.0)).low < 0


def test_planned_length_becomes_samples_or_says_what_it_needs():
    assert planned_samples(Planned("steps", 100, "x"), 32, None) == 3200
    assert planned_samples(Planned("samples", 500, "x"), None, None) == 500
    assert planned_samples(Planned("tokens", 6400, "x"), 32, 128) == 50
    assert planned_samples(Planned("tokens", 6400, "x"), 32, None) is None  # no sequence length: never guessed
    assert planned_samples(Planned("epochs", 3, "x"), 32, 128) is None  # the data set's size is not known


def test_throughput_at_the_median_of_each_metric():
    m = measured("a", 100.0, repeats=[80.0, 90.0])  # median 90
    assert throughput_of(m, "throughput") == pytest.approx(90.0)
    lat = measured("b", 80.0, repeats=[100.0, 120.0], metric="latency", throughput=100.0)  # ms per step; median 100
    assert throughput_of(lat, "latency") == pytest.approx(80.0)  # 1.25x slower than the first measurement
    fl = measured("c", 2e9, repeats=[3e9, 4e9], metric="FLOPS_per_gpu", throughput=50.0)
    assert throughput_of(fl, "FLOPS") == pytest.approx(75.0)


def test_the_estimate_at_the_optimum_and_the_start():
    start = measured("z0_gas1_tmbspg8", 100.0, interval=0.02, trial=0, tbs=16)
    best = measured("z1_gas1_tmbspg16", 160.0, interval=0.04, repeats=[150.0, 170.0], trial=3, tbs=32)  # median 160, interval 0.04/sqrt(3)
    e = full_run(Planned("steps", 36000, "autotuning.planned_steps"), best, start, "", metric="throughput", world_size=8, user_batch=16)
    samples = 36000 * 16
    rel = 0.04 / 3 ** 0.5
    m = e.metrics
    assert m["estimate.planned_samples"] == samples
    assert m["estimate.optimum_hours"] == pytest.approx(samples / 160 / 3600)
    assert m["estimate.optimum_hours_low"] == pytest.approx(samples / 160 / 3600 * (1 - rel))
    assert m["estimate.optimum_gpu_hours_high"] == pytest.approx(8 * samples / 160 / 3600 * (1 + rel))
    assert m["estimate.start_hours"] == pytest.approx(samples / 100 / 3600)
    assert m["estimate.saved_hours"] == pytest.approx(samples / 3600 * (1 / 100 - 1 / 160))
    assert m["estimate.saved_hours_low"] == pytest.approx(samples / 3600 * (0.98 / 100 - (1 + rel) / 160))
    assert m["estimate.saved_gpu_hours_high"] == pytest.approx(8 * samples / 3600 * (1.02 / 100 - (1 - rel) / 160))
    text = "\n".join(e.lines)
    assert text.startswith("Full-run estimate: 36,000 steps (autotuning.planned_steps) x 16 samples per step (your batch size) = 576,000 samples.")
    assert "the same samples take 18,000 of its steps" in text  # the optimum's batch is 32
    assert "At the optimum z1_gas1_tmbspg16: 1 h (" in text and "on 8 devices" in text
    assert "At your starting configuration z0_gas1_tmbspg8: 1.6 h (1.568 h to 1.632 h, 95% interval), 12.8 GPU-hours" in text


def test_the_estimate_without_a_start_says_why():
    best = measured("z1_gas1_tmbspg16", 160.0)
    e = full_run(Planned("samples", 1000, "autotuning.planned_samples"), best, None, "the ds_config names the stages \"all\", not one",
                 metric="throughput", world_size=2, user_batch=None)
    assert "estimate.start_hours" not in e.metrics and "estimate.saved_hours" not in e.metrics
    assert 'Your starting configuration: the ds_config names the stages "all", not one, so there is no time to compare with.' in e.lines[-1]


@pytest.mark.parametrize("planned, tokens, needs", [
    (None, None, "give the full run's length as autotuning.planned_steps"),
    (Planned("epochs", 3, "the script's --num_train_epochs"), None, "the data set's size in samples"),
    (Planned("tokens", 1e9, "autotuning.planned_tokens"), None, "the sequence length"),
])
def test_no_estimate_names_what_is_missing(planned, tokens, needs):
    e = full_run(planned, measured("a", 10.0), None, "", metric="throughput", world_size=1, user_batch=4, tokens=tokens)
    assert e.metrics == {} and needs in e.lines[0]


def test_duration_reads_at_every_size():
    assert duration(31.25) == "31.25 h" and duration(0.5) == "30 min" and duration(1 / 3600) == "1 s" and duration(-2.0) == "-2 h"
    assert duration(1.5, "min") == "90 min" and duration(12345.6) == "12,346 h"


def test_planned_length_from_the_keys_then_a_trainer_scripts_flags():
    at = lambda **kw: OmegaConf.structured(AutotuningConf(**kw))
    assert planned_length(at(planned_tokens=10**9), ["--max_steps", "5"], True) == Planned("tokens", 1e9, "autotuning.planned_tokens")
    assert planned_length(at(), ["--max_steps", "500", "--num_train_epochs", "3"], True) == Planned("steps", 500, "the script's --max_steps")
    assert planned_length(at(), ["--max_steps", "-1", "--num_train_epochs=2.5"], True) == Planned("epochs", 2.5, "the script's --num_train_epochs")
    assert planned_length(at(), ["--max_steps", "500"], False) is None  # another script's flag may mean anything
    assert sequence_length(["--seq_len", "32"]) == (32, "--seq_len") and sequence_length(["--block_size=1024"]) == (1024, "--block_size")
    assert sequence_length(["--steps", "3"]) is None


def plan_of(ds, world_size=2, fast=True):
    at = OmegaConf.structured(AutotuningConf(fast=fast))
    space = OmegaConf.create({f"zero{s}": {"overlap_comm": [True, False]} if s else {} for s in range(4)})
    return build_plan(ds, at, space, [], world_size)


def test_the_starting_configuration_is_the_ds_config_as_given():
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1}, "autotuning": {"enabled": True}}
    assert given_params(plan_of(ds), ds) == ({"stage": 1, "micro_batch": 4, "gas": 2}, "")
    assert given_batch(plan_of(ds), ds) == 4 * 2 * 2
    params, _ = given_params(plan_of(ds, fast=False), ds)  # a tuned knob the user leaves out: DeepSpeed's default
    assert params == {"stage": 1, "micro_batch": 4, "gas": 2, "overlap_comm": False}
    every = {**ds, "zero_optimization": {"stage": "all"}}
    assert given_params(plan_of(every), every) == (None, 'the ds_config names the stages "all", not one')
    assert given_batch(plan_of(every), every) == 16  # still one batch size
    listed = {**ds, "train_micro_batch_size_per_gpu": [2, 4]}
    assert given_params(plan_of(listed), listed)[0] is None and given_batch(plan_of(listed), listed) is None


def test_summary_and_record_carry_the_estimate(tmp_path):
    best = measured("z0_gas1_tmbspg8", 50.0, trial=0)
    outcome = Outcome(best=best, stage_best={0: best}, measured=[best], experiments=1)
    e = full_run(Planned("samples", 180000, "autotuning.planned_samples"), best, best, "", metric="throughput", world_size=2, user_batch=8)
    record = write_reports(tmp_path, outcome, stages=[0], metric="throughput", status="complete", wall_time_s=3.0, session="s",
                           optimal_ds_config=None, optimal_cmd=None, estimate=e)
    summary = (tmp_path / "summary.txt").read_text()
    assert "Full-run estimate: 180,000 samples (autotuning.planned_samples)." in summary
    assert "Saved: 0 h (0 h to 0 h, 95% interval), 0 GPU-hours (0 to 0) on 2 devices. Your starting configuration is the optimum." in summary
    assert record["metrics"]["estimate.optimum_hours"] == pytest.approx(1.0)
    assert record["tags"]["estimate"].startswith("Full-run estimate: 180,000 samples")


def test_deepspeed_never_sees_the_planned_length():
    """The planned_* keys live in the autotuning section, which no experiment's ds_config carries."""
    from mlautotune.inputs.space import experiment_config

    ds = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}, "autotuning": {"enabled": True, "planned_steps": 20000}}
    plan = plan_of(ds)
    cfg = experiment_config(plan, 1, 2, {})
    assert "autotuning" not in cfg and "planned_steps" not in str(cfg)


def test_a_trainer_scripts_max_steps_and_its_batch_flags_drive_the_estimate(tmp_path):
    """The glue (commands.run_estimate) on a real session, opened as `plan` opens it: an HF Trainer
    script with "auto" batch keys, --max_steps 1000 and --per_device_train_batch_size 4 on 2 ranks."""
    import json
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from mlautotune.commands import run_estimate
    from mlautotune.inputs.config import register_configs
    from mlautotune.session import open_session

    root = Path(__file__).resolve().parents[1]
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 1}, "autotuning": {"enabled": True}}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    args = "--deepspeed ds.json --max_steps 1000 --per_device_train_batch_size 4 --gradient_accumulation_steps 2"
    register_configs()
    with initialize_config_dir(config_dir=str(root / "src" / "mlautotune" / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"config={tmp_path / 'ds.json'}", f"script={root / 'tests' / 'scripts' / 'hf_trainer_gpt2.py'}",
                                                       f"script_args='{args}'", "launcher.num_gpus=2", f"autotuning.results_dir={tmp_path / 'r'}"])
    session = open_session(cfg, dry_run=True)
    start = measured("z1_gas2_tmbspg4", 100.0, interval=0.0, trial=0, tbs=16)
    start.params = {"stage": 1, "micro_batch": 4, "gas": 2}
    best = measured("z1_gas2_tmbspg8", 160.0, interval=0.0, trial=1, tbs=32)
    best.params = {"stage": 1, "micro_batch": 8, "gas": 2}
    e = run_estimate(session, Outcome(best=best, stage_best={1: best}, measured=[start, best], experiments=2))
    assert e.lines[0] == "Full-run estimate: 1,000 steps (the script's --max_steps) x 16 samples per step (your batch size) = 16,000 samples."
    assert "the same samples take 500 of its steps" in e.lines[1]
    assert e.metrics["estimate.start_hours"] == pytest.approx(16000 / 100 / 3600)
    assert e.metrics["estimate.saved_gpu_hours"] == pytest.approx(2 * 16000 / 3600 * (1 / 100 - 1 / 160))
    # the ds_config as given never ran: the summary says so instead of a figure
    e = run_estimate(session, Outcome(best=best, stage_best={1: best}, measured=[best], experiments=1))
    assert e.lines[-1] == "  Your starting configuration: z1_gas2_tmbspg4 was not measured in this session, so there is no time to compare with."


def test_steps_without_a_batch_of_the_users_count_at_the_optimums():
    best = measured("z1_gas1_tmbspg16", 160.0, tbs=32)
    e = full_run(Planned("steps", 100, "autotuning.planned_steps"), best, None, "the ds_config lists the micro-batch sizes [2, 4], not one",
                 metric="throughput", world_size=2, user_batch=None)
    assert e.lines[0] == "Full-run estimate: 100 steps (autotuning.planned_steps) x 32 samples per step (the optimum's: the ds_config gives no single batch size) = 3,200 samples."
    assert e.metrics["estimate.optimum_hours"] == pytest.approx(3200 / 160 / 3600)
