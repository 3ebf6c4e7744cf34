"""The replay benchmark: the GPU-like landscapes (gpu_model.py), the runner's noise, the scoring, the
tables, and the product search and the DeepSpeed baseline replayed on known landscapes. Pure: no launches."""

import ast
import json
import math
import statistics
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import gpu_model  # noqa: E402
import replay  # noqa: E402
import resolution  # noqa: E402
import tables  # noqa: E402
from landscape import LandscapeRunner, interpolation, load, save  # noqa: E402

MIDPEAK = "gpu_midpeak_gpt2-medium_8xA100-40GB_bf16"
BIG = "gpu_10b_only-z3_16xA100-40GB_fp16"
KNOB = "gpu_knob-z2_bert-large_8xT4-16GB_fp16"
FLAT = "gpu_flat_gpt-350m_8xH100-80GB_bf16"
TIE = "gpu_tie_gpt-1.3b_16xV100-32GB_fp16"


@pytest.fixture(scope="module")
def lands():
    return {name: gpu_model.landscape(name, m) for name, m in gpu_model.MODELS.items()}


def true(p):
    return p["metrics"]["true_throughput"]


def ok(land, stage=None):
    return [p for p in land["points"] if p["status"] == "ok" and (stage is None or p["params"]["stage"] == stage)]


def stage_best(land, stage):
    return max(ok(land, stage), key=true)


def knob_worth(land, stage, knob):
    """max / min - 1 over the knob's values, the other params at the stage's best."""
    best = stage_best(land, stage)["params"]
    values = [true(p) for p in ok(land, stage) if all(p["params"][k] == v for k, v in best.items() if k != knob)]
    return max(values) / min(values) - 1


def test_the_benchmark_shares_no_code_with_the_product():
    for name in ("gpu_model.py", "landscape.py", "ds_baseline.py", "tables.py"):
        tree = ast.parse((BENCH / name).read_text())
        modules = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        modules += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [m for m in modules if m.startswith("mlautotune")], name


def test_the_committed_gpu_landscapes_are_what_the_model_writes(lands):
    for name, land in lands.items():
        stored = load(BENCH / "landscapes" / f"{name}.json")
        assert stored["model"] == json.loads(json.dumps(land["model"])) and len(stored["points"]) == len(land["points"])
        assert [p["params"] for p in stored["points"][:50]] == [p["params"] for p in land["points"][:50]]


def test_a_mid_batch_peak_that_falls_towards_the_edge(lands):
    land = lands[MIDPEAK]
    best = max(ok(land), key=true)
    same = sorted((p for p in ok(land) if {k: v for k, v in p["params"].items() if k != "micro_batch"} ==
                   {k: v for k, v in best["params"].items() if k != "micro_batch"}), key=lambda p: p["params"]["micro_batch"])
    assert 11 <= best["params"]["micro_batch"] <= 13
    assert 20 <= same[-1]["params"]["micro_batch"] <= 24 and true(same[-1]) < 0.8 * true(best)


def test_a_first_stage_that_cannot_fit_micro_batch_1(lands):
    land = lands[BIG]
    assert not ok(land, 0) and not ok(land, 1)
    assert max(ok(land), key=true)["params"]["stage"] == 3
    edge = {s: max(p["params"]["micro_batch"] for p in ok(land, s)) for s in (2, 3)}
    assert edge[2] * 2 <= edge[3]


def test_a_knob_worth_15_to_25_percent_in_one_stage_only(lands):
    land = lands[KNOB]
    assert 0.15 <= knob_worth(land, 2, "reduce_scatter") <= 0.25
    assert "reduce_scatter" not in land["plan"]["knobs"]["1"] and "reduce_scatter" not in land["plan"]["knobs"]["3"]
    for stage in (1, 3):
        assert all(knob_worth(land, stage, k) < 0.12 for k in land["plan"]["knobs"][str(stage)])


