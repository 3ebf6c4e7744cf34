"""GPU-like landscapes from an analytic model written independently of the product.

    python benchmarks/gpu_model.py        # writes benchmarks/landscapes/gpu_*.json and prints what each looks like

This module imports nothing from mlautotune (and nothing from synthetic.py): memory, compute and
communication are modelled here from scratch, with other functional forms, so that a search whose
own memory model or cost model happens to match this one gains nothing from it. The knob spaces
are the product's `conf/space/zero<N>.yaml`, read as data.

Per rank, for ZeRO stage s, micro-batch m, gradient accumulation g and the stage's knobs:

memory (bytes) = context + (1 + fragmentation) x (model states + buffers + activations x m)
- model states: mixed precision (fp16/bf16) keeps 2 B/param weights, 2 B/param gradients and
  12 B/param fp32 master weights and Adam moments; fp32 4 + 4 + 8. Stage >= 1 partitions the
  optimizer part over the data-parallel degree, >= 2 also the gradients, 3 also the weights.
- buffers, from the knobs: the gradient reduction bucket (reduce_bucket_size elements, doubled by
  overlap_comm, which keeps two in flight), the all-gather bucket of stages 1-2, stage 2's
  contiguous gradient buffer (contiguous_gradients), stage 3's prefetch bucket and the parameters
  it keeps gathered below stage3_param_persistence_threshold.
- fragmentation: 10% of the allocated bytes, 4% with contiguous_gradients (stage 2).
- the forward-pass delta (what DeepSpeed's model-info run measures as activation memory) is
  `fwd_share` of the activations; the backward adds the rest.

step time = g x compute + exposed communication + optimizer step
- compute = 6 x params x tokens x m / (peak FLOPS x e(m)); e(m) = e_max x (1 - exp(-m / m0)) is a
  saturation curve in the micro-batch. Near the memory limit the caching allocator has to free and
  retry: above `pressure` of the memory the compute slows by 1 + k x excess^2, which puts the
  throughput peak before the memory edge where k is large.
- communication per ring collective: bytes x (W - 1) / W / bandwidth + one latency per bucket.
  Stages 0-1 all-reduce the gradients once per step, stage 2 reduce-scatters them every micro-step
  (all-reduce when reduce_scatter is off), stage 3 reduce-scatters them and all-gathers the weights
  twice per micro-step; stages 1-2 all-gather the updated weights after the step. overlap_comm hides
  the gradient reduction behind `window` (90%) of the backward, less its last bucket (so huge
  buckets hide less); without it 10% is hidden. contiguous_gradients off makes reductions 1.5x more latency-bound.
  Stage 3's weight gathers are hidden by prefetching in proportion prefetch / (prefetch + layer), and
  its hooks cost `hook_s` per layer, forward and backward, every micro-step.
- optimizer step: the local optimizer states read and written once at memory bandwidth.

Measurement: every measurement draws a multiplicative noise factor uniform in [1 - 3%, 1 + 3%]
(seeded); `metrics` hold the noisy values and `true_throughput`, `true_latency` and
`true_FLOPS_per_gpu` the noise-free ones. A landscape file stores one noisy draw per point plus
the model (`generator`, `model`), so a replay can draw fresh noise for each re-measurement and
answer points outside the stored grid.
"""

import itertools
import math
import random
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import yaml

GiB = 2**30
HERE = Path(__file__).parent
SPACES = HERE.parent / "conf" / "space"
NOISE = 0.03
DEFAULTS = {  # DeepSpeed's defaults for knobs a point does not name
    "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8, "reduce_scatter": True, "contiguous_gradients": True,
    "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e5, "stage3_max_live_parameters": 1e9,
}

