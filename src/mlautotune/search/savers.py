"""Memory savers as tuned dimensions: activation checkpointing and ZeRO-Offload, where they can win.

A saver costs time (checkpointing recomputes the forward, ~1/3 more compute; offload moves the
optimizer step, and at stage 3 the weights, over the host link), so it is proposed only where the
memory edges say it lets a larger micro-batch fit than the configurations without it (the edges of
fits.py's posterior, corrected by every run and OOM; the memory model's before it has one):
- activation checkpointing (plan.checkpointing: the script has a flag for it), at the sizes above
  the largest that any stage fits without it;
- ZeRO-Offload (plan.offload_device): offload_optimizer at stages 1-3, with offload_param at stage 3,
  only when no stage fits, or the best fits only micro-batches under SMALL_MICRO_BATCH, and only
  where the host has the RAM for it: the offloaded states of every rank of a node (host_bytes,
  16 bytes per parameter of the rank's partition with Adam) within HOST_FRACTION of the host's, or
  within what an offloaded run already held there.
  On the CPU accelerator it is never proposed: host memory is device memory there (DeepSpeed's CPU
  accelerator pins nothing: pin_memory is a no-op), so moving states to the host frees nothing.
A combination of savers is proposed above the largest size that fits without savers, from the edges
of each smaller combination up (at the same size it may be the faster, with memory less full), at
every size where fits.py gives it a chance to fit: P(fits) carries the memory model's uncertainty
(a per-sample slope not yet measured with checkpointing is a wide one), and an OOM is a cost in the
acquisition. Their
params are plain switches (`activation_checkpointing: true`, absent when off), recorded in Optuna
and MLflow like the knobs and encoded by the throughput model like them, so the model learns
their cost from what they measure. When every stage ran out of memory at the smallest micro-batch
before any run succeeded, `bootstrap` proposes offload at the stage that keeps the least per rank.
"""

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from mlautotune.inputs.space import CHECKPOINTING_KEY, TuningPlan
from mlautotune.search.candidates import base_knobs, stage_knob_combos, with_knobs
from mlautotune.search.memory import SAVER_KEYS, MemoryModel, savers_of

SMALL_MICRO_BATCH = 4  # the best plain edge below this is "fits only at small micro-batches": offload enters
HOST_FRACTION = 0.8  # the offloaded states of a node's ranks may take this share of its RAM


def encoder_values(plan: TuningPlan) -> Dict[str, List[Any]]:
    """The savers' values, for the throughput model's encoder (a switch is 0 or 1)."""
    keys = ([CHECKPOINTING_KEY] if plan.checkpointing else []) + (["offload_optimizer", "offload_param"] if plan.offload_device else [])
    return {k: [False, True] for k in keys}


def combos(plan: TuningPlan, stage: int, memory: Optional[MemoryModel]) -> List[Dict[str, bool]]:
    """The saver combinations the plan allows at this stage, fewest first (offload not on CPU)."""
    ckpt = [{}, {CHECKPOINTING_KEY: True}] if plan.checkpointing else [{}]
    offload: List[Dict[str, bool]] = [{}]
    if plan.offload_device and (memory is None or memory.device != "cpu") and stage >= 1:
        offload.append({"offload_optimizer": True})
        if stage == 3:
            offload.append({"offload_optimizer": True, "offload_param": True})
    out = [{**c, **o} for o in offload for c in ckpt]
    return sorted((c for c in out if c), key=len)


def host_fits(memory: MemoryModel, stage: int, savers: Dict[str, bool]) -> bool:
    """Whether the offloaded states of every rank on a node fit in HOST_FRACTION of its RAM, or in what
    an offloaded run already took on the host and ran with (a fact beats the margin)."""
    per_rank = memory.host_bytes(stage, savers)
    need = per_rank * max(1, memory.local_ranks)
    return not need or memory.host_memory is None or need <= HOST_FRACTION * memory.host_memory or per_rank <= memory.host_held