def test_a_flat_plateau(lands):
    land = lands[FLAT]
    best = true(max(ok(land), key=true))
    assert all(true(stage_best(land, s)) >= 0.97 * best for s in range(4))
    z2 = stage_best(land, 2)["params"]
    plateau = [true(p) for p in ok(land, 2) if p["params"]["micro_batch"] >= 16 and {k: v for k, v in p["params"].items() if k != "micro_batch"} ==
               {k: v for k, v in z2.items() if k != "micro_batch"}]
    assert min(plateau) >= 0.97 * max(plateau)


def test_a_near_tie_between_stages(lands):
    land = lands[TIE]
    tops = sorted((true(stage_best(land, s)) for s in range(4)), reverse=True)
    assert tops[1] >= 0.99 * tops[0] and tops[2] < 0.95 * tops[0]


def test_knobs_change_memory(lands):
    params = {"stage": 2, "micro_batch": 8, "gas": 1, "reduce_bucket_size": 5e7, "allgather_bucket_size": 5e7,
              "overlap_comm": False, "reduce_scatter": True, "contiguous_gradients": False}
    small, _ = gpu_model.memory(gpu_model.MODELS[KNOB], params)
    big, _ = gpu_model.memory(gpu_model.MODELS[KNOB], {**params, "reduce_bucket_size": 1e9, "overlap_comm": True, "contiguous_gradients": True})
    assert big - small > 2 * 1e9 * 2  # two reduce buckets and a contiguous buffer of 1e9 fp16 elements


def test_every_measurement_is_a_fresh_seeded_draw_within_3_percent(lands):
    land = lands[MIDPEAK]
    params = stage_best(land, 2)["params"]
    runner = LandscapeRunner(land, seed=1)
    draws = [runner.measure(params)[1] for _ in range(20)]
    truth = draws[0]["true_throughput"]
    assert len({d["throughput"] for d in draws}) == 20 and all(abs(d["throughput"] / truth - 1) <= 0.03 for d in draws)
    assert all(d["true_throughput"] == truth for d in draws) and runner.true_value(params) == truth
    again = LandscapeRunner(land, seed=1)
    assert [again.measure(params)[1]["throughput"] for _ in range(20)] == [d["throughput"] for d in draws]
    assert len(runner.log) == 20 and runner.wall_time_s == pytest.approx(20 * runner.log[0]["wall_time_s"])


def test_the_kth_measurement_of_a_configuration_draws_the_same_noise_whatever_was_measured_before_it(lands):
    """Common random numbers: two searches compared on one seed differ by what they chose, not by
    draws reshuffled because one of them measured something else first."""
    land = lands[MIDPEAK]
    a, b = stage_best(land, 2)["params"], stage_best(land, 3)["params"]
    first, second = LandscapeRunner(land, seed=7), LandscapeRunner(land, seed=7)
    one = [first.measure(p)[1]["throughput"] for p in (a, a, b)]
    two = [second.measure(p)[1]["throughput"] for p in (b, a, a)]
    assert one == [two[1], two[2], two[0]] and one[0] != one[1]
    assert [e["observed"] for e in first.log] == one  # the log holds what the search saw beside the truth
    assert LandscapeRunner(land, seed=8).measure(a)[1]["throughput"] != one[0]  # another seed, other noise


def test_the_trace_shows_each_experiment_with_what_the_search_saw_and_the_truth():
    run = {"landscape": "land", "strategy": "model_based", "seed": 3, "workers": 2, "found": 90.0,
           "log": [{"params": {"stage": 0, "micro_batch": 4}, "status": "ok", "value": 90.0, "observed": 99.0, "why": "z0: micro-batch 4 may reach 120"},
                   {"params": {"stage": 0, "micro_batch": 32}, "status": "oom", "value": None, "observed": None}]}
    lines = replay.trace(run, 100.0).splitlines()
    assert lines[0] == "# land model_based seed 3 workers 2"
    assert "seen 0.990 true 0.900" in lines[1] and "micro_batch=4" in lines[1] and lines[1].endswith("(z0: micro-batch 4 may reach 120)")
    assert "oom" in lines[2] and "seen - true -" in lines[2] and lines[3] == "declared: true 0.900"