# The five landscapes. Units: bytes, FLOP/s, bytes/s, seconds.
MODELS: Dict[str, Dict[str, Any]] = {
    # (a) throughput peaks at micro-batch 11-13, then allocator pressure pulls it down towards the edge at ~22.
    "gpu_midpeak_gpt2-medium_8xA100-40GB_bf16": dict(
        params=355e6, tokens=1024, layers=24, world=8, mem=40 * GiB, precision="bf16", peak_flops=312e12, e_max=0.55, m0=3.0,
        act=1.55 * GiB, fwd_share=0.55, context=1.5 * GiB, pressure=0.55, k=0.9, bw=120e9, latency=4e-4, mem_bw=1.5e12, hook_s=3e-4, startup_s=70.0),
    # (b) a 10B model: stages 0-1 cannot hold even micro-batch 1, stage 2 fits a few, only ZeRO-3 fits well.
    "gpu_10b_only-z3_16xA100-40GB_fp16": dict(
        params=10e9, tokens=2048, layers=48, world=16, mem=40 * GiB, precision="fp16", peak_flops=312e12, e_max=0.5, m0=1.5,
        act=1.6 * GiB, fwd_share=0.5, context=1.5 * GiB, pressure=0.9, k=0.5, bw=90e9, latency=5e-4, mem_bw=1.5e12, hook_s=3e-4, startup_s=180.0),
    # (c) slow interconnect, little backward to hide the reduction behind: reduce_scatter (stage 2 only) is worth ~20%.
    "gpu_knob-z2_bert-large_8xT4-16GB_fp16": dict(
        params=340e6, tokens=512, layers=24, world=8, mem=16 * GiB, precision="fp16", peak_flops=65e12, e_max=0.45, m0=4.0,
        act=0.42 * GiB, fwd_share=0.6, context=1.0 * GiB, pressure=0.92, k=0.4, bw=2.5e9, latency=1e-4, mem_bw=0.3e12, hook_s=3e-3, window=0.1, startup_s=60.0),
    # (d) a flat plateau: compute-bound with fast links; from micro-batch 16 on, within 3%, and stages within 2.5%.
    "gpu_flat_gpt-350m_8xH100-80GB_bf16": dict(
        params=350e6, tokens=1024, layers=24, world=8, mem=80 * GiB, precision="bf16", peak_flops=900e12, e_max=0.5, m0=1.2,
        act=1.5 * GiB, fwd_share=0.55, context=2.0 * GiB, pressure=0.95, k=0.0, bw=400e9, latency=1e-5, mem_bw=3.0e12, hook_s=5e-5, startup_s=60.0),
    # (e) a near-tie between stages: stages 1 and 2 end within ~1% of each other.
    "gpu_tie_gpt-1.3b_16xV100-32GB_fp16": dict(
        params=1.3e9, tokens=1024, layers=24, world=16, mem=32 * GiB, precision="fp16", peak_flops=125e12, e_max=0.45, m0=2.0,
        act=1.2 * GiB, fwd_share=0.5, context=1.2 * GiB, pressure=0.92, k=0.6, bw=25e9, latency=5e-4, mem_bw=0.9e12, hook_s=4e-4, startup_s=90.0),
}


def spaces() -> Dict[int, Dict[str, list]]:
    return {s: yaml.safe_load((SPACES / f"zero{s}.yaml").read_text()) or {} for s in range(4)}


def knob(params: Dict[str, Any], name: str, stage: int) -> Any:
    if name in params:
        return params[name]
    if name == "overlap_comm":
        return stage == 3  # DeepSpeed: on by default in stage 3 only
    return DEFAULTS[name]


def memory(m: Dict[str, Any], params: Dict[str, Any]) -> Tuple[float, float]:
    """(peak bytes per rank, forward-pass activation delta) of one configuration."""
    stage, mbs, n, w = params["stage"], params["micro_batch"], m["params"], m["world"]
    half = m["precision"] in ("fp16", "bf16")
    g = 2 if half else 4
    weights, grads, optim = g * n, g * n, (12 if half else 8) * n
    optim /= w if stage >= 1 else 1
    grads /= w if stage >= 2 else 1
    weights /= w if stage >= 3 else 1
    overlap = knob(params, "overlap_comm", stage)
    rbs = knob(params, "reduce_bucket_size", stage)
    buffers = rbs * g * (2 if overlap else 1)
    if stage in (1, 2):
        buffers += knob(params, "allgather_bucket_size", stage) * g
    if stage == 2 and knob(params, "contiguous_gradients", stage):
        buffers += rbs * g
    if stage == 3:
        persistent = 0.08 if knob(params, "stage3_param_persistence_threshold", stage) >= 1e6 else 0.02
        live = min(knob(params, "stage3_max_live_parameters", stage), 2 * n / m["layers"])
        buffers += knob(params, "stage3_prefetch_bucket_size", stage) * g + persistent * n * g + live * g
    frag = 0.04 if stage == 2 and knob(params, "contiguous_gradients", stage) else 0.10
    activations = m["act"] * mbs
    return m["context"] + (1 + frag) * (weights + grads + optim + buffers + activations), m["fwd_share"] * activations