def plain_edge(memory: MemoryModel, plan: TuningPlan, edge: Optional[Callable[[int, Dict[str, bool]], int]] = None) -> int:
    """The largest micro-batch any stage is predicted to fit without savers (0: none fits); `edge`
    (stage, savers) -> that size, from fits.py's posterior (candidates), else the memory model's."""
    if edge is None:
        return max([0, *(memory.max_micro_batch(s, plan.micro_batch_cap) for s in plan.stages if memory.fits(s, 1))])
    return max([0, *(edge(s, {}) for s in plan.stages)])


def proposals(plan: TuningPlan, memory: Optional[MemoryModel], allowed: Sequence[int], notes: Optional[List[str]] = None,
              edge: Optional[Callable[[int, Dict[str, bool]], int]] = None) -> List[Tuple[int, Dict[str, bool], List[int]]]:
    """(stage, savers, sizes) for every saver combination worth proposing: the allowed sizes (and the
    combination's own edge) above the plain edge and from the edges of its smaller combinations up;
    P(fits) (fits.py) says how far up (candidates). `edge`: as in plain_edge."""
    notes = notes if notes is not None else []
    if memory is None or memory.limit is None or memory.fixed is None or not memory.per_sample:
        return []
    base = plain_edge(memory, plan, edge)
    out = []
    if plan.offload_device and memory.device == "cpu":
        notes.append("ZeRO-Offload is not proposed: with the CPU accelerator host memory is device memory, so offloading frees nothing")
    for stage in plan.stages:
        edges: Dict[tuple, int] = {(): base}
        for savers in combos(plan, stage, memory):
            key = tuple(sorted(savers))
            below = max(e for k, e in edges.items() if set(k) < set(key))
            top = edge(stage, savers) if edge is not None else memory.max_micro_batch(stage, plan.micro_batch_cap, savers=savers)
            edges[key] = max(top, below)
            offload = any(savers.get(k) for k in ("offload_optimizer", "offload_param"))
            if offload and base >= SMALL_MICRO_BATCH:
                continue  # a stage fits micro-batches that are not small without it
            if offload and not host_fits(memory, stage, savers):
                notes.append(f"z{stage} with {'+'.join(key)}: not proposed, its {memory.host_bytes(stage, savers) * memory.local_ranks / 2**30:.1f} GiB of "
                             f"offloaded states per node exceed {HOST_FRACTION:.0%} of the host's {memory.host_memory / 2**30:.1f} GiB of RAM")
                continue
            if top <= base or top < below:
                continue  # it lets no larger size fit than no saver does, or fewer than a smaller combination
            sizes = sorted({m for m in allowed if m > base and m >= below} | ({top} if plan.micro_batch.mode == "min" and not plan.max_train_batch_size else set()))
            if sizes:
                out.append((stage, savers, sizes))
    return out


def candidates(plan: TuningPlan, fit: Any, allowed: Sequence[int], notes: Optional[List[str]] = None) -> List[Tuple[Dict[str, Any], float]]:
    """The saver configurations of the constrained space, each with its P(fits): every knob combination
    of the stage at the sizes its proposal allows, the edges from fits.py's posterior (its median, with
    the stage's default knobs): every run and OOM has corrected it, where the memory model's point
    estimate may still be far off (an OOM of one saver combination says little about another)."""
    low = min(allowed)

    def edge(stage: int, savers: Dict[str, bool]) -> int:  # proposals asks only with a limit and a fitted memory model: fit.usable
        return int(min(fit.edge(with_knobs(plan, stage, low, {**base_knobs(plan, stage), **savers})), plan.micro_batch_cap))

    out = []
    for stage, savers, sizes in proposals(plan, fit.memory, allowed, notes, edge):
        for knobs in stage_knob_combos(plan, stage):
            first = with_knobs(plan, stage, sizes[0], {**knobs, **savers})
            out += [(with_knobs(plan, stage, m, {**knobs, **savers}), p) for m, p in zip(sizes, fit.p_fits(first, sizes))]
    return out


LOOK_P_FIT = 0.8  # a saver's first look is at the largest size at least this likely to fit


