"""Measurement truth: the window's statistics directly, the probe's accelerator synchronisation, then
real 2-rank CPU launches (noisy and quiet step times) and a mode=run session read back from MLflow."""

import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlautotune.run import measure
from mlautotune.inputs.config import MeasureConf
from mlautotune.run.experiment import run_experiment
from mlautotune.run.probe import Probe

SETTINGS = {"target_interval": 0.02, "budget_s": 3.0, "max_warmup_steps": 10, "warmup_tolerance": 0.1, "confidence": 0.95,
            "check_every": 2, "adaptive": True, "max_cpu_wait": 0.05, "pin_cpu_ranks": True, "synchronize": True}


# ---------- the statistics ----------

def binomial_coverage(n: int, j: int) -> float:
    """P(x_(j) <= median <= x_(n+1-j)) for a continuous distribution, from first principles."""
    return 1 - 2 * sum(math.comb(n, i) for i in range(j)) / 2**n


@pytest.mark.parametrize("n", [6, 9, 20, 51, 200])
def test_median_interval_uses_the_tightest_order_statistics_with_95_percent_coverage(n):
    x = list(range(1, n + 1))  # x_(k) = k
    random.Random(n).shuffle(x)
    med, lo, hi = measure.median_interval(x)
    assert med == statistics.median(x) and lo + hi == n + 1  # symmetric ranks
    j = lo
    assert binomial_coverage(n, j) >= 0.95 > binomial_coverage(n, j + 1)


def test_fewest_steps_is_where_the_range_first_covers_the_median_with_the_confidence():
    n = measure.fewest_steps(0.95)
    assert n == 6 and binomial_coverage(n, 1) >= 0.95 > binomial_coverage(n - 1, 1)
    assert measure.fewest_steps(0.5) == 2


def test_a_few_close_steps_do_not_reach_the_target():
    d = measure.decide([1.0, 1.001, 1.002], 0.1, 3, SETTINGS)  # +-0.1%, but 3 values cover the median only 75% of the time
    assert d.interval_rel < SETTINGS["target_interval"] and not d.target_reached and not d.stop