def step_time(m: Dict[str, Any], params: Dict[str, Any], peak: float) -> float:
    stage, mbs, gas, n, w = params["stage"], params["micro_batch"], params["gas"], m["params"], m["world"]
    g = 2 if m["precision"] in ("fp16", "bf16") else 4
    eff = m["e_max"] * (1 - math.exp(-mbs / m["m0"]))
    compute = 6 * n * m["tokens"] * mbs / (m["peak_flops"] * eff)
    excess = max(0.0, (peak / m["mem"] - m["pressure"]) / (1 - m["pressure"]))
    compute *= 1 + m["k"] * excess**2
    backward = compute * 2 / 3
    ring = (w - 1) / w

    def collective(nbytes: float, bucket_elems: float, latency_factor: float = 1.0) -> float:
        return nbytes * ring / m["bw"] + math.ceil(nbytes / (bucket_elems * g)) * m["latency"] * latency_factor

    overlap = knob(params, "overlap_comm", stage)
    rbs = knob(params, "reduce_bucket_size", stage)
    contiguous = knob(params, "contiguous_gradients", stage) if stage == 2 else True
    lat = 1.0 if contiguous else 1.5
    grad_bytes = n * g
    if stage in (0, 1):
        reduce, per_step = collective(2 * grad_bytes, rbs, lat), 1
    elif stage == 2:
        reduce, per_step = collective(grad_bytes if knob(params, "reduce_scatter", stage) else 2 * grad_bytes, rbs, lat), gas
    else:
        reduce, per_step = collective(grad_bytes, rbs, lat), gas
    last_bucket = min(rbs * g, grad_bytes) * ring / m["bw"]
    window = m.get("window", 0.9) * backward  # the part of the backward that gradients are ready to overlap
    hidden = min(reduce, window) * backward / (backward + last_bucket) if overlap else 0.1 * min(reduce, window)
    exposed = (reduce - hidden) * per_step
    if stage in (1, 2):
        exposed += collective(grad_bytes, knob(params, "allgather_bucket_size", stage))
    if stage == 3:
        persistent = 0.08 if knob(params, "stage3_param_persistence_threshold", stage) >= 1e6 else 0.02
        layer = grad_bytes / m["layers"]
        prefetch = knob(params, "stage3_prefetch_bucket_size", stage) * g
        gathers = 2 * collective(grad_bytes * (1 - persistent), layer / g, 1.0 + 3 * (0.08 - persistent))
        exposed += gas * (gathers * (1 - 0.6 * prefetch / (prefetch + layer)) + 2 * m["layers"] * m["hook_s"])
    optim_bytes = (12 if g == 2 else 8) * n / (w if stage >= 1 else 1) + 2 * g * n / (w if stage >= 2 else 1)
    return gas * compute + exposed + 2 * optim_bytes / m["mem_bw"]


def true_point(m: Dict[str, Any], params: Dict[str, Any]) -> Tuple[str, Dict[str, Any], float]:
    """(status, noise-free metrics, wall time in s) of one configuration."""
    peak, fwd_delta = memory(m, params)
    if peak > m["mem"]:
        return "oom", {"peak_memory_bytes": peak}, 0.8 * m["startup_s"]
    step = step_time(m, params, peak)
    tbs = params["micro_batch"] * params["gas"] * m["world"]
    metrics = {
        "throughput": tbs / step, "latency": step * 1000.0, "FLOPS_per_gpu": 6 * m["params"] * m["tokens"] * tbs / m["world"] / step,
        "peak_memory_bytes": peak, "activation_mem_per_gpu": fwd_delta, "train_batch_size": tbs,
        "num_params": int(m["params"]), "trainable_num_params": int(m["params"]),
        "interval_rel": NOISE, "step_time_spread": 2 * NOISE,
    }
    return "ok", metrics, m["startup_s"] + 15 * step


def noisy(metrics: Dict[str, Any], rng: random.Random) -> Dict[str, Any]:
    """One measurement: the noise-free values beside a draw with +-3% multiplicative noise."""
    if "throughput" not in metrics:
        return dict(metrics)
    f = 1 + rng.uniform(-NOISE, NOISE)
    out = {**metrics, "throughput": metrics["throughput"] * f, "latency": metrics["latency"] / f, "FLOPS_per_gpu": metrics["FLOPS_per_gpu"] * f}
    out.update({f"true_{k}": metrics[k] for k in ("throughput", "latency", "FLOPS_per_gpu")})
    return out


