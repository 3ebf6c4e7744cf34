"""Synthetic GPU-like landscapes from an analytic model (python benchmarks/synthetic.py writes them).

Per rank and ZeRO stage:
- memory = ZeRO model states (mlautotune.memory's formula: precision, AdamW, partitioning over the
  data-parallel degree) + 2 GiB runtime + activations per sample x micro-batch + communication
  buffers (reduce and all-gather buckets, stage-3 prefetch bucket) in the gradient dtype.
  Over the device memory -> oom.
- step time = compute + exposed communication + bucket overheads + optimizer step:
  compute = 6 x params x tokens x micro-batch x gas / (peak FLOPS x efficiency), efficiency
  0.6 x mbs / (mbs + 3) (small batches under-use the device);
  communication = gradient bytes / bandwidth x (2 for stages 0-1 all-reduce, 1.5 for stage 2
  reduce-scatter + all-gather, 3 for stage 3 which also gathers parameters twice), of which
  overlap_comm hides 55% (15% without), with a latency cost of 3 ms per bucket (small buckets cost
  more) and, above 5e8, less overlap (large buckets start late);
  optimizer step = 16 bytes x params / dp / 1.5e12 B/s.
- a seeded +-2% measurement noise; step_time_spread 0.02; wall time = 45 s start-up + 10 steps.
"""

import itertools
import math
import random
from pathlib import Path

import yaml

from landscape import save
from mlautotune.memory import MemoryModel

GiB = 2**30
HERE = Path(__file__).parent
CONF = HERE.parent / "conf" / "space"

MODELS = {
    "synthetic_gpt2-medium_8xA100-40GB_bf16": dict(params=355e6, tokens=1024, act=0.30 * GiB, world=8, mem=40 * GiB, half=True, flops=312e12, bw=150e9),
    "synthetic_gpt-1.3b_16xV100-32GB_fp16": dict(params=1.3e9, tokens=1024, act=0.9 * GiB, world=16, mem=32 * GiB, half=True, flops=125e12, bw=20e9),
    "synthetic_bert-large_8xT4-16GB_fp32": dict(params=340e6, tokens=512, act=0.35 * GiB, world=8, mem=16 * GiB, half=False, flops=8e12, bw=8e9),
}


def spaces():
    return {s: yaml.safe_load((CONF / f"zero{s}.yaml").read_text()) or {} for s in range(4)}


def evaluate(m, params, seed=0):
    stage, mbs, gas = params["stage"], params["micro_batch"], params["gas"]
    ds = {"optimizer": {"type": "AdamW"}, **({"bf16": {"enabled": True}} if m["half"] else {})}
    mem_model = MemoryModel(int(m["params"]), int(m["params"]), ds, m["world"], 1, m["mem"], "cuda")
    dtype = 2 if m["half"] else 4
    rbs = params.get("reduce_bucket_size", 5e8)
    agbs = params.get("allgather_bucket_size", 5e8) if stage in (1, 2) else 0
    prefetch = params.get("stage3_prefetch_bucket_size", 5e7) if stage == 3 else 0
    peak = mem_model.model_states(stage) + 2 * GiB + m["act"] * mbs + (rbs + agbs + prefetch) * dtype * (2 if params.get("contiguous_gradients") else 1)
    if peak > m["mem"]:
        return "oom", {"peak_memory_bytes": peak}, 30.0
    dp = m["world"]
    compute = 6 * m["params"] * m["tokens"] * mbs * gas / (m["flops"] * 0.6 * mbs / (mbs + 3))
    grad_bytes = m["params"] * dtype
    comm = grad_bytes / m["bw"] * {0: 2.0, 1: 2.0, 2: 1.5, 3: 3.0}[stage]
    if stage == 2 and params.get("reduce_scatter") is False:
        comm *= 1.25
    hidden = 0.55 if params.get("overlap_comm", stage == 3) else 0.15
    hidden *= 1.0 if rbs <= 5e8 else 0.7
    buckets = grad_bytes / rbs
    if stage == 3:
        buckets += m["params"] * dtype / max(prefetch, 1e7) * 0.5
        if params.get("stage3_param_persistence_threshold", 1e5) >= 1e6:
            comm *= 0.95
    step = compute + comm * (1 - hidden) + 0.003 * buckets + 16 * m["params"] / dp / 1.5e12
    rng = random.Random(f"{seed}-{sorted(params.items())}")
    step *= 1 + rng.uniform(-0.02, 0.02)
    tbs = mbs * gas * m["world"]
    metrics = {
        "throughput": tbs / step, "latency": step * 1000, "FLOPS_per_gpu": 6 * m["params"] * m["tokens"] * mbs * gas / step,
        "peak_memory_bytes": peak, "step_time_spread": 0.02, "train_batch_size": tbs,
        "num_params": int(m["params"]), "trainable_num_params": int(m["params"]),
    }
    return "ok", metrics, 45.0 + 10 * step


def landscape(name, m):
    space = spaces()
    points = []
    for stage in range(4):
        knobs = space[stage]
        mbs = 1
        while True:
            fitted = False
            for combo in itertools.product(*knobs.values()):
                params = {"stage": stage, "micro_batch": mbs, "gas": 1, **dict(zip(knobs, combo))}
                status, metrics, wall = evaluate(m, params)
                fitted |= status == "ok"
                points.append({"params": params, "status": status, "metrics": metrics, "wall_time_s": wall})
            if not fitted and mbs > 2:
                break  # one micro-batch past the edge is recorded, larger ones are OOMs by definition
            mbs += 1 if mbs < 16 else max(1, mbs // 8)
    plan = {"stages": [0, 1, 2, 3], "micro_batch": {"mode": "min", "values": [1]}, "gas": 1, "fast": False,
            "knobs": {s: {k: list(v) for k, v in space[s].items()} for s in range(4)}, "base_config": {"optimizer": {"type": "AdamW"}, **({"bf16": {"enabled": True}} if m["half"] else {})}}
    return {"name": name, "description": __doc__.splitlines()[0], "source": "synthetic", "world_size": m["world"],
            "memory_limit_bytes": m["mem"], "metric": "throughput", "device": "cuda", "startup_s": 45.0, "plan": plan, "points": points}


if __name__ == "__main__":
    (HERE / "landscapes").mkdir(exist_ok=True)
    for name, m in MODELS.items():
        land = landscape(name, m)
        save(HERE / "landscapes" / f"{name}.json", land)
        ok = [p for p in land["points"] if p["status"] == "ok"]
        best = max(ok, key=lambda p: p["metrics"]["throughput"])
        print(f"{name}: {len(land['points'])} points, best {best['metrics']['throughput']:.1f} samples/s at {best['params']}")
