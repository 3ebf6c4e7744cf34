"""A seeded family of GPU-like landscapes, for judging the search on landscapes it was never tuned on.

    python benchmarks/generator.py show SEED [SEED ...]      # each landscape's traits and shape
    python benchmarks/generator.py score [--landscapes 200] [--seed0 0] [--only SEED] [--strategies ...]
                                         [--workers 1,4] [--jobs 1] [--json OUT.json] [--trace]
    python benchmarks/generator.py table OUT.json [...] [--json MERGED.json]   # the figures of records (merged by seed)
    python benchmarks/generator.py show|score --savers ...   # the memory-saver family (below)

`make(seed)` draws a landscape's traits at random (seeded: the same seed, the same landscape) and
returns it in the landscape format of landscape.py, with no stored points: every configuration is
answered by `true_point` when asked. The model is written here from first principles and shares
no code or assumption with the product's memory model or search, nor with gpu_model.py; the only
things read from the product are the knob spaces (conf/space/zero<N>.yaml), as data.

Traits (`traits` in the landscape): model size 0.1-70B parameters (a GPT-like decoder: layers,
hidden size, heads, sequence length, vocabulary, flash attention or not, activation checkpointing
or not), 8-64 GPUs of 16-80 GB with a peak FLOP rate and memory bandwidth, NVLink or PCIe inside a
node of 8 and a network between nodes, fp16 or bf16, a free global batch (the user's gradient
accumulation) or a fixed one (max_train_batch_size: gas = batch // (micro-batch x GPUs)), the
measurement noise (1-8%) and a systematic part per configuration (0.1-0.4%).

Memory per GPU (bytes), at the peak of the backward pass or of the optimizer step:
- model states (ZeRO paper, mixed-precision Adam): 2 B/param half weights, 2 B/param half
  gradients, 12 B/param fp32 weights, momentum and variance; stage 1 splits the 12 over the N
  GPUs, stage 2 also the gradients, stage 3 also the weights: 16, 4 + 12/N, 2 + 14/N, 16/N.
  bf16 at stages 0-1 accumulates the gradients in fp32 (4 B/param).
- activations per sample per layer (Korthikanti et al.): s h (34 + 5 a s / h) bytes, without the
  attention scores under flash attention; with checkpointing, 2 s h per layer plus one layer's
  full set; plus the logits, 6 s V bytes.
- buffers from the knobs: the gradient bucket (two with overlap_comm), stage 2's contiguous
  gradient buffer, the all-gather bucket of the step (stages 1-2), stage 3's prefetch bucket, the
  layers it keeps gathered and the tensors below stage3_param_persistence_threshold that it never
  partitions (which ones depends on the hidden size).
- fragmentation: a share of everything allocated and freed (activations and buffers), halved by
  contiguous_gradients at stage 2, larger at stage 3 (gather and release).
A configuration whose peak passes the GPU's memory is an OOM.

Step time = gas x micro-step + exposed communication + optimizer step:
- micro-step: FLOPs (6 params tokens, attention's 12 L s^2 h, plus a forward for checkpointing)
  over the peak at an efficiency that rises with the tokens per micro-step and saturates; the CPU
  launches the kernels (and at stage 3 runs the hooks of every module), and short kernels wait for
  it (a smooth maximum of GPU and CPU time); ZeRO's per-gradient hooks add CPU time at every
  micro-step at stages 2-3, at the last one at stage 1. Above a share of the memory the caching allocator
  frees and retries, and the micro-step slows quadratically in the excess: the peak is below the
  memory edge where that is strong.
- communication: ring collectives, bytes x (N - 1) / N (twice for all-reduce) over the slowest
  link's bandwidth, plus a latency per bucket and hop and a fixed cost per bucket (flattening,
  stream synchronisation). Stage 0 all-reduces the gradients after the
  last micro-step, stage 1 reduce-scatters them then, stage 2 at every micro-step (all-reduce
  without reduce_scatter), stage 3 too, and it all-gathers the weights for the forward and again
  for the backward. overlap_comm hides the gradient reduction behind the backward (all of it but
  the last bucket, at a cost in compute: the collectives take SMs); without it the reduction waits.
  Stage 3 hides its gathers behind compute in proportion to the prefetch bucket. Stages 1-2
  all-gather the updated weights after the step. contiguous_gradients off copies each bucket
  before reducing it.
- optimizer step: the local Adam states read and written at memory bandwidth.

The memory-saver family (`--savers`, `make(seed, savers=True)`; the default family is unchanged):
landscapes where no stage fits micro-batch 1 without a saver and some stage fits it with ZeRO-Offload,
with activation checkpointing and offload as the plan's dimensions (params `activation_checkpointing`,
`offload_optimizer`, `offload_param`). Offload moves off the GPU what it moves to the host:
offload_optimizer (stages 1-3) the fp32 states and the fp32 gradient copy, offload_param (stage 3)
the partitioned weights (the gathered layers stay); its cost is the optimizer step on the host's
cores (seconds per local parameter) and the traffic over the host link (PCIe, 12-25 GB/s): half
gradients down and half weights up per step, and with offload_param the weights at every
micro-step's forward and backward gathers. Checkpointing as the trait: activations of 2 s h per
layer plus one layer's set, a forward more of compute. Each node has 512 GB-2 TB of host RAM
(`host_memory_bytes`); an offloaded configuration whose ranks' host share does not fit it runs out of memory.

Measurement: `noisy` multiplies by 1 + rel x z, z a normal draw of deviation 1/2 clipped to [-1, 1]
(rel is the landscape's noise, 1-8%), drawn afresh at every measurement; the systematic part is a
per-configuration factor fixed for the landscape, part of the truth (a re-measurement returns it
again, and so would training with that configuration). Wall time of an experiment: the start-up
(launcher, model build) plus 25 steps, or the start-up alone for an OOM.
"""

