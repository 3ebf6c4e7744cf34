"""The replay benchmark's parts: the landscape runner and the product search replayed on a synthetic landscape."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ds_baseline  # noqa: E402
import replay  # noqa: E402
import synthetic  # noqa: E402
from landscape import LandscapeRunner, make_experiment  # noqa: E402

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
