"""Step 1, profiling: the first runs of a session and the memory model they give.

The first stage at the smallest micro-batch, and if that runs out of memory, the stage that keeps
the least per rank; then a second size of the stage that ran, for the per-sample slope. The memory
model comes from the first successful run of any stage. A stage whose model states alone cannot fit
is skipped with no experiment; one predicted to OOM stays, at its P(fits). Before any run
succeeds, the same exception from the script in two stages ends the session: no configuration mends it.
"""

from typing import Any, Dict, List, Optional, Tuple

from mlautotune.search.memory import SAVER_KEYS, MemoryModel, savers_of
from mlautotune.search.candidates import base_knobs, base_params, knobs_of_params, params_key, with_knobs
from mlautotune.search.ledger import Measured
from mlautotune.search.step import Step
from mlautotune.inputs.space import TuningPlan

PROFILE_FACTOR = 4  # the second profiling point: this many times the smallest micro-batch


class Profiling:
    def __init__(self, strategy):
        self.st = strategy

    def memory_model(self, runs: List[Measured]) -> Optional[MemoryModel]:
        """The model from the first run with model info, calibrated on every default-knob run and OOM."""
        plan, s = self.st.plan, self.st.s
        info = next((m.result.metrics for m in runs if m.ok and m.result.metrics.get("num_params")), None)
        if info is None:
            return None
        model = MemoryModel(
            num_params=int(info["num_params"]), trainable_params=int(info.get("trainable_num_params", info["num_params"])),
            ds_config=plan.base_config, world_size=s.world_size, mp_size=plan.mp_size,
            limit_bytes=int(s.memory_limit_bytes or 0) or None, device=s.device,
            host_memory=s.host_memory_bytes or host_memory(), local_ranks=s.local_ranks,
        )
        for m in runs:  # knobs change memory (buckets): the model learns from default-knob runs only (with or without savers)
            peak = m.result.metrics.get("peak_memory_bytes")
            knobs = {k: v for k, v in knobs_of_params(m.params).items() if k not in SAVER_KEYS}
            if m.result.status in ("ok", "oom") and knobs == base_knobs(plan, m.params["stage"]):
                model.observe(m.params["stage"], m.params["micro_batch"], int(peak) if peak else None, m.result.status == "oom", savers_of(m.params))
        return model

    def step(self, runs: List[Measured], taken: set) -> Optional[Step]:
        """Until a run succeeds: the first stage at the smallest micro-batch, then the stage that keeps
        the least per rank, then the others. Then a second size of a stage that ran, for the slope."""
        st = self.st
        if st.memory is None and any(m.ok for m in runs):
            return None  # runs without a parameter count (no memory model): micro-batches by doubling
        stages = st.plan.stages
        if st.memory is None and (error := self.same_error_in_two_stages(runs)) is not None:
            st.note(f"every experiment so far failed with the same error in {error[1]} stages, so it is the script or its arguments, "
                    f"not a configuration: {error[0]}. Fix it, then run again with autotuning.overwrite=true (a resumed session would reuse these failures)")
            return None
        if st.memory is None:  # the first stage's two sizes (another worker takes the second at once), then the
            order = dict.fromkeys([stages[0], stages[-1], *stages[1:-1]])  # others: a failure that is not an OOM may be passing
            for stage, mbs in [(stages[0], st.low), (stages[0], self._second_size()), *((s, m) for m in (st.low, self._second_size()) for s in order)]:
                p = base_params(st.plan, stage, mbs)
                if params_key(p) not in taken and not self._oom_at_or_below(runs, stage, mbs):
                    return Step(p, "profiling: model info and a first memory point")
            return None
        if st.memory.per_sample_measured():
            return None
        first, mbs = self._second_point(runs)
        if mbs is None:
            return None
        p = with_knobs(st.plan, first.params["stage"], mbs, knobs_of_params(first.params))
        if (st.cap is not None and mbs > st.cap) or params_key(p) in taken:
            return None
        return Step(p, "profiling: a second memory point for the per-sample slope")

    @staticmethod
    def same_error_in_two_stages(runs: List[Measured]) -> Optional[Tuple[str, int]]:
        """(the error, in how many stages) when nothing has run and every failure so far, in two stages
        or more, is the same exception from the script (or the same early end): no configuration
        change mends that, and on a cluster each launch costs a minute or more."""
        if any(m.ok for m in runs):
            return None
        failed = [m for m in runs if m.result.status in ("failed", "incomplete")]
        heads = {((m.result.reason or "").strip().splitlines() or [""])[0] for m in failed}
        stages = {m.params["stage"] for m in failed}
        if len(heads) != 1 or len(stages) < 2 or len(failed) < len([m for m in runs if m.result.status != "oom"]):
            return None  # different errors (they may be the configurations'), or a timeout among them
        head = heads.pop()
        script_error = head.startswith("rank ") or failed[0].result.status == "incomplete"  # not a bare exit code
        return (head, len(stages)) if head and script_error else None

    def _second_point(self, runs: List[Measured]) -> Tuple[Measured, Optional[int]]:
        """The first run (the same for every worker: the lowest trial number) and the second size to
        measure: PROFILE_FACTOR times it (rule "min"), the next listed size above it (rule "list"), or
        none (a fixed size)."""
        first = min((m for m in runs if m.ok), key=lambda m: m.trial_number)
        mbs, rule = first.params["micro_batch"], self.st.plan.micro_batch
        if rule.mode == "min":
            return first, mbs * PROFILE_FACTOR
        return first, min((v for v in rule.values if v > mbs), default=None) if rule.mode == "list" else None

    def _second_size(self) -> int:
        st = self.st
        rule = st.plan.micro_batch
        if rule.mode == "list" and len(rule.values) > 1:
            return sorted(rule.values)[1]
        if rule.mode == "min" and (st.cap is None or st.low * PROFILE_FACTOR <= st.cap):
            return st.low * PROFILE_FACTOR
        return st.low

    @staticmethod
    def _oom_at_or_below(runs: List[Measured], stage: int, mbs: int) -> bool:
        return any(m.result.status == "oom" and m.params["stage"] == stage and m.params["micro_batch"] <= mbs for m in runs)

    def feasible(self, stage: int) -> bool:
        """Whether the stage can run at all: its model states alone (ZeRO's formula) fit the memory
        limit. Anything less sure, a predicted OOM at the smallest micro-batch included, is left to
        P(fits) (fits.py): an OOM risk is a cost in the acquisition, not a reason to skip a stage."""
        m = self.st.memory
        if m is None:
            return True
        if m.limit and m.model_states(stage) > m.limit:
            self.st.note(f"z{stage}: skipped, its model states alone ({m.model_states(stage) / 2**30:.2f} GiB/rank) exceed the memory limit")
            return False
        return True


def host_memory() -> int:
    """This host's RAM (the nodes of a session are taken to be alike): offload's host check."""
    import psutil

    return int(psutil.virtual_memory().total)


def first_experiments(plan: TuningPlan) -> List[Dict[str, Any]]:
    """The session's first experiments, as `Profiling.step` picks them when they run: the first stage at
    the smallest micro-batch, then at PROFILE_FACTOR times it (micro-batch rule "min") or at the next
    listed size (rule "list") for the memory slope. `mlautotune plan` prints these and `mlautotune experiment` runs the first."""
    cap, low = plan.micro_batch_cap, min(plan.micro_batch.values)
    first = [base_params(plan, plan.stages[0], low)]
    rule = plan.micro_batch
    second = low * PROFILE_FACTOR if rule.mode == "min" else min((v for v in rule.values if v > low), default=None) if rule.mode == "list" else None
    if second is not None and second <= cap:
        first.append(base_params(plan, plan.stages[0], second))
    return first