import argparse
import hashlib
import itertools
import json
import math
import multiprocessing
import random
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import yaml

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
GB = 1e9
MBS_CAP = 1024  # DeepSpeed's max_train_micro_batch_size_per_gpu default: the search stays at or below it
# DeepSpeed's defaults for a knob a configuration does not name.
DEFAULTS = {"reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8, "reduce_scatter": True, "contiguous_gradients": True,
            "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e5, "stage3_max_live_parameters": 1e9}
STRATEGIES = ("model_based", "gridsearch", "random", "deepspeed_baseline")


# ---- traits ---------------------------------------------------------------------------------
def draw_traits(rng: random.Random) -> Dict[str, Any]:
    """One draw of a landscape's traits: the model, the machine, the batch and the noise."""
    target = 10 ** rng.uniform(math.log10(0.1e9), math.log10(70e9))
    vocab = rng.choice([32000, 50304, 128256])
    hidden = max(512, round((target * rng.uniform(64, 192) / 12) ** (1 / 3) / 128) * 128)  # hidden / layers from 64 to 192
    layers = max(2, round((target - vocab * hidden) / (12 * hidden**2)))
    gpus = rng.choice([8, 16, 24, 32, 48, 64])
    link = rng.choice(["nvlink", "pcie"])
    peak = 10 ** rng.uniform(math.log10(60e12), math.log10(1000e12))
    fixed = rng.random() < 0.5
    return {
        "params": 12 * layers * hidden**2 + 13 * layers * hidden + vocab * hidden, "layers": layers, "hidden": hidden,
        "heads": hidden // (64 if hidden < 2048 else 128), "seq": rng.choice([512, 1024, 2048, 4096]), "vocab": vocab,
        "flash_attention": rng.random() < 0.7, "checkpointing": rng.random() < 0.4,
        "gpus": gpus, "gpu_memory_gb": rng.choice([16, 24, 32, 40, 48, 80]), "peak_flops": peak, "hbm_bytes_s": peak / rng.uniform(150, 350),
        "link": link, "link_bytes_s": rng.uniform(100e9, 450e9) if link == "nvlink" else rng.uniform(8e9, 25e9),
        "hop_s": rng.uniform(3e-6, 8e-6) if link == "nvlink" else rng.uniform(8e-6, 20e-6),
        "network_bytes_s": rng.uniform(6e9, 50e9) if gpus > 8 else None, "network_hop_s": rng.uniform(10e-6, 30e-6) if gpus > 8 else None,
        "precision": rng.choice(["fp16", "bf16"]),
        "batch": "fixed" if fixed else "free", "max_train_batch_size": gpus * rng.choice([4, 8, 16, 32, 64, 128, 256]) if fixed else None,
        "gas": 1 if fixed else rng.choice([1, 1, 2, 4]),
        "noise_rel": rng.uniform(0.01, 0.08), "systematic_rel": rng.uniform(0.001, 0.004),
        "efficiency_max": rng.uniform(0.35, 0.65), "half_tokens": rng.uniform(0.5, 4.0) * 2**20 / hidden,
        "launch_s": rng.uniform(4e-6, 12e-6), "hook_s": rng.uniform(20e-6, 80e-6), "grad_hook_s": rng.uniform(5e-6, 30e-6),
        "bucket_s": rng.uniform(50e-6, 500e-6), "sm_steal": rng.uniform(0.03, 0.2),
        "overlap_efficiency": rng.uniform(0.7, 0.95), "fragmentation": rng.uniform(0.03, 0.15), "context_bytes": rng.uniform(0.8, 2.0) * GB,
        "thrash_onset": rng.uniform(0.75, 0.95), "thrash_strength": rng.uniform(0.1, 1.5),
        "startup_s": rng.uniform(40, 120) + target / 1e9 * rng.uniform(1, 4),
    }


def spaces() -> Dict[int, Dict[str, list]]:
    return {s: yaml.safe_load((HERE.parent / "conf" / "space" / f"zero{s}.yaml").read_text()) or {} for s in range(4)}


def make(seed: int, savers: bool = False) -> Dict[str, Any]:
    """The landscape of `seed`: traits drawn until the model has 0.1-70B parameters, some stage fits
    micro-batch 1 and some stage runs out of memory within the micro-batch range. `savers`: the
    memory-saver family, drawn until no stage fits micro-batch 1 without a saver and some stage
    fits it with offload."""
    if savers:
        return make_savers(seed)
    rng = random.Random(f"landscape-{seed}")
    draws = 0
    while True:
        draws += 1
        t = draw_traits(rng)
        t["seed"] = seed
        land = landscape(seed, t, draws)
        if 0.1e9 <= t["params"] <= 70e9 and any(edge(land["model"], s) is not None for s in range(4)):
            return land


SAVER_COMBOS = {0: [{}, {"activation_checkpointing": True}]}
SAVER_COMBOS[1] = SAVER_COMBOS[2] = SAVER_COMBOS[0] + [{"offload_optimizer": True}, {"offload_optimizer": True, "activation_checkpointing": True}]
SAVER_COMBOS[3] = SAVER_COMBOS[1] + [{"offload_optimizer": True, "offload_param": True},
                                     {"offload_optimizer": True, "offload_param": True, "activation_checkpointing": True}]


def make_savers(seed: int) -> Dict[str, Any]:
    rng = random.Random(f"savers-landscape-{seed}")
    draws = 0
    while True:
        draws += 1
        t = draw_traits(rng)
        t.update(seed=seed, savers=True, checkpointing=False, host_memory_gb=rng.choice([512, 1024, 2048]),
                 host_link_bytes_s=rng.uniform(12e9, 25e9), cpu_adam_s=rng.uniform(1e-9, 3e-9))
        if not 0.1e9 <= t["params"] <= 70e9:
            continue
        if any(fits(t, config(t, s, 1)) for s in range(4)) or not any(fits(t, config(t, s, 1, o)) for s in (1, 2, 3) for o in SAVER_COMBOS[s][2:]):
            continue
        land = landscape(seed, t, draws)
        land["name"] = f"gen_savers_{seed}"
        land["plan"].update(checkpointing=True, offload_device="cpu")
        land["host_memory_bytes"] = int(t["host_memory_gb"] * GB)
        return land


def landscape(seed: int, t: Dict[str, Any], draws: int) -> Dict[str, Any]:
    space = spaces()
    base = {"optimizer": {"type": "AdamW"}, t["precision"]: {"enabled": True}}
    plan = {"stages": [0, 1, 2, 3], "micro_batch": {"mode": "min", "values": [1]}, "gas": t["gas"], "fast": False,
            "max_train_batch_size": t["max_train_batch_size"], "knobs": {str(s): {k: list(v) for k, v in space[s].items()} for s in range(4)},
            "base_config": base}
    return {"name": f"gen_{seed}", "description": describe_traits(t), "source": "generator", "generator": "generator", "seed": seed,
            "traits": t, "trait_draws": draws, "model": t, "world_size": t["gpus"], "memory_limit_bytes": int(t["gpu_memory_gb"] * GB),
            "metric": "throughput", "device": "cuda", "startup_s": t["startup_s"], "plan": plan, "points": []}


def describe_traits(t: Dict[str, Any]) -> str:
    batch = f"batch {t['max_train_batch_size']}" if t["batch"] == "fixed" else f"free batch, gas {t['gas']}"
    return (f"{t['params'] / 1e9:.2f}B ({t['layers']}x{t['hidden']}, seq {t['seq']}{', flash' if t['flash_attention'] else ''}"
            f"{', ckpt' if t['checkpointing'] else ''}) on {t['gpus']}x{t['gpu_memory_gb']}GB {t['peak_flops'] / 1e12:.0f}TF {t['link']} "
            f"{t['precision']}, {batch}, noise {t['noise_rel']:.1%}")


# ---- the model ------------------------------------------------------------------------------
def knob(params: Dict[str, Any], name: str) -> Any:
    if name in params:
        return params[name]
    return params["stage"] == 3 if name == "overlap_comm" else DEFAULTS[name]


def gas_of(t: Dict[str, Any], mbs: int, gas: Optional[int] = None) -> int:
    if t["max_train_batch_size"]:
        return max(1, t["max_train_batch_size"] // (mbs * t["gpus"]))
    return gas or t["gas"]


def tensors(t: Dict[str, Any]) -> List[Tuple[int, int]]:
    """(elements, count) of the model's tensors: per layer qkv, projection, two MLP matrices, the
    small vectors (biases and norms); the embedding."""
    h, L = t["hidden"], t["layers"]
    return [(3 * h * h, L), (h * h, L), (4 * h * h, 2 * L), (h, 13 * L), (t["vocab"] * h, 1)]


def persistent(t: Dict[str, Any], threshold: float) -> float:
    """Parameters that stage 3 keeps whole: every tensor below the persistence threshold."""
    return sum(n * c for n, c in tensors(t) if n < threshold)


def checkpointed(t: Dict[str, Any], params: Optional[Dict[str, Any]] = None) -> bool:
    """Activation checkpointing: the trait, or (the memory-saver family) the configuration's switch."""
    return bool(t["checkpointing"] or (params or {}).get("activation_checkpointing"))


def activations(t: Dict[str, Any], params: Optional[Dict[str, Any]] = None) -> Tuple[float, float]:
    """(bytes kept for the backward per sample, bytes of one layer's working set per sample)."""
    s, h, a = t["seq"], t["hidden"], t["heads"]
    layer = s * h * (34 + (0 if t["flash_attention"] else 5 * a * s / h))
    ckpt = checkpointed(t, params)
    kept = 2 * s * h * t["layers"] if ckpt else layer * t["layers"]
    return kept + 6 * s * t["vocab"], layer if ckpt else 0.0


def memory(t: Dict[str, Any], params: Dict[str, Any]) -> Tuple[float, float]:
    """(peak bytes per GPU, forward activation bytes per GPU) of a configuration."""
    stage, mbs, n, P = params["stage"], params["micro_batch"], t["gpus"], t["params"]
    grad_bytes = 4 if t["precision"] == "bf16" and stage <= 1 else 2
    weights, grads, optim = 2 * P, grad_bytes * P, 12 * P
    optim /= n if stage >= 1 else 1
    grads /= n if stage >= 2 else 1
    weights /= n if stage >= 3 else 1
    kept, working = activations(t, params)
    act = mbs * (kept + working)
    rbs = min(knob(params, "reduce_bucket_size"), P) * 2
    frag = t["fragmentation"]
    backward = rbs * (2 if knob(params, "overlap_comm") else 1) if stage >= 1 else min(5e8, P) * grad_bytes
    step = 4 * P / (n if stage >= 1 else 1)  # the fp32 copy of the local gradients for Adam
    if stage in (1, 2):
        step += min(knob(params, "allgather_bucket_size"), P) * 2
    if stage == 2 and knob(params, "contiguous_gradients"):
        backward += rbs
        frag /= 2
    if stage == 3:
        keep = persistent(t, knob(params, "stage3_param_persistence_threshold"))
        layer = (P - t["vocab"] * t["hidden"]) / t["layers"]
        live = min(knob(params, "stage3_max_live_parameters"), 2 * layer + knob(params, "stage3_prefetch_bucket_size"))
        weights = 0.0 if params.get("offload_param") else weights + 2 * keep * (1 - 1 / n)
        backward += 2 * live
        frag *= 1.5
    if params.get("offload_optimizer") and stage >= 1:  # the fp32 states and gradient copy live on the host
        optim, step = 0.0, step - 4 * P / n
    states = weights + grads + optim
    peak = t["context_bytes"] + states + (1 + frag) * max(act + backward, step)
    return peak, mbs * kept


def ring(t: Dict[str, Any], nbytes: float, bucket_bytes: float, allreduce: bool = False) -> float:
    """A ring collective over every GPU: bandwidth term on the slowest link, a latency per bucket and hop."""
    n = t["gpus"]
    bw = min(t["link_bytes_s"], t["network_bytes_s"] or math.inf)
    hop = max(t["hop_s"], t["network_hop_s"] or 0.0)
    passes = 2 if allreduce else 1
    buckets = math.ceil(nbytes / max(bucket_bytes, 1.0))
    return passes * (nbytes * (n - 1) / n / bw + buckets * (n - 1) * hop) + buckets * t["bucket_s"]


def reduce_exposed(t: Dict[str, Any], comm: float, buckets: int, backward: float, overlap: bool) -> Tuple[float, float]:
    """(exposed reduction time, compute slowdown from the overlap): with overlap_comm, the reduction
    runs beside the backward, all but its last bucket hidden up to the overlap's efficiency."""
    if not overlap:
        return comm, 0.0
    hidden = min(comm * (1 - 1 / buckets), t["overlap_efficiency"] * backward)
    return comm - hidden, t["sm_steal"] * hidden


def step_time(t: Dict[str, Any], params: Dict[str, Any], peak: float) -> float:
    stage, mbs, P = params["stage"], params["micro_batch"], t["params"]
    gas = gas_of(t, mbs, params.get("gas"))
    tokens = mbs * t["seq"]
    flops = 6 * P * tokens + 12 * t["layers"] * t["seq"] ** 2 * t["hidden"] * mbs
    ckpt = checkpointed(t, params)
    if ckpt:
        flops *= 4 / 3
    gpu = flops / (t["peak_flops"] * t["efficiency_max"] * tokens / (tokens + t["half_tokens"]))
    cpu = t["layers"] * (60 + 20 * ckpt) * t["launch_s"] + (4 * t["layers"] * t["hook_s"] if stage == 3 else 0.0)
    grad_hooks = sum(c for _, c in tensors(t)) * t["grad_hook_s"]  # ZeRO's per-gradient hook: every micro-step at stages 2-3
    cpu += grad_hooks if stage >= 2 else 0.0
    micro = (gpu**4 + cpu**4) ** 0.25
    excess = max(0.0, (peak / (t["gpu_memory_gb"] * GB) - t["thrash_onset"]) / (1 - t["thrash_onset"]))
    micro *= 1 + t["thrash_strength"] * excess**2
    backward = micro * 2 / 3
    grad_bytes = 4 if t["precision"] == "bf16" and stage <= 1 else 2
    rbs = min(knob(params, "reduce_bucket_size"), P) * 2
    per_micro = per_step = 0.0
    if stage == 0:
        per_step += ring(t, grad_bytes * P, min(5e8, P) * grad_bytes, allreduce=True)
    elif stage == 1:
        per_step += ring(t, grad_bytes * P, rbs) + grad_hooks
    else:
        reduce_scatter = knob(params, "reduce_scatter") if stage == 2 else True
        comm = ring(t, 2 * P, rbs, allreduce=not reduce_scatter)
        exposed, slowdown = reduce_exposed(t, comm, math.ceil(2 * P / rbs), backward, knob(params, "overlap_comm"))
        per_micro += exposed + slowdown
        if stage == 2 and not knob(params, "contiguous_gradients"):
            per_micro += 2 * 2 * P / t["hbm_bytes_s"]  # each bucket copied before it is reduced
    if stage in (1, 2):
        per_step += ring(t, 2 * P, min(knob(params, "allgather_bucket_size"), P) * 2)
    if stage == 3:
        gathered = P - persistent(t, knob(params, "stage3_param_persistence_threshold"))
        layer = (P - t["vocab"] * t["hidden"]) / t["layers"]
        prefetch = knob(params, "stage3_prefetch_bucket_size")
        share = prefetch / (prefetch + layer)
        for compute in (micro / 3, backward):  # the forward's gathers, then the backward's
            gather = ring(t, 2 * gathered, 2 * layer / 4)
            per_micro += gather - min(share * gather, t["overlap_efficiency"] * compute)
    local = P / (t["gpus"] if stage >= 1 else 1)
    optimizer = (30 + (4 if t["precision"] == "fp16" else 0)) * local / t["hbm_bytes_s"]
    if params.get("offload_optimizer") and stage >= 1:  # the step on the host's cores; half gradients down, half weights up
        optimizer = local * t["cpu_adam_s"] + 2 * 2 * local / t["host_link_bytes_s"]
    if params.get("offload_param") and stage == 3:  # every gather of the forward and the backward comes over the host link first
        per_micro += 2 * 2 * local / t["host_link_bytes_s"]
    return gas * (micro + per_micro) + per_step + optimizer


def systematic(t: Dict[str, Any], params: Dict[str, Any]) -> float:
    """The configuration's own factor, fixed for the landscape: 1 + systematic_rel x a normal draw."""
    digest = hashlib.blake2b(f"{t['seed']}-{json.dumps(params, sort_keys=True)}".encode(), digest_size=8).digest()
    u = (int.from_bytes(digest, "big") + 0.5) / 2**64
    return 1 + t["systematic_rel"] * statistics.NormalDist().inv_cdf(u)


def smooth_point(t: Dict[str, Any], params: Dict[str, Any]) -> Tuple[str, Dict[str, Any], float]:
    """(status, noise-free metrics without the systematic part, wall time in s)."""
    peak, forward = memory(t, params)
    if peak > t["gpu_memory_gb"] * GB or not host_fits(t, params):
        return "oom", {}, t["startup_s"]
    step = step_time(t, params, peak)
    gas = gas_of(t, params["micro_batch"], params.get("gas"))
    tbs = params["micro_batch"] * gas * t["gpus"]
    metrics = {
        "throughput": tbs / step, "latency": step * 1000.0, "FLOPS_per_gpu": 6 * t["params"] * t["seq"] * tbs / t["gpus"] / step,
        "peak_memory_bytes": peak, "activation_mem_per_gpu": forward, "train_batch_size": tbs,
        "num_params": int(t["params"]), "trainable_num_params": int(t["params"]),
        "interval_rel": t["noise_rel"], "step_time_spread": 2 * t["noise_rel"],
    }
    return "ok", metrics, t["startup_s"] + 25 * step


def true_point(t: Dict[str, Any], params: Dict[str, Any]) -> Tuple[str, Dict[str, Any], float]:
    """(status, noise-free metrics, wall time in s) of a configuration: the smooth model times its systematic part."""
    status, metrics, wall = smooth_point(t, params)
    if status == "ok":
        f = systematic(t, params)
        metrics.update(throughput=metrics["throughput"] * f, latency=metrics["latency"] / f, FLOPS_per_gpu=metrics["FLOPS_per_gpu"] * f)
    return status, metrics, wall


def noisy(metrics: Dict[str, Any], rng: random.Random) -> Dict[str, Any]:
    """One measurement: a fresh draw of the landscape's noise, beside the noise-free values."""
    if "throughput" not in metrics:
        return dict(metrics)
    f = 1 + metrics["interval_rel"] * max(-1.0, min(1.0, rng.gauss(0.0, 0.5)))
    out = {**metrics, "throughput": metrics["throughput"] * f, "latency": metrics["latency"] / f, "FLOPS_per_gpu": metrics["FLOPS_per_gpu"] * f}
    out.update({f"true_{k}": metrics[k] for k in ("throughput", "latency", "FLOPS_per_gpu")})
    return out


# ---- the landscape's shape ------------------------------------------------------------------
def combos(land: Dict[str, Any], stage: int) -> List[Dict[str, Any]]:
    """Every knob combination of the stage (with every saver combination, in the memory-saver family)."""
    knobs = land["plan"]["knobs"][str(stage)]
    out = [dict(zip(knobs, c)) for c in itertools.product(*knobs.values())]
    if land["model"].get("savers"):
        out = [{**c, **s} for s in SAVER_COMBOS[stage] for c in out]
    return out


def cap(t: Dict[str, Any]) -> int:
    return min(MBS_CAP, t["max_train_batch_size"] // t["gpus"]) if t["max_train_batch_size"] else MBS_CAP


def config(t: Dict[str, Any], stage: int, mbs: int, knobs: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    return {"stage": stage, "micro_batch": mbs, "gas": gas_of(t, mbs), **(knobs or {})}


def fits(t: Dict[str, Any], params: Dict[str, Any]) -> bool:
    return memory(t, params)[0] <= t["gpu_memory_gb"] * GB and host_fits(t, params)


def host_fits(t: Dict[str, Any], params: Dict[str, Any]) -> bool:
    """Whether what offload moves to the host fits the node's RAM: per rank, the fp32 states and the fp32
    gradient copy (16 bytes per local parameter) with offload_optimizer, the half-precision weights (2)
    with offload_param; a node holds min(8, GPUs) ranks."""
    stage, n = params["stage"], t["gpus"]
    local = t["params"] / n if stage >= 1 else t["params"]
    per_rank = (16 * local if params.get("offload_optimizer") and stage >= 1 else 0) + (2 * local if params.get("offload_param") and stage == 3 else 0)
    return per_rank * min(8, n) <= t.get("host_memory_gb", math.inf) * GB


def largest(t: Dict[str, Any], stage: int, knobs: Optional[Dict[str, Any]] = None) -> int:
    """The largest micro-batch within the cap that fits (memory grows with it), 0 if none."""
    lo, hi = 0, cap(t)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(t, config(t, stage, mid, knobs)) else (lo, mid - 1)
    return lo


def edge(t: Dict[str, Any], stage: int, knobs: Optional[Dict[str, Any]] = None) -> Optional[int]:
    """The stage's largest micro-batch when it fits 1 and runs out of memory within the cap, else None."""
    m = largest(t, stage, knobs)
    return m if 0 < m < cap(t) else None


def fitting(land: Dict[str, Any], stage: int) -> Iterator[Tuple[float, Dict[str, Any]]]:
    """(noise-free throughput, params) of every knob combination x micro-batch of the stage that runs."""
    t = land["model"]
    for knobs in combos(land, stage):
        for mbs in range(1, largest(t, stage, knobs) + 1):
            params = config(t, stage, mbs, knobs)
            status, metrics, _ = true_point(t, params)
            if status == "ok":
                yield metrics["throughput"], params


def best(land: Dict[str, Any]) -> Dict[str, Any]:
    """The noise-free best of every stage x knob combination x micro-batch in the plan: its value, its
    params, and per stage the largest micro-batch that fits with the default knobs and the stage's best."""
    t = land["model"]
    out: Dict[str, Any] = {"value": 0.0, "params": None, "stages": {}}
    for stage in land["plan"]["stages"]:
        top = (0.0, None)
        for value, params in fitting(land, stage):
            if value > top[0]:
                top = (value, params)
        out["stages"][stage] = {"largest": largest(t, stage), "best": top[0], "params": top[1]}
        if top[0] > out["value"]:
            out["value"], out["params"] = top
    return out


def shape(land: Dict[str, Any], b: Dict[str, Any]) -> str:
    lines = [f"seed {land['seed']}: {land['description']} (traits drawn {land['trait_draws']}x)"]
    for stage, s in b["stages"].items():
        if not s["params"]:
            lines.append(f"  z{stage}: nothing fits")
            continue
        lines.append(f"  z{stage}: largest micro-batch {s['largest']}, best {s['best']:.1f} samples/s ({s['best'] / b['value']:.1%}) at "
                     f"{ {k: v for k, v in s['params'].items() if k != 'stage'} }")
    return "\n".join(lines)


# ---- scoring --------------------------------------------------------------------------------
def evaluate(job: tuple) -> Dict[str, Any]:
    """One landscape: every strategy x worker count replayed with the landscape's seed, scored by
    replay.py; with `trace`, every replayed experiment as replay.py --trace prints it."""
    import replay

    seed, strategies, counts, trace, *rest = job
    land = make(seed, savers=bool(rest) and rest[0])
    b = best(land)
    runs = []
    for strategy in strategies:
        for workers in ([1] if strategy == "deepspeed_baseline" else counts):
            runner, found = replay.replay(land, strategy, seed, workers)
            runs.append({"landscape": land["name"], "strategy": strategy, "seed": seed, "workers": workers, "log": runner.log,
                         "found": runner.true_value(found), "declared": found})
    return {"seed": seed, "name": land["name"], "traits": land["traits"], "best": b["value"], "best_params": b["params"],
            "records": replay.score(runs, b["value"]), **({"trace": [replay.trace(r, b["value"]) for r in runs]} if trace else {})}


def line(result: Dict[str, Any]) -> str:
    cells = []
    for r in result["records"]:
        to99 = "never" if r["to99"] is None else r["to99"]
        cells.append(f"{r['strategy']}/{r['workers']}w to99 {to99} regret {r['regret']:.1%}")
    return f"seed {result['seed']} [{describe_traits(result['traits'])}]: " + "; ".join(cells)


def quantile(values: List[float], q: float) -> float:
    """Nearest-rank quantile."""
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact binomial p-value of wins against losses (ties left out)."""
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


def bootstrap(diffs: List[float], resamples: int = 2000, seed: int = 0) -> Tuple[float, float]:
    """95% interval of the mean of paired differences, landscapes resampled."""
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(diffs, k=len(diffs))) for _ in range(resamples))
    return means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def records_by(results: List[Dict[str, Any]], strategy: str, workers: int) -> Dict[int, Dict[str, Any]]:
    """One strategy x worker count's records of scored landscapes, by seed."""
    return {r["seed"]: r for res in results for r in res["records"] if (r["strategy"], r["workers"]) == (strategy, workers)}


def summary(results: List[Dict[str, Any]]) -> str:
    """The figures of scored landscapes: a table per strategy and worker count, the 4/1 workers' ratio,
    model_based against random and grid, the issue's targets, and the worst landscapes' seeds."""
    keys = list(dict.fromkeys((r["strategy"], r["workers"]) for res in results for r in res["records"]))
    by = {k: records_by(results, *k) for k in keys}
    seeds = sorted(res["seed"] for res in results)
    return "\n".join([f"\n### {len(results)} generated landscapes (seeds {seeds[0]}..{seeds[-1]})\n", *table(by), "", *workers(by),
                      *margins(by), *targets(by), *worst(by)])


def cell_ratio(ratio: Optional[float]) -> str:
    return "n/a" if ratio is None else ("never" if ratio == math.inf else f"{ratio:.2f}")


def ds_ratio(rs: List[Dict[str, Any]], ds: Dict[int, Dict[str, Any]]) -> Optional[float]:
    """Median over landscapes of experiments to 99% over the DeepSpeed model's (tables.ratio: a miss is infinity, the model's miss alone 0)."""
    import tables

    ratios = [tables.ratio(tables.median([r["to99"]]), tables.median([ds[r["seed"]]["to99"]])) for r in rs if r["seed"] in ds]
    return statistics.median(ratios) if ratios else None


def table(by: Dict[Tuple[str, int], Dict[int, Dict[str, Any]]]) -> List[str]:
    import tables

    ds = by.get(("deepspeed_baseline", 1), {})
    out = ["| strategy | workers | reached 99% | declared within 1% | regret median / p95 / worst | experiments to 99% (median) "
           "| to 99% / DeepSpeed model's (median) | experiments (median) | wall hours to 99% (median) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (strategy, n), runs in by.items():
        rs = list(runs.values())
        regrets = [r["regret"] for r in rs]
        ratio = None if strategy == "deepspeed_baseline" else ds_ratio(rs, ds)
        out.append(f"| {strategy} | {n} | {sum(r['to99'] is not None for r in rs) / len(rs):.0%} | {sum(x <= 0.01 for x in regrets) / len(rs):.0%} | "
                   f"{statistics.median(regrets):.1%} / {quantile(regrets, 0.95):.1%} / {max(regrets):.1%} | {tables.steps([r['to99'] for r in rs])} | "
                   f"{cell_ratio(ratio)} | {statistics.median(r['experiments'] for r in rs):g} | "
                   f"{tables.hours(tables.median([r['wall_hours_to99'] for r in rs]))} |")
    return out


def both(pairs: List[Tuple[float, float]]) -> str:
    """The median ratio over the pairs where both reached 99%, and how many they are."""
    reached = [a / b for a, b in pairs if a != math.inf and b != math.inf and b > 0]
    return f"{statistics.median(reached):.2f} over the {len(reached)} where both reached 99%" if reached else "none where both reached 99%"


def workers_ratio(by, strategy: str) -> Optional[Tuple[float, int, int, int, str]]:
    """(median over landscapes of wall hours to 99% with the most workers over 1 worker's, landscapes,
    the two worker counts, the same median where both reached 99%)."""
    import tables

    counts = sorted(n for s, n in by if s == strategy)
    if len(counts) < 2:
        return None
    one, many = by[(strategy, counts[0])], by[(strategy, counts[-1])]
    pairs = [(tables.median([many[s]["wall_hours_to99"]]), tables.median([one[s]["wall_hours_to99"]])) for s in one if s in many]
    return statistics.median(tables.ratio(a, b) for a, b in pairs), len(pairs), counts[0], counts[-1], both(pairs)


def workers(by) -> List[str]:
    out = []
    for strategy in dict.fromkeys(s for s, _ in by):
        w = workers_ratio(by, strategy)
        if w:
            out.append(f"- {strategy}: wall hours to 99% with {w[3]} workers / with {w[2]}, median over {w[1]} landscapes: {cell_ratio(w[0])} "
                       f"(never with {w[3]} counts as infinity, never with {w[2]} alone as 0); {w[4]}")
    ds = by.get(("deepspeed_baseline", 1), {})
    for strategy in dict.fromkeys(s for s, n in by if s != "deepspeed_baseline"):
        rs = by.get((strategy, 1), {})
        if ds and rs:
            pairs = [(float(r["to99"] or math.inf), float(ds[s]["to99"] or math.inf)) for s, r in rs.items() if s in ds]
            out.append(f"- {strategy}, 1 worker: experiments to 99% / the DeepSpeed model's, median over landscapes {cell_ratio(ds_ratio(list(rs.values()), ds))}; {both(pairs)}")
    return out


def paired(by, other: str) -> Optional[Dict[str, Any]]:
    """model_based against `other` with 1 worker, landscape by landscape: wins and losses on experiments
    to 99% (never = infinity) and on regret, sign tests, and the bootstrap interval of the regret difference."""
    import tables

    mb, ot = by.get(("model_based", 1)), by.get((other, 1))
    if not mb or not ot:
        return None
    seeds = [s for s in mb if s in ot]
    to99 = [(tables.median([mb[s]["to99"]]), tables.median([ot[s]["to99"]])) for s in seeds]
    regret = [(mb[s]["regret"], ot[s]["regret"]) for s in seeds]
    out = {"n": len(seeds), "diff": statistics.fmean(y - x for x, y in regret), "interval": bootstrap([y - x for x, y in regret])}
    for name, pairs in (("to99", to99), ("regret", regret)):
        wins, losses = sum(x < y for x, y in pairs), sum(x > y for x, y in pairs)
        out[name] = (wins, losses, sign_test(wins, losses))
    return out


def margins(by) -> List[str]:
    out = []
    for other in ("random", "gridsearch"):
        m = paired(by, other)
        if m:
            out.append(f"- model_based vs {other}, 1 worker, {m['n']} landscapes: fewer experiments to 99% on {m['to99'][0]}, more on {m['to99'][1]} "
                       f"(sign test p = {m['to99'][2]:.2g}); lower regret on {m['regret'][0]}, higher on {m['regret'][1]} (p = {m['regret'][2]:.2g}); "
                       f"mean regret difference ({other} - model_based) {m['diff']:+.2%}, 95% bootstrap interval [{m['interval'][0]:+.2%}, {m['interval'][1]:+.2%}]")
    return out


def targets(by) -> List[str]:
    """The issue's done-when targets for model_based, each met or not."""
    import tables

    mb = list(by.get(("model_based", 1), {}).values())
    if not mb:
        return []
    regrets = [r["regret"] for r in mb]
    ds = by.get(("deepspeed_baseline", 1), {})
    ratio = ds_ratio(mb, ds)
    w = workers_ratio(by, "model_based")
    beats = [paired(by, o) for o in ("random", "gridsearch")]

    def row(text: str, met: Optional[bool]) -> str:
        return f"- {text}: {'n/a' if met is None else ('met' if met else 'NOT met')}"

    reached = sum(r["to99"] is not None for r in mb) / len(mb)
    return ["", "Targets (model_based, 1 worker unless said):",
            row(f"reaches 99% on >= 95% of landscapes ({reached:.0%})", reached >= 0.95),
            row(f"p95 regret <= 2% ({quantile(regrets, 0.95):.1%}), worst <= 5% ({max(regrets):.1%})", quantile(regrets, 0.95) <= 0.02 and max(regrets) <= 0.05),
            row(f"experiments to 99% <= 0.5x the DeepSpeed model's (median of ratios {cell_ratio(ratio)}; ratio of medians "
                f"{cell_ratio(tables.ratio(tables.median([r['to99'] for r in mb]), tables.median([r['to99'] for r in ds.values()])) if ds else None)})",
                None if ratio is None else ratio <= 0.5),
            row(f"4 workers' wall hours to 99% <= 0.35x 1 worker's ({cell_ratio(w[0]) if w else 'n/a'})", None if not w else w[0] <= 0.35),
            row("beats random and grid on experiments to 99% and on regret, sign test p < 0.05 each",
                None if None in beats else all(b[k][0] > b[k][1] and b[k][2] < 0.05 for b in beats for k in ("to99", "regret")))]


def worst(by) -> List[str]:
    mb = by.get(("model_based", 1), {})
    top = sorted(((r["regret"], r["seed"]) for r in mb.values()), reverse=True)[:5]
    if not top:
        return []
    family = " --savers" if any(r["landscape"].startswith("gen_savers_") for r in mb.values()) else ""
    return ["- model_based's worst landscapes (regret, seed): " + ", ".join(f"{x:.1%} (seed {s})" for x, s in top)
            + f"; replay one alone with `python benchmarks/generator.py score{family} --only SEED --trace`"]


def compare(new: Dict[int, Dict[str, Any]], old: Dict[int, Dict[str, Any]], names: Tuple[str, str] = ("new", "old")) -> List[str]:
    """Two searches landscape by landscape (the seeds both scored): on each measure, where the first is
    lower and where higher, with a sign test; each one's reach and regret; and the landscapes whose
    regret moved most. A change that moves a few landscapes either way is within chance."""
    seeds = sorted(set(new) & set(old))
    if not seeds:
        return ["no landscape in both records"]
    a, b = names
    measures = {"experiments to 99% (never = infinity)": lambda r: math.inf if r["to99"] is None else r["to99"],
                "final regret (to 0.1%)": lambda r: round(r["regret"], 3),
                "experiments": lambda r: r["experiments"],
                "wall hours to 99% (never = infinity)": lambda r: math.inf if r["wall_hours_to99"] is None else r["wall_hours_to99"]}
    out = [f"{len(seeds)} landscapes in both"]
    for name, f in measures.items():
        lower, higher = sum(f(new[s]) < f(old[s]) for s in seeds), sum(f(new[s]) > f(old[s]) for s in seeds)
        out.append(f"- {name}: {a} lower on {lower}, higher on {higher} (sign test p = {sign_test(lower, higher):.2g})")
    for tag, rs in ((a, new), (b, old)):
        regrets = [rs[s]["regret"] for s in seeds]
        reach = sum(rs[s]["to99"] is not None for s in seeds)
        out.append(f"- {tag}: reaches 99% on {reach}/{len(seeds)}, regret median / p95 / worst {statistics.median(regrets):.1%} / "
                   f"{quantile(regrets, 0.95):.1%} / {max(regrets):.1%}, experiments (median) {statistics.median(rs[s]['experiments'] for s in seeds):g}")
    moved = sorted(seeds, key=lambda s: new[s]["regret"] - old[s]["regret"])  # most improved first
    worse = [s for s in reversed(moved) if new[s]["regret"] - old[s]["regret"] >= 5e-4][:5]
    better = [s for s in moved if old[s]["regret"] - new[s]["regret"] >= 5e-4][:5]
    for label, part in ((f"{a} worse", worse), (f"{a} better", better)):
        if part:
            out.append(f"- regret, {label} (seed: {a} / {b}): " + ", ".join(f"{s}: {new[s]['regret']:.1%} / {old[s]['regret']:.1%}" for s in part))
    return out


def score(args: argparse.Namespace) -> None:
    strategies = args.strategies.split(",")
    counts = [int(n) for n in args.workers.split(",")]
    seeds = [args.only] if args.only is not None else list(range(args.seed0, args.seed0 + args.landscapes))
    jobs = [(s, strategies, counts, args.trace, args.savers) for s in seeds]
    results = []
    with multiprocessing.Pool(args.jobs) if args.jobs > 1 else _Serial() as pool:
        for result in pool.imap(evaluate, jobs):
            results.append(result)
            for text in result.pop("trace", []):
                print(text)
            print(line(result), flush=True)
    print(summary(results), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"commands": [" ".join(sys.argv)], "results": results}, indent=1))


class _Serial:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def imap(self, fn, items):
        return map(fn, items)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="print each landscape's traits and shape")
    show.add_argument("seeds", nargs="+", type=int)
    show.add_argument("--savers", action="store_true", help="the memory-saver family (only offload fits)")
    sc = sub.add_parser("score", help="replay every strategy on generated landscapes and score them")
    sc.add_argument("--landscapes", type=int, default=200)
    sc.add_argument("--seed0", type=int, default=0, help="the first landscape's seed")
    sc.add_argument("--only", type=int, help="score this one landscape's seed alone")
    sc.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset of " + ", ".join(STRATEGIES))
    sc.add_argument("--workers", default="1,4", help="comma-separated worker counts (simulated time; the DeepSpeed model runs with 1)")
    sc.add_argument("--jobs", type=int, default=1, help="landscapes scored in parallel (processes)")
    sc.add_argument("--json", metavar="OUT", help="write the per-landscape results and records")
    sc.add_argument("--trace", action="store_true", help="print every replayed experiment: params, the value the search saw, the true value")
    sc.add_argument("--savers", action="store_true", help="the memory-saver family: landscapes where only offload fits")
    tb = sub.add_parser("table", help="the figures table of records written by score --json (several are merged, by seed)")
    tb.add_argument("records", nargs="+")
    tb.add_argument("--json", metavar="OUT", help="write the merged record (each record's command kept)")
    cp = sub.add_parser("compare", help="two records of score --json, landscape by landscape (sign tests)")
    cp.add_argument("new")
    cp.add_argument("old")
    cp.add_argument("--strategy", default="model_based")
    cp.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()
    if args.command == "compare":
        pair = [records_by(json.loads(Path(path).read_text())["results"], args.strategy, args.workers) for path in (args.new, args.old)]
        print("\n".join(compare(*pair, names=(Path(args.new).stem, Path(args.old).stem))))
    elif args.command == "show":
        for seed in args.seeds:
            land = make(seed, savers=args.savers)
            print(shape(land, best(land)))
    elif args.command == "score":
        score(args)
    else:
        records = [json.loads(Path(path).read_text()) for path in args.records]
        results: Dict[int, Dict[str, Any]] = {}
        for record in records:  # one landscape's strategies may come from several records: its runs are pooled
            for r in record["results"]:
                into = results.setdefault(r["seed"], {**r, "records": []})
                done = {(x["strategy"], x["workers"]) for x in into["records"]}
                into["records"] += [x for x in r["records"] if (x["strategy"], x["workers"]) not in done]
        merged = [results[s] for s in sorted(results)]
        print(summary(merged))
        if args.json:
            commands = [c for record in records for c in record.get("commands", [record.get("command")])]
            Path(args.json).write_text(json.dumps({"commands": commands, "results": merged}, indent=1))


if __name__ == "__main__":
    main()