def test_median_interval_of_few_values_is_the_whole_range():
    assert measure.median_interval([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)
    assert measure.interval_rel([1.0]) == math.inf
    with pytest.raises(ValueError):
        measure.median_interval([])


def test_median_interval_covers_the_true_median_about_95_percent_of_the_time():
    rng = random.Random(7)
    hits = 0
    for _ in range(2000):
        sample = [rng.lognormvariate(0.0, 0.5) for _ in range(25)]  # skewed: the median is exp(0) = 1
        _, lo, hi = measure.median_interval(sample)
        hits += lo <= 1.0 <= hi
    assert 0.94 <= hits / 2000 <= 0.995


def _stretches(rng: random.Random, n: int, rho: float) -> list:
    """Step times around a median of 100 that come in slow and fast stretches: AR(1) with lag-1 correlation rho."""
    x, out = rng.gauss(0, 10), []
    for _ in range(n):
        out.append(100 + x)
        x = rho * x + rng.gauss(0, 10 * math.sqrt(1 - rho * rho))
    return out


def _covers(times: list) -> bool:
    med, rel = statistics.median(times), measure.interval_rel(times)
    return med * (1 - rel) <= 100 <= med * (1 + rel)


def test_the_interval_keeps_its_coverage_when_step_times_come_in_stretches():
    """Measured here: window step times follow each other (lag-1 correlation up to 0.66 in 30-37 steps),
    and an interval that takes them for independent ones covers the median ~80% of the time at 0.5."""
    rng = random.Random(3)
    windows = [_stretches(rng, 40, 0.5) for _ in range(600)]
    assert sum(map(_covers, windows)) / len(windows) >= 0.92
    as_if_independent = sum(lo <= 100 <= hi for _, lo, hi in map(measure.median_interval, windows)) / len(windows)
    assert as_if_independent < 0.88  # what the interval would claim without the effective size


def test_the_effective_size_leaves_independent_steps_nearly_alone():
    rng = random.Random(4)
    windows = [_stretches(rng, 40, 0.0) for _ in range(600)]
    assert sum(map(_covers, windows)) / len(windows) >= 0.94
    widths = [measure.interval_rel(w) / (max(m - lo, hi - m) / m) for w in windows for m, lo, hi in [measure.median_interval(w)]]
    assert statistics.mean(widths) < 1.15
    assert measure.effective_size([1.0, 2.0] * 20) == 40  # alternating: negative correlation counts as none
    assert measure.effective_size([1.0] * 5 + [2.0] * 4) == 9  # too few steps to estimate it


def test_a_window_that_drifts_gets_a_wider_interval_than_the_same_steps_shuffled():
    rng = random.Random(5)
    drifting = [100 + 6 * math.sin(2 * math.pi * i / 40) + rng.gauss(0, 2) for i in range(40)]  # a slow and a fast stretch
    shuffled = random.Random(6).sample(drifting, len(drifting))
    assert measure.interval_rel(drifting) > 1.5 * measure.interval_rel(shuffled)


def test_interval_rel_shrinks_with_more_steps_and_grows_with_noise():
    rng = random.Random(1)
    quiet = [0.1 * (1 + rng.gauss(0, 0.02)) for _ in range(200)]
    noisy = [0.1 * (1 + abs(rng.gauss(0, 0.5))) for _ in range(200)]
    assert measure.interval_rel(quiet[:10]) > measure.interval_rel(quiet) < 0.01
    assert measure.interval_rel(noisy) > 5 * measure.interval_rel(quiet)


def test_warmup_skips_leading_slow_steps_within_the_cap():
    settled = [1.0, 1.02, 0.98, 1.01, 0.99, 1.0, 1.03, 0.97]
    assert measure.warmup_steps(settled, 0.1, 10, 3) == 0
    assert measure.warmup_steps([3.0, 2.0, 1.5, *settled], 0.1, 10, 3) == 3
    assert measure.warmup_steps([3.0, 2.0, 1.5, *settled], 0.1, 2, 3) == 2  # the cap
    assert measure.warmup_steps([3.0, 2.0, 1.5, 1.0, 1.0], 0.1, 10, 3) == 2  # the minimum window is kept
    assert measure.warmup_steps([3.0, 2.0, 1.5, 1.4, 1.0, 1.0], 0.1, 10, 1) == 3  # at most half the steps


def test_decide_stops_at_the_target_or_the_budget_never_before_the_minimum():
    quiet = [1.0 + 0.001 * (i % 3) for i in range(12)]
    d = measure.decide([5.0, *quiet], elapsed_s=1.0, min_steps=3, settings=SETTINGS)
    assert d.stop and d.target_reached and not d.disturbed and d.warmup == 1 and d.interval_rel <= 0.02
    noisy = [1.0, 1.5, 0.8, 1.3, 0.9, 1.6, 1.1, 0.7]
    assert not measure.decide(noisy, 1.0, 3, SETTINGS).stop  # target not reached, budget left
    late = measure.decide(noisy, 3.5, 3, SETTINGS)
    assert late.stop and not late.target_reached and late.interval_rel > 0.02  # the budget is spent: stop, wider interval
    assert not late.disturbed  # noisy steps alone are imprecision, not a disturbance
    assert not measure.decide([1.0, 1.0], 99.0, 3, SETTINGS).stop  # never before the user's minimum window


RECORDED = json.loads((Path(__file__).parent / "data" / "step_times_shared_cpu.json").read_text())


def test_on_recorded_noisy_steps_the_window_grows_and_stops_at_the_budget():
    """The probe's stop rule replayed on real step times (a CPU shared with other work, per-step CV ~20%)."""
    times = [t / 1000 for t in RECORDED["step_times_ms"]]
    start, end = 3, 5
    n, d = measure.replay(times, start, end, SETTINGS)
    measured = times[:n - start + 1]
    assert n > end + 2  # it grew well past the user's minimum window ...
    assert sum(measured) >= SETTINGS["budget_s"] > sum(measured[:-SETTINGS["check_every"]])  # ... to the first check after the budget
    assert d.stop and not d.target_reached and d.interval_rel > SETTINGS["target_interval"] and not d.disturbed
    assert d.interval_rel == measure.interval_rel(measured[d.warmup:])
    longer, _ = measure.replay(times, start, end, {**SETTINGS, "budget_s": 2 * SETTINGS["budget_s"]})
    assert longer > n  # a larger budget measures more steps
    # The same steps with their noise shrunk 20x around the median: the target is reached long before the budget.
    med = statistics.median(times)
    quiet = [med + (t - med) / 20 for t in times]
    m, q = measure.replay(quiet, start, end, SETTINGS)
    assert q.stop and q.target_reached and sum(quiet[:m - start + 1]) < SETTINGS["budget_s"] and m < n


def test_a_window_that_waited_for_cpus_is_disturbed_and_goes_on_to_the_budget():
    quiet = [1.0] * 12
    contended = measure.decide(quiet, 1.0, 3, SETTINGS, cpu_wait=0.3)
    assert not contended.stop and contended.disturbed
    assert contended.interval_rel == 0.3  # the steps agree, but 30% of the window went to another process: +-30%
    assert measure.decide(quiet, 3.5, 3, SETTINGS, cpu_wait=0.3).stop


def test_a_step_time_that_shifts_mid_window_is_disturbed_with_an_interval_of_the_shift():
    rng = random.Random(3)
    before = [1.0 + rng.uniform(-0.05, 0.05) for _ in range(12)]
    after = [1.3 + rng.uniform(-0.05, 0.05) for _ in range(12)]  # something started on the machine mid-window
    assert measure.step_time_shift(before + after) == pytest.approx(abs(statistics.median(before) - statistics.median(after))
                                                                    / statistics.median(before + after))
    d = measure.decide(before + after, 1.0, 3, SETTINGS)
    assert d.disturbed and not d.stop and d.interval_rel >= measure.step_time_shift(before + after) > 0.2
    assert measure.step_time_shift(before + before) == 0.0  # the same regime throughout
    assert measure.step_time_shift(before[:5] + after[:5]) == 0.0  # halves too short to tell
    calm = [1.0 + rng.uniform(-0.05, 0.05) for _ in range(24)]
    assert not measure.decide(calm, 1.0, 3, SETTINGS).disturbed


def test_the_fixed_window_stops_at_once_and_skips_no_warm_up():
    fixed = {**SETTINGS, "adaptive": False}
    d = measure.decide([5.0, 1.0, 1.5], 0.1, 3, fixed)
    assert d.stop and d.warmup == 0 and not d.target_reached


def test_cpu_wait_counts_time_runnable_without_a_cpu():
    before_thread = measure.cpu_wait_seconds(this_thread=True)
    if before_thread is None:
        pytest.skip("no schedstat on this system")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(measure.usable_cores())]
    try:
        deadline = time.perf_counter() + 1.5
        while time.perf_counter() < deadline:
            pass  # runnable all the time, sharing the cores with the hogs
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    thread_total = measure.cpu_wait_seconds(this_thread=True)
    process_total = measure.cpu_wait_seconds()  # read after the thread: it holds all the thread's waiting and more
    assert thread_total - before_thread > 0.1  # the thread was kept waiting
    # within the process's sum over its threads (totals: another thread of pytest's that ended meanwhile
    # takes its own waiting out of the process's sum, so the differences need not compare)
    assert process_total >= thread_total


