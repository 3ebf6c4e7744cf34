"""benchmarks/record.py: a landscape recorded from real 2-rank CPU DeepSpeed runs, then replayed."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY_MODEL

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import replay  # noqa: E402
from landscape import load  # noqa: E402

pytestmark = pytest.mark.e2e


def test_record_runs_the_grid_stops_a_stage_at_its_oom_and_resumes(tmp_path):
    ds = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1},
        "autotuning": {"enabled": True, "fast": True, "memory_limit_per_rank": "1200MiB", "start_profile_step": 2, "end_profile_step": 3,
                       "arg_mappings": {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size", "gradient_accumulation_steps": "--gradient_accumulation_steps"}},
    }
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(ds))
    out = tmp_path / "land.json"
    # Start-up alone takes 0.6-0.7 GiB per rank (it varies by machine); 65536 samples of 32 tokens need
    # 2 GiB for the logits alone, so 1200 MiB leaves room at 2 and 4 and none at 65536; 131072 is past
    # that OOM, never run.
    cmd = [sys.executable, str(ROOT / "benchmarks" / "record.py"), str(out), "--micro-batches", "2,4,65536,131072", "--",
           f"config={config}", "launcher.num_gpus=2", "script_args=" + " ".join(TINY_MODEL)]
    kept = tmp_path / "kept"
    first = subprocess.run(cmd[:3] + ["--keep", str(kept)] + cmd[3:], capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    land = load(out)
    got = {p["params"]["micro_batch"]: p for p in land["points"]}
    assert sorted(got) == [2, 4, 65536], [(m, p["status"], p.get("reason")) for m, p in got.items()]
    assert got[2]["status"] == got[4]["status"] == "ok" and got[2]["metrics"]["throughput"] > 0 and got[2]["wall_time_s"] > 0
    assert got[65536]["status"] == "oom" and got[65536]["metrics"]["peak_memory_bytes"] > 1200 * 2**20
    assert land["source"] == "recorded" and land["world_size"] == 2 and land["plan"]["stages"] == [1]
    assert len(list(kept.rglob("exp.json"))) == 3  # --keep: the experiment folders stay there

    # A rerun resumes: nothing recorded is run again; --repeats 2 measures each point that ran once more.
    again = subprocess.run(cmd[:3] + ["--repeats", "2"] + cmd[3:], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "(2 run now" in again.stdout, again.stderr[-2000:]
    land = load(out)
    assert len(land["points"]) == 3 and land["repeats"] == 2
    for p in land["points"]:
        draws = [d["metrics"]["throughput"] for d in p.get("draws", [])]
        assert len(draws) == (2 if p["status"] == "ok" else 0)
        if draws:  # the first draw is the first pass's measurement; the point's value is their median
            assert draws[0] == got[p["params"]["micro_batch"]]["metrics"]["throughput"]
            assert p["metrics"]["throughput"] == pytest.approx(sum(draws) / 2)

    # --contenders 0: only the point with the best median is measured again, up to --contender-repeats draws.
    third = subprocess.run(cmd[:3] + ["--repeats", "2", "--contenders", "0", "--contender-repeats", "3"] + cmd[3:], capture_output=True, text=True,
                           timeout=600)
    assert third.returncode == 0 and "(1 run now" in third.stdout, third.stderr[-2000:]
    land = load(out)
    ok = [p for p in land["points"] if p["status"] == "ok"]
    best = max(ok, key=lambda p: statistics.median(d["metrics"]["throughput"] for d in p["draws"] if d["status"] == "ok"))
    assert [len(p["draws"]) for p in ok] == [3 if p is best else 2 for p in ok] and land["contenders"] == {"within": 0.0, "repeats": 3}

    # The product search replayed on it: micro-batches between the recorded ones are interpolated,
    # and an interpolated point is ok exactly when its peak fits the limit.
    runner, found = replay.replay(land, "gridsearch", seed=0)
    assert found is not None and runner.true_value(found) > 0 and runner.calls == len(runner.log)
    assert any(e["params"]["micro_batch"] not in got for e in runner.log)
    for e in runner.log:
        if e["status"] == "ok":
            assert runner.truth(e["params"])[1]["peak_memory_bytes"] <= 1200 * 2**20