def test_a_point_recorded_once_returns_its_recorded_value_at_every_measurement():
    land = {"world_size": 2, "memory_limit_bytes": 2**40, "points": [recorded_point(4, step_ms=100, peak=1), recorded_point(8, step_ms=180, peak=1)]}
    runner = LandscapeRunner(land, seed=3)
    params = land["points"][0]["params"]
    assert runner.measure(params)[1]["throughput"] == runner.measure(params)[1]["throughput"] == land["points"][0]["metrics"]["throughput"]
    assert runner.true_value(params) == land["points"][0]["metrics"]["throughput"]


def test_a_point_recorded_several_times_is_scored_by_its_median_and_measured_as_one_of_its_draws(tmp_path):
    """record.py --repeats: the truth is the median of the recorded measurements, and each replayed
    measurement is one of them (with its own interval), or, between recorded sizes, the nearest one's
    deviation from its median."""
    def draw(step_ms, interval):
        p = recorded_point(4, step_ms=step_ms, peak=500)
        return {"status": "ok", "metrics": {**p["metrics"], "interval_rel": interval}, "wall_time_s": step_ms / 10}
    four = {**recorded_point(4, step_ms=100, peak=500), "draws": [draw(100, 0.01), draw(80, 0.02), draw(125, 0.03), {"status": "oom", "metrics": {}, "wall_time_s": 1.0}]}
    eight = recorded_point(8, step_ms=180, peak=700)
    path = tmp_path / "land.json"
    save(path, {"world_size": 2, "memory_limit_bytes": 2**40, "points": [four, eight]})
    land = load(path)
    params = four["params"]
    runner = LandscapeRunner(land, seed=5)
    assert runner.true_value(params) == pytest.approx(8 / 0.100) and land["points"][0]["wall_time_s"] == pytest.approx(10.0)
    answers = [runner.measure(params) for _ in range(40)]
    assert {a[0] for a in answers} == {"ok", "oom"}  # the recorded OOM too (memory near the edge varies)
    assert [e["value"] is None for e in runner.log] == [a[0] == "oom" for a in answers]
    got = [a[1] for a in answers if a[0] == "ok"]
    assert {round(m["throughput"], 6) for m in got} == {round(8 / t, 6) for t in (0.100, 0.080, 0.125)}
    assert all(m["interval_rel"] == {80.0: 0.01, 100.0: 0.02, 64.0: 0.03}[round(m["throughput"], 6)] for m in got)
    again = LandscapeRunner(land, seed=5)
    assert [again.measure(params)[:2] for _ in range(40)] == [a[:2] for a in answers]  # the seed decides
    between = {**params, "micro_batch": 5}  # nearer 4 than 8: 4's deviations from its median, on the interpolated truth
    truth = runner.true_value(between)
    ratios = {round(runner.measure(between)[1]["throughput"] / truth, 6) for _ in range(40)}
    assert ratios == {1.0, 0.8, 1.25}
    assert LandscapeRunner(land, seed=5).measure(eight["params"])[1]["throughput"] == eight["metrics"]["throughput"]  # recorded once


def test_the_resolution_of_a_recorded_truth_is_how_often_its_best_stays_best_when_its_draws_are_resampled():
    """resolution.py: a best whose draws all lie above a rival's stays best in every resample; of two
    points whose draws differ by 0.01 ms each, neither is resolved; a latency landscape's best is its
    lowest median; a landscape with no point drawn twice has nothing to resample."""
    def point(mbs, step_ms_draws, stage=1):
        p = recorded_point(mbs, step_ms=step_ms_draws[0], peak=1, stage=stage)
        return {**p, "draws": [{"status": "ok", "metrics": recorded_point(mbs, step_ms=t, peak=1)["metrics"], "wall_time_s": 1.0} for t in step_ms_draws]}

    apart = {"name": "apart", "points": [point(4, [100, 101, 102, 103, 104]), point(4, [120, 121, 122, 123, 124], stage=2)]}
    r = resolution.resolve(apart, resamples=300)
    assert r["best"]["stage"] == 1 and r["best_wins"] == 1.0 and r["best_within_99"] == 1.0 and len(r["rivals"]) == 1
    alike = {"name": "alike", "points": [point(4, [100, 90, 110, 95, 105]), point(4, [104.99, 94.99, 109.99, 89.99, 99.99], stage=2)]}
    r = resolution.resolve(alike, resamples=2000)  # stage 2's median is 0.01% the faster: neither is resolved
    assert r["best"]["stage"] == 2 and 0.3 < r["best_wins"] < 0.7 and len(r["rivals"]) == 2 and r["rivals"][1]["wins"] > 0.3
    assert r["rivals"][1]["median_vs_best"] == pytest.approx(0.9999, abs=1e-4)
    assert r["best_error"] > 0.02 and r["draws"] == 5
    assert resolution.resolve({**apart, "metric": "latency"}, resamples=50)["best"]["stage"] == 1
    assert resolution.resolve({"name": "once", "points": [recorded_point(4, step_ms=100, peak=1)]}) is None


