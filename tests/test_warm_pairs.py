"""The warm-start pairs (benchmarks/warm_pairs.py): a generated landscape and a perturbed copy of the
said kind, deterministic per seed, and a pair replayed end to end through replay.py's adapter. Pure:
no launches."""

import ast
import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import generator  # noqa: E402
import warm_pairs  # noqa: E402

SEEDS = range(12)


def test_the_pairs_reach_the_product_only_through_the_replay_adapter():
    tree = ast.parse((BENCH / "warm_pairs.py").read_text())
    modules = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    modules += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in modules if m.startswith("mlautotune")] and "replay" in modules


@pytest.mark.parametrize("kind", warm_pairs.KINDS)
def test_a_perturbation_is_deterministic_per_seed_and_of_its_kind(kind):
    for seed in SEEDS:
        a, b = generator.make(seed), warm_pairs.perturb(seed, kind)
        assert json.dumps(b, sort_keys=True) == json.dumps(warm_pairs.perturb(seed, kind), sort_keys=True)
        ta, tb = a["traits"], b["traits"]
        assert tb["params"] == ta["params"] and tb["perturbed"]["kind"] == kind and b["name"] == f"gen_{seed}_{kind}"
        assert warm_pairs.valid(tb)
        if kind == "speed":
            assert (tb["gpus"], tb["gpu_memory_gb"]) == (ta["gpus"], ta["gpu_memory_gb"])
            assert b["memory_limit_bytes"] == a["memory_limit_bytes"] and b["world_size"] == a["world_size"]
            for k, f in tb["perturbed"]["factors"].items():
                assert 0.1 - 1e-9 <= abs(f - 1) <= 0.3 + 1e-9 and tb[k] == pytest.approx(min(0.99, ta[k] * f) if k == "overlap_efficiency" else ta[k] * f)
            assert len({round(f, 6) for f in tb["perturbed"]["factors"].values()}) > 1, "one global factor only"
        elif kind == "memory":
            assert tb["gpu_memory_gb"] != ta["gpu_memory_gb"] and tb["gpu_memory_gb"] in (16, 24, 32, 40, 48, 80)
            assert b["memory_limit_bytes"] == tb["gpu_memory_gb"] * generator.GB and tb["gpus"] == ta["gpus"]
        else:
            assert tb["gpus"] != ta["gpus"] and b["world_size"] == tb["gpus"] and tb["gpu_memory_gb"] == ta["gpu_memory_gb"]
            assert (tb["network_bytes_s"] is None) == (tb["gpus"] <= 8)
    assert warm_pairs.perturb(0, kind)["traits"] != warm_pairs.perturb(1, kind)["traits"]


def test_the_speed_perturbation_moves_the_optimum_on_some_seeds():
    moved = [s for s in range(30) if generator.best(generator.make(s))["params"] != generator.best(warm_pairs.perturb(s, "speed"))["params"]]
    assert moved


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="one of speed, memory, gpus"):
        warm_pairs.perturb(0, "network")


def small(land):
    """The landscape with one knob set per stage: a pair replays in seconds."""
    return {**land, "plan": {**land["plan"], "knobs": {s: {} for s in land["plan"]["knobs"]}}}


def test_a_pair_replays_cold_on_a_then_warm_and_cold_on_b_and_is_scored():
    seed = 16
    a = small(generator.make(seed))
    bs = [small(warm_pairs.perturb(seed, k)) for k in ("speed", "gpus")]
    result = warm_pairs.run_pairs(seed, a, bs, trace=True)
    assert result["a"]["landscape"] == "gen_16" and result["a"]["experiments"] > 0
    assert [p["kind"] for p in result["pairs"]] == ["speed", "gpus"]
    for p, b in zip(result["pairs"], bs):
        cold, warm = p["records"]
        assert (cold["start"], warm["start"]) == ("cold", "warm") and cold["landscape"] == warm["landscape"] == b["name"]
        assert p["best"] == generator.best(b)["value"]
        for r in (cold, warm):
            assert r["seed"] == seed and 0 <= r["regret"] <= 1 and r["experiments"] > 0 and (r["to99"] is None or r["to99"] >= 1)
        assert p["trace"].startswith(f"# {b['name']} model_based seed {seed}")
    speed = result["pairs"][0]
    assert any("warm start: the earlier optimum" in line for line in speed["trace"].splitlines()[1:4]), \
        "on the same hardware the warm run measures the earlier optimum among its first experiments"
    assert speed["records"][1]["experiments"] < speed["records"][0]["experiments"]
    lines = warm_pairs.lines(result)
    assert lines[0].startswith("seed 16 speed [speed ") and "warm to99" in lines[0]
    text = warm_pairs.summary([result])
    assert "| speed | 1 |" in text and "| gpus | 1 |" in text and "| all | 2 |" in text


def test_the_table_counts_never_as_infinity_and_judges_the_target():
    def rec(to99, regret):
        return {"to99": to99, "regret": regret, "experiments": 10}

    pairs = [(rec(21, 0.01), rec(5, 0.01)), (rec(None, 0.02), rec(9, 0.01)), (rec(12, 0.0), rec(None, 0.0))]
    text, met = warm_pairs.row("x", pairs)
    assert "| 21 (1 never) | 9 (1 never) |" in text and "2 / 1 (p = 1)" in text
    assert not met  # 9 > 21 / 3
    text, met = warm_pairs.row("x", pairs[:2])
    assert met and "| never (1 never) | 7 (0 never) |" in text
    assert warm_pairs.ratio(math.inf, 3) == math.inf and warm_pairs.ratio(2, math.inf) == 0.0