def measure(m: Dict[str, Any], params: Dict[str, Any], rng: Optional[random.Random] = None) -> Tuple[str, Dict[str, Any], float]:
    status, metrics, wall = true_point(m, params)
    return status, noisy(metrics, rng or random.Random(json_key(params))), wall


def json_key(params: Dict[str, Any]) -> str:
    return str(sorted(params.items()))


def landscape(name: str, m: Dict[str, Any]) -> Dict[str, Any]:
    """Every stage x knob combination x micro-batch from 1 to one past the stage's largest that fits."""
    space = spaces()
    points = []
    for stage in range(4):
        knobs = space[stage]
        mbs, fitted_any = 1, False
        while True:
            fitted = False
            for combo in itertools.product(*knobs.values()):
                params = {"stage": stage, "micro_batch": mbs, "gas": 1, **dict(zip(knobs, combo))}
                status, metrics, wall = measure(m, params)
                fitted |= status == "ok"
                points.append({"params": params, "status": status, "metrics": metrics, "wall_time_s": wall})
            fitted_any |= fitted
            if not fitted and (fitted_any or mbs >= 4):
                break  # one micro-batch past the edge is stored; larger ones are OOMs
            mbs += 1
    half = m["precision"] in ("fp16", "bf16")
    base = {"optimizer": {"type": "AdamW"}, **({m["precision"]: {"enabled": True}} if half else {})}
    plan = {"stages": [0, 1, 2, 3], "micro_batch": {"mode": "min", "values": [1]}, "gas": 1, "fast": False, "max_train_batch_size": None,
            "knobs": {str(s): {k: list(v) for k, v in space[s].items()} for s in range(4)}, "base_config": base}
    return {"name": name, "description": (MODELS_DOC.get(name) or "GPU-like analytic model"), "source": "gpu_model", "generator": "gpu_model",
            "model": m, "noise": {"kind": "uniform_multiplicative", "rel": NOISE}, "world_size": m["world"], "memory_limit_bytes": m["mem"],
            "metric": "throughput", "device": "cuda", "startup_s": m["startup_s"], "plan": plan, "points": points}


MODELS_DOC = {
    "gpu_midpeak_gpt2-medium_8xA100-40GB_bf16": "(a) mid-batch peak: throughput peaks at micro-batch 11-13 and falls towards the memory edge",
    "gpu_10b_only-z3_16xA100-40GB_fp16": "(b) a 10B model: the first stage cannot fit micro-batch 1, only ZeRO-3 fits well",
    "gpu_knob-z2_bert-large_8xT4-16GB_fp16": "(c) a knob worth 15-25% in one stage only: reduce_scatter in stage 2 (slow interconnect)",
    "gpu_flat_gpt-350m_8xH100-80GB_bf16": "(d) a flat plateau: compute-bound, fast links",
    "gpu_tie_gpt-1.3b_16xV100-32GB_fp16": "(e) a near-tie between stages 1 and 2",
}


def describe(land: Dict[str, Any]) -> str:
    """What a landscape looks like: per stage, the edge, the best micro-batch and value, the knobs' worth."""
    lines = [f"{land['name']}: {len(land['points'])} points"]
    ok = [p for p in land["points"] if p["status"] == "ok"]
    best = max((p["metrics"]["true_throughput"] for p in ok), default=0)
    for stage in range(4):
        here = [p for p in ok if p["params"]["stage"] == stage]
        if not here:
            lines.append(f"  z{stage}: nothing fits")
            continue
        top = max(here, key=lambda p: p["metrics"]["true_throughput"])
        same_mbs = [p["metrics"]["true_throughput"] for p in here if p["params"]["micro_batch"] == top["params"]["micro_batch"]]
        edge = max(p["params"]["micro_batch"] for p in here)
        lines.append(f"  z{stage}: edge {edge}, best {top['metrics']['true_throughput']:.1f} ({top['metrics']['true_throughput'] / best:.1%}) at "
                     f"{ {k: v for k, v in top['params'].items() if k not in ('stage', 'gas')} }, knobs worth {max(same_mbs) / min(same_mbs) - 1:.1%} at that micro-batch")
    return "\n".join(lines)


if __name__ == "__main__":
    import json

    (HERE / "landscapes").mkdir(exist_ok=True)
    for name, model in MODELS.items():
        land = landscape(name, model)
        (HERE / "landscapes" / f"{name}.json").write_text(json.dumps(land, separators=(",", ":")))
        print(describe(land))