def recorded_point(mbs, status="ok", step_ms=None, peak=None, stage=1):
    metrics = {} if status != "ok" else {"throughput": mbs * 2 / (step_ms / 1000), "latency": step_ms, "FLOPS_per_gpu": 1e9, "peak_memory_bytes": peak, "step_time_spread": 0.05}
    return {"params": {"stage": stage, "micro_batch": mbs, "gas": 1}, "status": status, "metrics": metrics, "wall_time_s": 20.0 + mbs}


def test_the_contenders_measured_again_are_the_points_within_a_fraction_of_the_best_median():
    import record

    def point(mbs, value, status="ok"):
        return {"params": {"stage": 0, "micro_batch": mbs}, "status": status, "metrics": {"throughput": value, "latency": 1000.0 / value},
                "draws": [{"status": status, "metrics": {"throughput": value}}]}

    land = {"metric": "throughput", "points": [point(1, 50.0), point(2, 91.0), point(4, 100.0), point(8, 89.9), point(16, 1.0, "oom")]}
    assert [p["params"]["micro_batch"] for p in record.contenders(land, 0.1)] == [2, 4]
    assert [p["params"]["micro_batch"] for p in record.contenders(land, 0.0)] == [4]
    land["metric"] = "latency"  # lower is better: within 10% above the lowest latency (10 ms)
    assert [p["params"]["micro_batch"] for p in record.contenders(land, 0.1)] == [2, 4]


def test_recorded_landscapes_interpolate_between_recorded_micro_batches():
    MiB = 2**20
    land = {"world_size": 2, "memory_limit_bytes": 1000 * MiB, "points": [
        recorded_point(4, step_ms=100, peak=600 * MiB), recorded_point(8, step_ms=180, peak=700 * MiB),
        recorded_point(16, step_ms=340, peak=900 * MiB), recorded_point(32, "oom"),
    ]}
    answer = interpolation(land)
    status, metrics, wall = answer({"stage": 1, "micro_batch": 6, "gas": 1})
    assert status == "ok" and metrics["latency"] == pytest.approx(140) and metrics["peak_memory_bytes"] == pytest.approx(650 * MiB)
    assert metrics["throughput"] == pytest.approx(6 * 2 / 0.140) and wall == pytest.approx(26.0)
    assert metrics["FLOPS_per_gpu"] == pytest.approx(1e9 * 0.1 / 4 * 6 / 0.14)  # the same FLOPs per sample
    assert answer({"stage": 1, "micro_batch": 18, "gas": 1})[0] == "ok"  # extrapolated peak 950 MiB fits
    assert answer({"stage": 1, "micro_batch": 21, "gas": 1})[0] == "oom"  # extrapolated peak 1025 MiB does not
    assert answer({"stage": 1, "micro_batch": 40, "gas": 1})[0] == "oom"  # at or above a recorded OOM
    assert answer({"stage": 2, "micro_batch": 6, "gas": 1})[0] == "oom"  # nothing recorded for these knobs
    status, gas2, _ = answer({"stage": 1, "micro_batch": 8, "gas": 2})  # another gas: same samples/s, twice the step
    assert status == "ok" and gas2["throughput"] == pytest.approx(8 * 2 / 0.18) and gas2["latency"] == pytest.approx(360)


def entry(value, status="ok", wall=3600.0):
    return {"params": {}, "status": status, "value": value, "wall_time_s": wall}


