"""The replay benchmark's parts: the landscape runner and the product search replayed on a synthetic landscape."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ds_baseline  # noqa: E402
import replay  # noqa: E402
import synthetic  # noqa: E402
from landscape import LandscapeRunner, interpolation, make_experiment  # noqa: E402

NAME = "synthetic_bert-large_8xT4-16GB_fp32"


@pytest.fixture(scope="module")
def land():
    return synthetic.landscape(NAME, synthetic.MODELS[NAME])


def test_the_oom_edge_moves_up_with_the_stage_and_half_precision_fits_more(land):
    m = synthetic.MODELS[NAME]
    edge = {s: max(p["params"]["micro_batch"] for p in land["points"] if p["status"] == "ok" and p["params"]["stage"] == s) for s in range(4)}
    assert edge[0] < edge[1] <= edge[2] < edge[3]
    half = synthetic.evaluate({**m, "half": True}, {"stage": 0, "micro_batch": edge[0] + 1, "gas": 1})
    assert synthetic.evaluate(m, {"stage": 0, "micro_batch": edge[0] + 1, "gas": 1})[0] == "oom" and half[0] == "ok"


def test_runner_looks_points_up_and_counts_time(land):
    runner = LandscapeRunner(land)
    point = land["points"][0]
    result = runner(make_experiment(point["params"]))
    assert result.status == point["status"] and runner.calls == 1 and runner.wall_time_s == point["wall_time_s"]
    assert runner(make_experiment({"stage": 0, "micro_batch": 10_000, "gas": 1})).status == "oom"


def test_the_product_search_replayed_ends_on_a_successful_run_near_the_best(land):
    calls, found, runner = replay.replay(land, "model_based", seed=0)
    best = max(p["metrics"]["throughput"] for p in land["points"] if p["status"] == "ok")
    assert found is not None and found >= 0.95 * best
    assert len(calls) <= 50


def test_the_deepspeed_baseline_runs_on_the_same_landscape(land):
    runner = LandscapeRunner(land, lambda p: synthetic.evaluate(synthetic.MODELS[NAME], p))
    calls, best = ds_baseline.run(runner, replay.plan_of(land), land["world_size"], land["memory_limit_bytes"])
    assert calls and best is not None and runner.value(best) > 0


def recorded_point(mbs, status="ok", step_ms=None, peak=None, stage=1):
    metrics = {} if status != "ok" else {"throughput": mbs * 2 / (step_ms / 1000), "latency": step_ms, "FLOPS_per_gpu": 1e9, "peak_memory_bytes": peak, "step_time_spread": 0.05}
    return {"params": {"stage": stage, "micro_batch": mbs, "gas": 1}, "status": status, "metrics": metrics, "wall_time_s": 20.0 + mbs}


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