def test_defaults_are_in_conf_and_keep_an_experiment_short():
    conf = MeasureConf()
    assert conf.adaptive and conf.target_interval == 0.02
    assert conf.budget_s <= 5.0  # an experiment of ~15-20 s may grow by at most 25%
    assert set(SETTINGS) == set(conf.__dataclass_fields__)


@pytest.mark.parametrize("bad", [{"target_interval": 0}, {"budget_s": -1}, {"check_every": 0}, {"confidence": 1.0}])
def test_measure_settings_out_of_range_are_a_user_error(bad):
    from omegaconf import OmegaConf

    from mlautotune.inputs.config import MLAutotuneConf, validate
    from mlautotune.errors import UserError

    cfg = OmegaConf.structured(MLAutotuneConf)
    validate(cfg)
    cfg.measure = OmegaConf.merge(cfg.measure, bad)
    with pytest.raises(UserError, match="measure settings are out of range"):
        validate(cfg)


def test_threads_per_cpu_rank_divide_the_cores_unless_the_user_decided():
    cores = measure.usable_cores()
    assert measure.thread_env("cpu", 2, [], environ={}) == {"OMP_NUM_THREADS": str(max(1, cores // 2))}
    assert measure.thread_env("cpu", 4 * cores, [], environ={}) == {"OMP_NUM_THREADS": "1"}
    assert measure.thread_env("cpu", 2, [], environ={"OMP_NUM_THREADS": "3"}) == {}  # the user's own setting
    assert measure.thread_env("cpu", 2, ["--bind_cores_to_rank"], environ={}) == {}  # DeepSpeed divides them
    assert measure.thread_env("cuda", 2, [], environ={}) == {}


def test_pinning_gives_each_local_rank_its_own_share_of_the_tuners_cores():
    share = str(max(1, measure.usable_cores() // 2))
    assert measure.thread_env("cpu", 2, [], pin=True, environ={}) == {"OMP_NUM_THREADS": share, measure.PIN_VARIABLE: share}
    assert measure.thread_env("cpu", 2, ["--bind_cores_to_rank"], pin=True, environ={}) == {}  # DeepSpeed binds them
    assert measure.thread_env("cuda", 2, [], pin=True, environ={}) == {}
    assert measure.thread_env("cpu", 4 * measure.usable_cores(), [], pin=True, environ={}) == {"OMP_NUM_THREADS": "1"}  # more ranks than cores
    # the tuner's own cores (taskset, a cpuset), in order, split as DeepSpeed's --bind_cores_to_rank splits them
    assert measure.rank_cores({9, 4, 6, 2}, 0, 2) == [2, 4] and measure.rank_cores({9, 4, 6, 2}, 1, 2) == [6, 9]
    assert measure.rank_cores([0, 1], 1, 1) == [1]
    assert measure.rank_cores([0, 1], 3, 1) == [0, 1]  # more ranks than cores: no core of its own, none taken away
    assert measure.pin_rank(environ={}) is None  # not asked: nothing pinned


def test_pin_rank_pins_the_calling_process_to_its_share():
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this OS")
    cores = sorted(os.sched_getaffinity(0))
    code = "import json, os; from mlautotune.run import measure; print(json.dumps([measure.pin_rank(), sorted(os.sched_getaffinity(0))]))"
    env = {**os.environ, measure.PIN_VARIABLE: "1", "LOCAL_RANK": str(len(cores) - 1)}
    pinned, affinity = json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout)
    assert pinned == affinity == [cores[-1]]  # the last local rank, one core each: the last core


# ---------- the probe synchronises the accelerator inside the window only ----------

def test_probe_synchronises_the_real_accelerator_at_step_boundaries_in_the_window(tmp_path, monkeypatch):
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    synchronize = accelerator.synchronize
    calls = []

    def observed(*args, **kwargs):
        calls.append(len(probe.ends) + 1)  # the step whose end is being synchronised
        return synchronize(*args, **kwargs)

    monkeypatch.setattr(accelerator, "synchronize", observed)
    probe = Probe(str(tmp_path), {"start_profile_step": 4, "end_profile_step": 1000, "measure": SETTINGS})
    probe.accelerator = accelerator
    for _ in range(7):
        probe.on_step(engine=None)  # the window never closes here, so the engine is never read
    assert calls == [3, 4, 5, 6, 7]  # the window opens at the end of step start-1; nothing before is slowed
    assert len(probe.step_times(7)) == 4 and all(t > 0 for t in probe.step_times(7))


def test_measure_synchronize_false_leaves_the_accelerator_unsynchronised(tmp_path, monkeypatch):
    """Only for showing what the sync changes (benchmarks/gpu_check.py): the window's steps end when the host is done."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    calls = []
    monkeypatch.setattr(accelerator, "synchronize", lambda *args, **kwargs: calls.append(1))
    probe = Probe(str(tmp_path), {"start_profile_step": 4, "end_profile_step": 1000, "measure": {**SETTINGS, "synchronize": False}})
    probe.accelerator = accelerator
    for _ in range(7):
        probe.on_step(engine=None)
    assert calls == [] and len(probe.step_times(7)) == 4


def test_final_training_end_to_end_time_leaves_out_the_probes_own_time(tmp_path):
    """End to end after warm-up: every step of the script from the first measured one to the last, but not
    the time the probe spent between steps on its window checks (the user's own training will not have it)."""
    probe = Probe(str(tmp_path), {"start_profile_step": 3, "end_profile_step": 5, "measure": SETTINGS})
    clock = 0.0
    for step in range(1, 11):  # steps of 0.1 s, then 0.05 s of the probe's own work after each
        clock += 0.1
        probe.ends.append(clock)
        clock += 0.05
        probe.starts.append(clock)
    probe.rank, probe.window, probe.metrics = 0, {"first": 4, "last": 6}, {"train_batch_size": 8}
    probe.at_script_end()
    m = probe.metrics
    assert m["end_to_end_steps"] == 7 and m["end_to_end_seconds"] == pytest.approx(0.7)  # steps 4..10, 0.1 s each
    assert m["end_to_end_throughput"] == pytest.approx(8 / 0.1)
    assert json.loads((tmp_path / "metrics.json").read_text())["end_to_end_throughput"] == pytest.approx(80.0)


# ---------- real launches: 2 CPU ranks, a tiny model with controlled step times ----------

TIMED = Path(__file__).parent / "scripts" / "timed_gpt.py"
TINY = ["--num_layers", "1", "--hidden_size", "32", "--num_heads", "2", "--seq_len", "32", "--vocab_size", "256"]


def timed_experiment(tiny_experiment, sleep, jitter, steps, **measure_settings):
    exp = tiny_experiment(script=TIMED, script_args=["--sleep", str(sleep), "--jitter", str(jitter), "--steps", str(steps), *TINY],
                          start_profile_step=3, end_profile_step=5, timeout_s=600.0)
    exp.measure.update(measure_settings)
    exp.env.update(measure.thread_env("cpu", 2, [], pin=True))  # as a session sets it
    exp.ds_config["optimizer"]["params"]["torch_adam"] = True  # no JIT-built op: other worktrees rebuild it on a shared machine
    exp.resources.master_port = random.randrange(30000, 60000)  # away from other sessions' 29500 on a shared machine
    return exp


def run_ok(exp, tmp_path):
    """Run the experiment for real; its result (it must be ok) and metrics."""
    result = run_experiment(exp, tmp_path)
    assert result.status == "ok", result.reason
    return result, result.metrics


@pytest.mark.e2e
def test_noisy_steps_grow_the_window_until_the_budget(tiny_experiment, tmp_path, leftovers):
    # Steps of 20-120 ms, uniformly: the median is known to +-2% only after hundreds of steps.
    exp = timed_experiment(tiny_experiment, 0.02, 0.1, 500, budget_s=3.0)
    result, m = run_ok(exp, tmp_path)
    assert m["target_reached"] is False and m["interval_rel"] > exp.measure["target_interval"]
    assert m["measure_seconds"] >= exp.measure["budget_s"]  # it stopped at the budget ...
    assert m["last_measured_step"] < 500 and m["window_cut_by_script"] is False  # ... not at the script's end
    assert measure.cut_short_note(m) is None
    assert m["last_measured_step"] > exp.end_profile_step  # the window grew past the minimum
    assert m["measured_steps"] == len(m["step_times_ms"]) == m["last_measured_step"] - m["first_measured_step"] + 1
    assert m["first_measured_step"] == exp.start_profile_step + m["warmup_steps"]
    steps_interval = measure.interval_rel(m["step_times_ms"])  # widened by what a disturbance (a busy shared machine) may have cost
    wait, shift = m["thread_wait_share"], m["step_time_shift"]
    cost = max(wait if wait > exp.measure["max_cpu_wait"] else 0.0, shift if shift > exp.measure["target_interval"] else 0.0)
    assert m["interval_rel"] == pytest.approx(max(steps_interval, cost)) and m["disturbed"] == (cost > 0)
    assert m["threads_per_rank"] >= 1 and m["cores_pinned"] is True
    ranks = [json.loads((Path(result.exp_dir) / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["cores"] for r in ranks) and (measure.usable_cores() < 2 or not set(ranks[0]["cores"]) & set(ranks[1]["cores"]))
    assert leftovers(result.exp_dir) == []


@pytest.mark.e2e
def test_a_script_that_ends_before_the_window_is_done_is_flagged_with_advice(tiny_experiment, tmp_path, leftovers):
    # The noisy steps above, but the script trains 12 steps: its end closes the window, short of the target and the budget.
    exp = timed_experiment(tiny_experiment, 0.02, 0.1, 12, budget_s=3.0)
    result, m = run_ok(exp, tmp_path)
    assert m["window_cut_by_script"] is True and m["target_reached"] is False and m["last_measured_step"] == 12
    assert m["measure_seconds"] < exp.measure["budget_s"]
    note = measure.cut_short_note(m)
    assert "script ended before" in note and "more steps" in note
    assert leftovers(result.exp_dir) == []


def test_the_advice_is_only_for_a_window_the_script_cut_short_of_its_target():
    cut = {"window_cut_by_script": True, "target_reached": False}
    assert "more steps" in measure.cut_short_note(cut)
    assert measure.cut_short_note({**cut, "target_reached": True}) is None  # precise enough anyway
    assert measure.cut_short_note({**cut, "window_cut_by_script": False}) is None  # the budget ended it
    assert measure.cut_short_note({}) is None  # a result from before the key existed


@pytest.mark.e2e
def test_quiet_steps_stop_before_the_budget_within_the_target(tiny_experiment, tmp_path, leftovers):
    # Steps of ~100 ms, nearly all of it a sleep: quiet unless the machine is very busy (then the window is rightly disturbed).
    exp = timed_experiment(tiny_experiment, 0.1, 0.0, 500, budget_s=20.0, max_cpu_wait=1.0)
    result, m = run_ok(exp, tmp_path)
    assert m["disturbed"] is False and m["target_reached"] is True and m["interval_rel"] <= exp.measure["target_interval"]
    assert m["measure_seconds"] < exp.measure["budget_s"] and m["last_measured_step"] < 500 and m["window_cut_by_script"] is False
    assert m["measured_steps"] >= exp.end_profile_step - exp.start_profile_step + 1
    assert leftovers(result.exp_dir) == []


@pytest.mark.e2e
def test_mode_run_records_final_over_tuned_on_the_parent_run(tmp_path):
    """Tune one configuration, then train with it: the final training's end-to-end throughput after warm-up
    is on its child run, and final / tuned on the parent run (read back from a real MLflow store)."""
    from mlflow.tracking import MlflowClient

    from conftest import MAPPINGS

    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": [2], "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                                  "zero_optimization": {"stage": 0},
                                  "autotuning": {"enabled": True, "start_profile_step": 3, "end_profile_step": 5, "arg_mappings": MAPPINGS,
                                                 "tuner_type": "gridsearch", "tuner_num_trials": 1}}))
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    script_args = " ".join(["--sleep", "0.06", "--jitter", "0", "--steps", "40", *TINY])
    proc = subprocess.run([sys.executable, "-m", "mlautotune", f"config={config}", f"script={TIMED}", f"script_args={script_args}",
                           "launcher.num_gpus=2", f"launcher.master_port={random.randrange(30000, 60000)}", "mode=run"],
                          cwd=tmp_path, env={**os.environ, "MLFLOW_TRACKING_URI": store}, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "final / tuned = " in out

    client = MlflowClient(store)
    found = client.search_runs([e.experiment_id for e in client.search_experiments()])
    (parent,) = [r for r in found if r.data.tags.get("mlautotune.role") == "session"]
    (final,) = [r for r in found if r.data.tags.get("mlautotune.role") == "final_training"]
    (tuned,) = [r for r in found if r.data.tags.get("experiment") == "z0_gas1_tmbspg2"]
    e2e, tuned_tp = final.data.metrics["end_to_end_throughput"], tuned.data.metrics["throughput"]
    assert parent.data.metrics["final_over_tuned"] == pytest.approx(e2e / tuned_tp)
    assert 0.25 < parent.data.metrics["final_over_tuned"] < 4  # the same work (no wall-clock bound: the machine may be shared)
    assert {"interval_rel", "warmup_steps", "measured_steps", "measure_seconds", "disturbed", "threads_per_rank"} <= set(tuned.data.metrics)
    metrics = json.loads((tmp_path / "autotuning_results" / "final_training" / "metrics.json").read_text())
    assert metrics["end_to_end_steps"] == 40 - metrics["first_measured_step"] + 1  # every step after warm-up, to the script's end