def test_scoring_counts_experiments_to_95_and_99_percent_and_regret_against_true_values():
    runs = [{"landscape": "L", "strategy": "model_based", "seed": 0, "found": 96.0,
             "log": [entry(50.0), entry(None, "oom"), entry(96.0), entry(None, "oom"), entry(99.5)]},
            {"landscape": "L", "strategy": "random", "seed": 0, "found": None, "log": [entry(90.0), entry(None, "oom")]}]
    a, b = replay.score(runs, grid_best=100.0)
    assert (a["to95"], a["to99"], a["experiments"], a["failures"], a["after99"]) == (3, 5, 5, 2, 0)
    assert a["regret"] == pytest.approx(0.04) and a["wall_hours"] == 5 and a["wall_hours_to99"] == 5
    assert (b["to95"], b["to99"], b["wall_hours_to99"], b["regret"]) == (None, None, None, 1.0)
    assert set(a) >= {"landscape", "strategy", "seed", "to95", "to99", "regret", "experiments", "wall_hours", "wall_hours_to99"}


def test_the_best_is_the_best_true_value_seen_anywhere():
    runs = [{"landscape": "L", "strategy": "gridsearch", "seed": 0, "found": 110.0, "log": [entry(110.0)]}]
    assert replay.score(runs, grid_best=100.0)[0]["regret"] == 0.0


def test_never_counts_as_a_miss_in_the_tables():
    assert tables.steps([3, None, None]) == "never (2/3 never)"
    assert tables.steps([3, 5, None]) == "5 (1/3 never)"
    assert tables.median([1, None, None, None]) == math.inf
    assert tables.ratio(math.inf, 10) == math.inf and tables.ratio(5, math.inf) == 0.0 and tables.ratio(5, 10) == 0.5
    records = [{"landscape": "L", "strategy": s, "seed": i, "to95": t, "to99": t, "regret": 0.01, "experiments": 9, "wall_hours": 1.0,
                "wall_hours_to99": None, "failures": 0, "after99": None} for s, ts in (("model_based", (None, None, 4)), ("deepspeed_baseline", (8, 8, 8)))
               for i, t in enumerate(ts)]
    text = tables.targets(records)
    assert "| L | never (2/3 never) | 8 | never |" in text


def test_the_readmes_show_what_tables_py_prints_from_the_records():
    """Every table row and figure line that `python benchmarks/tables.py` prints from benchmarks/results/
    and landscapes/ stands in README.md or benchmarks/README.md as printed: no figure there without its record."""
    readmes = (BENCH.parent / "README.md").read_text() + (BENCH / "README.md").read_text()
    printed = [line for line in tables.all_tables().splitlines() if line.startswith(("| ", "- "))]
    missing = [line for line in printed if line not in readmes]
    assert len(printed) > 50 and not missing, missing[:5]


def test_the_product_replays_and_each_measurement_again_is_a_fresh_draw(lands):
    """The replay declares a configuration that runs; measuring it again draws new noise (the k-th
    measurement of a configuration the same draw in every replay with the seed), around its truth."""
    land = {**lands[FLAT], "plan": {**lands[FLAT]["plan"], "fast": True}}  # fast mode: fewer experiments
    runner, found = replay.replay(land, "model_based", seed=0)
    assert found is not None and runner.true_value(found) is not None
    before = sum(e["params"] == found for e in runner.log)  # the search's own measurements of it
    seen = [runner.measure(found)[1]["throughput"] for _ in range(6)]
    again = replay.LandscapeRunner(land, seed=0)
    assert len(set(seen)) == 6 and [again.measure(found)[1]["throughput"] for _ in range(before + 6)][before:] == seen
    assert abs(statistics.mean(seen) / runner.true_value(found) - 1) < 0.05


def test_the_deepspeed_baseline_on_the_mid_peak_landscape_stops_at_a_plateau_and_ends_far_from_the_best(lands):
    land = lands[MIDPEAK]
    runner, found = replay.replay(land, "deepspeed_baseline", seed=0)
    log = [e["params"] for e in runner.log]
    assert (log[0]["stage"], log[0]["micro_batch"]) == (3, 1)  # the model-info run
    z0 = [p["micro_batch"] for p in log if p["stage"] == 0]
    assert z0[0] == 1 and z0[1] > 22  # the forward-delta estimate puts the first guesses beyond the edge
    assert not any(p.get("reduce_bucket_size") == 50000000 for p in log)  # z1 is slower than z0: no knob tuning anywhere
    best = max(true(p) for p in ok(land))
    assert runner.true_value(found) < 0.95 * best  # its pick is a single noisy measurement of an untuned config