def first_look(space: Sequence[Tuple[Dict[str, Any], float]], runs: Sequence[Any], pending: Sequence[Dict[str, Any]] = ()) -> Optional[Tuple[Dict[str, Any], str]]:
    """A saver combination proposed but not measured yet gets one look, at its largest size likely to
    fit: the throughput model cannot tell its cost (recompute, host transfers) from the runs without
    it, and a GP's prior alone ranks it by the micro-batch trend only. (params, why) or None."""
    tried = {tuple(sorted(savers_of(m.params))) for m in runs if m.result.status in ("ok", "oom")} | {tuple(sorted(savers_of(p))) for p in pending}
    best: Dict[tuple, Tuple[Dict[str, Any], float]] = {}
    for params, p in space:
        key = tuple(sorted(savers_of(params)))
        if key and key not in tried and p >= LOOK_P_FIT and (key not in best or params["micro_batch"] > best[key][0]["micro_batch"]):
            best[key] = (params, p)
    if not best:
        return None
    key = min(best, key=len)
    params, p = best[key]
    largest = max([0, *(m.params["micro_batch"] for m in runs if m.ok and not savers_of(m.params))])
    return params, (f"memory saver {'+'.join(key)}: the memory model says it lets micro-batch {params['micro_batch']} fit "
                    f"(P(fits) {p:.2f}; the largest run without it: {largest}); one look, so the model learns its cost")


def bootstrap(plan: TuningPlan, runs: Sequence[Any], taken: set, device: str) -> Optional[Dict[str, Any]]:
    """When every stage ran out of memory at the smallest micro-batch and nothing ran: offload at the
    stage that keeps the least per rank (stage 3 with both, then 2, then 1), at that micro-batch;
    then the same with activation checkpointing too."""
    from mlautotune.search.candidates import params_key

    if not plan.offload_device or device == "cpu" or any(m.ok for m in runs):
        return None
    low = min(plan.micro_batch.values)
    oom = {m.params["stage"] for m in runs if m.result.status == "oom" and m.params["micro_batch"] <= low and not savers_of(m.params)}
    if not oom or oom != set(plan.stages):
        return None
    for ckpt in (False, True):
        for stage in sorted((s for s in plan.stages if s >= 1), reverse=True):
            for savers in reversed([c for c in combos(plan, stage, None) if (CHECKPOINTING_KEY in c) == ckpt and len(c) > ckpt]):
                p = with_knobs(plan, stage, low, {**base_knobs(plan, stage), **savers})
                if params_key(p) not in taken:
                    return p
    return None


def verdict(best: Any, runs: Sequence[Any], score: Any) -> Optional[str]:
    """What the savers did, for the summary: the best with and without them, which won and why."""
    ok = [m for m in runs if m.value is not None]
    with_ = [m for m in ok if savers_of(m.params)]
    if best is None or not with_:
        return None
    without = [m for m in ok if not savers_of(m.params)]
    top_with = max(with_, key=lambda m: score(m.final_value))
    name = lambda m: f"{m.result.name} ({m.final_value:.6g}, micro-batch {m.params['micro_batch']})"
    if not without:
        return f"memory savers: only configurations with them ran; the best is {name(top_with)}"
    top_without = max(without, key=lambda m: score(m.final_value))
    other = top_without if savers_of(best.params) else top_with
    close = abs(score(best.final_value) / score(other.final_value) - 1) <= best.interval + other.interval
    unsure = " (within their measurement intervals: the ranking is uncertain)" if close else ""
    if savers_of(best.params):
        used = "+".join(sorted(savers_of(best.params)))
        return (f"memory savers: {used} won: {name(best)} against the best without savers {name(top_without)}; "
                f"the larger micro-batch it lets fit outweighs what it costs ({_cost(savers_of(best.params))}){unsure}")
    return (f"memory savers: the best without them won: {name(best)} against the best with them {name(top_with)}; "
            f"the larger micro-batch they let fit does not make up for their cost ({_cost(savers_of(top_with.params))}){unsure}")


def _cost(savers: Dict[str, bool]) -> str:
    parts = (["recomputing the forward"] if savers.get(CHECKPOINTING_KEY) else []) + (
        ["the optimizer step on the host and the host transfers"] if any(savers.get(k) for k in ("offload_optimizer", "offload_param")) else [])
    return " and ".join(parts)


__all__ = ["SAVER_KEYS", "bootstrap", "candidates", "combos", "encoder_values", "host_fits", "plain_edge", "proposals", "verdict"]