def test_the_deepspeed_baseline_on_the_10b_landscape_skips_stages_by_its_memory_estimate(lands):
    land = lands[BIG]
    runner, found = replay.replay(land, "deepspeed_baseline", seed=0)
    stages = {e["params"]["stage"] for e in runner.log}
    assert 0 not in stages and 1 not in stages  # fp16 states 2/2/16 per param do not fit: no experiment there
    assert found is not None and found["stage"] == 3


def test_simulated_workers_run_the_real_tuner_concurrently_in_simulated_time(lands):
    """4 workers on one study: up to 4 experiments in flight, none run twice (re-measurements
    apart), the log in finish order, and wall hours are the simulated finish times."""
    land = {**lands[FLAT], "plan": {**lands[FLAT]["plan"], "fast": True}}
    runner, found = replay.replay(land, "model_based", seed=0, workers=4)
    ends = [e["end_s"] for e in runner.log]
    assert found is not None and ends == sorted(ends)
    starts = [end - e["wall_time_s"] for e, end in zip(runner.log, ends)]
    most = max(sum(s - 1e-6 <= t + 1e-3 < end for s, end in zip(starts, ends)) for t in starts)  # just after each start
    assert most == 4  # four in flight at once, never more
    first = [json.dumps(e["params"], sort_keys=True) for e in runner.log[:4]]
    assert len(set(first)) == 4  # the first four are four different experiments, started together
    assert all(e["why"] for e in runner.log)  # each with the search's reason for it (replay.py --trace prints it)
    rec = replay.score([{"landscape": "L", "strategy": "model_based", "seed": 0, "workers": 4, "log": runner.log, "found": 1.0}], 1.0)[0]
    assert rec["workers"] == 4 and rec["wall_hours"] * 3600 == pytest.approx(ends[-1])
    assert ends[-1] < sum(e["wall_time_s"] for e in runner.log) / 2


def test_one_simulated_worker_is_the_sequential_search(lands):
    land = {**lands[FLAT], "plan": {**lands[FLAT]["plan"], "fast": True}}
    runner, _ = replay.replay(land, "model_based", seed=0, workers=1)
    walls = [e["wall_time_s"] for e in runner.log]
    assert [e["end_s"] for e in runner.log] == pytest.approx([sum(walls[:i + 1]) for i in range(len(walls))])


def test_the_workers_table_reports_wall_hours_to_99_against_n_and_the_baseline_as_sequential():
    def rec(strategy, workers, w99, seed=0):
        return {"landscape": "L", "strategy": strategy, "seed": seed, "workers": workers, "to95": 1, "to99": None if w99 is None else 4,
                "regret": 0.0, "experiments": 5, "wall_hours": 1.0, "wall_hours_to99": w99, "failures": 0, "after99": 0}
    records = [rec("model_based", 1, 1.0), rec("model_based", 2, 0.6), rec("model_based", 4, 0.3), rec("deepspeed_baseline", 1, 2.0)]
    text = tables.workers_table(records)
    assert "| L | model_based | 1.00 (4) | 0.60 (4) | 0.30 (4) |" in text
    assert "| L | deepspeed_baseline | 2.00 (4) | sequential: 1 worker only | sequential: 1 worker only |" in text
    assert "with 4 workers / with 1, median over 1 landscapes: 0.30 (target <= 0.35" in text
    assert "deepspeed_baseline: sequential" in text
    missed = tables.workers_table([rec("model_based", 1, 1.0), rec("model_based", 4, None)])
    assert "| L | model_based | 1.00 (4) | never (1/1 never) |" in missed and "median over 1 landscapes: never" in missed
    assert tables.landscape_table(records, "L").count("model_based") == 1  # the per-landscape tables are the 1-worker runs
