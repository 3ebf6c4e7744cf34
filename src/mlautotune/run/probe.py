"""Runs inside every training rank and measures it, with no change to the user's script.

The DeepSpeed launcher starts each rank as
    python -u -m mlautotune.run.probe [--local_rank=N] <exp_dir> <script> [script args]
The probe reads its settings from <exp_dir>/probe.json, wraps DeepSpeedEngine.forward/step, then
runs the script as `__main__`. It times every optimizer step (wall clock, everything included;
inside the window the accelerator is synchronised at each step's end), takes the slowest rank per
step and, from end_profile_step on, every few steps decides with all ranks at once whether the
window can end (mlautotune.run.measure: warm-up skipped, the median known to the target interval, or
the budget spent). Then rank 0 writes <exp_dir>/metrics.json and all ranks end together; in the
final training (stop_after_window false) the script goes on and, at its end, the end-to-end
throughput after warm-up is added to metrics.json.
Each rank also writes <exp_dir>/rank<N>.json (peak memory, step count, timeline), even on OOM.
"""

import json
import math
import os
import resource
import runpy
import socket
import statistics
import sys
import threading
import time

from mlautotune.run import cpu_features, measure
from mlautotune.run.lifeline import end_own_group, release_own_shared_memory

PROBE_START = time.time()  # before torch and deepspeed are imported: the start of "imports"

OOM_EXIT_CODE = 87  # a rank whose peak memory passed the limit, or that hit a real accelerator OOM
SETTINGS_FILE = "probe.json"
METRICS_FILE = "metrics.json"
WATCH_INTERVAL_S = 0.05
RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")  # by launcher


def rank_file(rank) -> str:
    return f"rank{rank}.json"


PARENT_FILE_PAGES: dict = {}  # in a rank forked from a process that imported torch and DeepSpeed (runner_process): its resident file pages


def peak_memory_bytes(accelerator) -> int:
    """This rank's peak memory: on a GPU (any accelerator but the CPU) the device memory its caching
    allocator handed out (max_memory_allocated: host memory is not the limit there), on CPU the peak RSS."""
    if accelerator.device_name() != "cpu":
        return int(accelerator.max_memory_allocated())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


def limit_device_memory(accelerator, limit_bytes, local_rank: int):
    """On a CUDA device, cap what this process's caching allocator may hold at `limit_bytes` (the
    fraction of the device's memory torch enforces), so that a larger configuration ends in a real CUDA
    out-of-memory error, as on a card with that much memory. The fraction set, or None (CPU: the RSS is
    checked against the limit instead; no limit; another accelerator)."""
    if not limit_bytes or accelerator.device_name() != "cuda":
        return None
    import torch

    fraction = min(1.0, limit_bytes / torch.cuda.get_device_properties(local_rank).total_memory)
    torch.cuda.set_per_process_memory_fraction(fraction, local_rank)
    return fraction


def process_is_alive(pid: int, create_time: float) -> bool:
    import psutil

    try:
        p = psutil.Process(pid)
        return abs(p.create_time() - create_time) < 1.0 and p.status() != psutil.STATUS_ZOMBIE  # not a reused pid
    except psutil.NoSuchProcess:
        return False


class Probe:
    def __init__(self, exp_dir: str, settings: dict):
        self.exp_dir = exp_dir
        self.settings = settings
        self.rank = next((int(os.environ[v]) for v in RANK_VARIABLES if v in os.environ), os.getpid())
        self.start = max(2, int(settings["start_profile_step"]))  # step 1 has no previous boundary
        self.end = max(self.start, int(settings["end_profile_step"]))
        self.limit = settings.get("memory_limit_bytes")
        self.device = "cpu"
        self.measure = settings["measure"]  # the window settings (conf measure.*), see mlautotune.run.measure
        self.accelerator = None  # DeepSpeed's accelerator, set in main(): synchronised at step boundaries in the window
        self.ends = []  # perf_counter when engine.global_steps became 1, 2, ... (after synchronising, in the window)
        self.starts = []  # perf_counter when the probe handed control back to the script after each step
        self.window = None  # once the window is closed: its first and last measured step
        self.wait_at_open = None  # (process, training thread): seconds waited for a CPU when the window opened (Linux)
        self.engine = None
        self.metrics = None  # rank 0: what metrics.json holds
        self.fwd_flops = None  # one micro-batch forward, from DeepSpeed's flops profiler
        self.peak = 0
        self.cores = None  # the CPU cores this rank is pinned to (measure.pin_rank), or None
        self.timeline = {"probe_start": PROBE_START, "launch": settings.get("launch_time")}
        self.forked = "deepspeed" in sys.modules  # a fork of a process that had imported it (runner_process), not a new interpreter
        self.uncounted = 0  # a forked rank: library pages a new interpreter's import makes resident, not touched here yet
        self.lock = threading.Lock()

    def mark(self, event: str) -> None:
        self.timeline.setdefault(event, time.time())

    def rank_record(self, status: str, **extra) -> dict:
        return {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(), "status": status, "peak_memory_bytes": self.peak,
                "memory_limit_bytes": self.limit, "optimizer_steps": len(self.ends), "cores": self.cores, "forked": self.forked, "uncounted_bytes": self.uncounted,
                "timeline": dict(self.timeline), **extra}

    def write_rank_record(self, status: str, **extra) -> None:
        from mlautotune.files import atomic_write_json

        atomic_write_json(os.path.join(self.exp_dir, rank_file(self.rank)), self.rank_record(status, **extra))

    def ended_early(self) -> str:
        return (f"the script ended after {len(self.ends)} optimizer steps, before the measurement window "
                f"(steps {self.start}..{self.end}) was complete")

    def exit_oom(self, reason: str) -> None:
        with self.lock:  # the watchdog and the training thread may both get here
            self.write_rank_record("oom", reason=reason)
            print(f"mlautotune probe: rank {self.rank}: {reason}", file=sys.stderr, flush=True)
            os._exit(OOM_EXIT_CODE)

    def count_inherited(self) -> None:
        """A forked rank's RSS misses the library pages its parent's import made resident (~200 MB of
        torch's), which a new interpreter counts: the ones it has not touched yet are added to its
        peak, so that the figure is a new rank's. Counted at the start, after the engine's
        initialisation and when the window opens (reading smaps takes ~10 ms: never inside it)."""
        if self.device == "cpu" and PARENT_FILE_PAGES:
            self.uncounted = measure.not_yet_resident(PARENT_FILE_PAGES)

    def check_memory(self) -> None:
        self.peak = max(self.peak, peak_memory_bytes(self.accelerator) + self.uncounted)
        if self.limit and self.peak > self.limit:
            self.exit_oom(f"peak memory {self.peak} bytes is over the limit of {self.limit} bytes per rank")

    def watchdog(self) -> None:
        """Samples RSS on CPU (a spike inside a step counts) and ends the experiment if the tuner is gone."""
        s = self.settings
        watch_tuner = s.get("tuner_pid") and s.get("tuner_host") == socket.gethostname()
        next_tuner_check = 0.0
        while True:
            if self.device == "cpu":
                self.check_memory()
            if watch_tuner and time.monotonic() > next_tuner_check:
                next_tuner_check = time.monotonic() + 1.0
                if not process_is_alive(s["tuner_pid"], s["tuner_create_time"]) and os.getpgrp() != s["tuner_pgid"]:
                    end_own_group(f"tuner {s['tuner_pid']} is gone")
            time.sleep(WATCH_INTERVAL_S)

    # Hooks called from the patched engine.
    def on_forward(self, engine, forward, args, kwargs):
        if self.fwd_flops is not None:
            return forward(engine, *args, **kwargs)
        from deepspeed.profiling.flops_profiler import FlopsProfiler

        self.mark("first_forward")
        self.count_inherited()
        prof = FlopsProfiler(engine.module)
        prof.start_profile()
        try:
            out = forward(engine, *args, **kwargs)
            self.fwd_flops = prof.get_total_flops()
        finally:
            prof.end_profile()
        self.mark("flops_profiled")
        return out

    def on_step(self, engine) -> None:
        """Called after every optimizer step. Inside the window the accelerator is synchronised first, so
        the step's end is when the device finished its work, not when the host ran ahead of it."""
        n = len(self.ends) + 1  # the optimizer step that just ended
        if self.window is None and n >= self.start - 1 and self.measure.get("synchronize", True):
            self.accelerator.synchronize()
        self.ends.append(time.perf_counter())
        self.engine = engine
        self.check_memory()
        if n == self.start - 1:
            self.count_inherited()
            self.mark("window_start")
            self.wait_at_open = (measure.cpu_wait_seconds(), measure.cpu_wait_seconds(this_thread=True))
        if self.window is None and measure.check_due(n, self.end, self.measure):
            self.check_window(n)
        self.starts.append(time.perf_counter())  # the probe's own time (checks, files) is no step's time

    def step_times(self, n: int) -> list:
        """Seconds of steps start..n: from the script getting control back after the previous step to this step's end."""
        return [self.ends[k - 1] - self.starts[k - 2] for k in range(self.start, n + 1)]

    def gather(self, mine: dict) -> list:
        """Every rank's `mine`, on every rank (the same list everywhere, so every rank decides alike)."""
        from deepspeed import comm as dist

        if not dist.is_initialized():  # the script tore the process group down: only this rank is known
            return [mine]
        self.rank = dist.get_rank()
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        return ranks

    def check_window(self, n: int, script_ended: bool = False) -> None:
        """The collective stop check: combine the ranks' step times (slowest rank per step) and decide."""
        import torch

        elapsed = self.ends[n - 1] - self.starts[self.start - 2]
        waits = (measure.cpu_wait_seconds(), measure.cpu_wait_seconds(this_thread=True))
        share = [(now - then) / elapsed if None not in (now, then) and elapsed > 0 else 0.0 for now, then in zip(waits, self.wait_at_open)]
        mine = {"step_times": self.step_times(n), "elapsed": elapsed, "peak": self.peak, "fwd_flops": self.fwd_flops or 0,
                "threads": torch.get_num_threads(), "pinned": self.cores is not None, "cpu_wait": share[0], "thread_wait": share[1]}
        ranks = self.gather(mine)
        steps = [max(per_rank) for per_rank in zip(*(r["step_times"] for r in ranks))]
        elapsed = max(r["elapsed"] for r in ranks)
        waits = {"cpu_wait_share": max(0.0, *(r["cpu_wait"] for r in ranks)), "thread_wait_share": max(0.0, *(r["thread_wait"] for r in ranks))}
        decision = measure.decide(steps, elapsed, self.end - self.start + 1, self.measure, waits["thread_wait_share"])
        if decision.stop or script_ended:
            self.close_window(n, steps, ranks, decision, elapsed, waits, cut=not decision.stop)

    def close_window(self, n: int, steps: list, ranks: list, decision, elapsed: float, waits: dict, cut: bool = False) -> None:
        """Write metrics.json on rank 0; end every rank, unless this is the final training (it goes on).
        `cut`: the script's own end closed the window, before its target interval or budget."""
        from deepspeed import comm as dist

        from mlautotune.files import atomic_write_json

        self.mark("window_end")
        self.window = {"last": n, "first": self.start + decision.warmup}
        if self.rank == 0:
            self.metrics = {**self.window_metrics(steps[decision.warmup:], ranks, decision, elapsed, waits), "window_cut_by_script": cut}
            atomic_write_json(os.path.join(self.exp_dir, METRICS_FILE), self.metrics)
        self.mark("combined")
        self.write_rank_record("measured", step_times_ms=[t * 1000.0 for t in self.step_times(n)])  # this rank's own, for offline study
        if not self.settings.get("stop_after_window", True):
            return  # the final training: keep training to the script's own end
        if dist.is_initialized():
            dist.barrier()
        release_own_shared_memory()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    def at_script_end(self) -> None:
        """The script returned: close a window that reached its minimum, or record the end-to-end throughput
        after warm-up (final training); a script that ended before the minimum window is incomplete."""
        self.mark("script_end")
        n = len(self.ends)
        if self.window is None and n >= self.end:
            self.check_window(n, script_ended=True)
        if self.window is None:
            self.write_rank_record("ended", reason=self.ended_early())
            return
        first = self.window["first"]  # from the first step after warm-up to the last step's end (not the script's own epilogue),
        # less the probe's own time between steps (the window's collective checks): the user's training will not have it
        probe_s = sum(self.starts[k] - self.ends[k] for k in range(first - 1, n - 1))
        mine = {"seconds": self.ends[-1] - self.starts[first - 2] - probe_s, "steps": n - first + 1}
        ranks = self.gather(mine)
        if self.rank == 0 and self.metrics is not None:
            from mlautotune.files import atomic_write_json

            seconds = max(r["seconds"] for r in ranks)
            self.metrics.update(end_to_end_steps=mine["steps"], end_to_end_seconds=seconds,
                                end_to_end_throughput=self.metrics["train_batch_size"] * mine["steps"] / seconds)
            atomic_write_json(os.path.join(self.exp_dir, METRICS_FILE), self.metrics)
        self.write_rank_record("measured")

    def window_metrics(self, steps: list, ranks: list, decision, elapsed: float, waits: dict) -> dict:
        engine = self.engine
        med, lo, hi = statistics.median(steps), min(steps), max(steps)
        tbs, mbs, gas = engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
        params = list(engine.module.parameters())
        numel = lambda p: getattr(p, "ds_numel", p.numel())  # ZeRO-3 partitions keep the full size in ds_numel
        fwd_flops = max(r["fwd_flops"] for r in ranks)
        return {
            "throughput": tbs / med,
            "latency": med * 1000.0,
            "FLOPS_per_gpu": 3 * fwd_flops * gas / med,  # forward + backward (2x forward), every micro-step
            "peak_memory_bytes": max(r["peak"] for r in ranks),
            "step_time_median_ms": med * 1000.0,
            "step_time_min_ms": lo * 1000.0,
            "step_time_max_ms": hi * 1000.0,
            "step_time_spread": (hi - lo) / med,
            "step_times_ms": [t * 1000.0 for t in steps],
            "interval_rel": decision.interval_rel if math.isfinite(decision.interval_rel) else None,
            "target_reached": decision.target_reached,
            "disturbed": decision.disturbed,
            "step_time_shift": decision.shift,
            **waits,  # shares of the window spent waiting for a CPU: all of a rank's threads, its training thread (decides)
            "warmup_steps": decision.warmup,
            "measured_steps": len(steps),
            "measure_seconds": elapsed,
            "adaptive": bool(self.measure["adaptive"]),
            "threads_per_rank": max(r["threads"] for r in ranks),
            "cores_pinned": all(r["pinned"] for r in ranks),
            "train_batch_size": tbs,
            "micro_batch": mbs,
            "gas": gas,
            "world_size": len(ranks),
            "num_params": sum(numel(p) for p in params),
            "trainable_num_params": sum(numel(p) for p in params if p.requires_grad),
            "start_profile_step": self.start,
            "end_profile_step": self.end,
            "first_measured_step": self.window["first"],
            "last_measured_step": self.window["last"],
        }


def install(probe: Probe) -> None:
    """Wrap the engine's forward/step and time deepspeed.initialize and the process-group init."""
    import deepspeed
    import deepspeed.comm
    from deepspeed.runtime.engine import DeepSpeedEngine

    forward, step = DeepSpeedEngine.forward, DeepSpeedEngine.step

    def probed_forward(engine, *args, **kwargs):
        return probe.on_forward(engine, forward, args, kwargs)

    def probed_step(engine, *args, **kwargs):
        before = engine.global_steps
        out = step(engine, *args, **kwargs)
        if engine.global_steps != before:
            probe.on_step(engine)
        return out

    DeepSpeedEngine.forward, DeepSpeedEngine.step = probed_forward, probed_step

    def timed(fn, start, end):
        def wrapper(*args, **kwargs):
            probe.mark(start)
            out = fn(*args, **kwargs)
            probe.mark(end)
            return out
        return wrapper

    deepspeed.comm.init_distributed = timed(deepspeed.comm.init_distributed, "pg_init_start", "pg_init_end")
    deepspeed.init_distributed = timed(deepspeed.init_distributed, "pg_init_start", "pg_init_end")
    deepspeed.initialize = timed(deepspeed.initialize, "initialize_start", "initialize_end")


def is_accelerator_oom(exc: BaseException) -> bool:
    import torch

    while exc is not None:
        if isinstance(exc, torch.OutOfMemoryError):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def main(argv) -> None:
    local_rank = [argv.pop(0)] if argv and argv[0].startswith("--local_rank") else []
    exp_dir, script, script_args = argv[0], argv[1], argv[2:]
    with open(os.path.join(exp_dir, SETTINGS_FILE)) as f:
        probe = Probe(exp_dir, json.load(f))
    probe.cores = measure.pin_rank()  # before torch is imported: the threads it starts inherit the affinity

    import deepspeed  # noqa: F401  (imported here so "imports" is timed apart from the script)
    from deepspeed.accelerator import get_accelerator

    cpu_features.install()  # DeepSpeed's op loading asks for the CPU's flags: from a file, not ~1.4 s per question

    probe.accelerator = get_accelerator()
    probe.device = probe.accelerator.device_name()
    limit_device_memory(probe.accelerator, probe.limit, int(os.environ.get("LOCAL_RANK", 0)))
    probe.count_inherited()
    threading.Thread(target=probe.watchdog, name="mlautotune-watchdog", daemon=True).start()
    if probe.settings.get("lifeline"):  # ranks on other hosts: the tuner's kill of the local group does not reach them
        from mlautotune.run.lifeline import hold

        host, port, token = probe.settings["lifeline"]
        hold((host, port), token)
    install(probe)
    probe.mark("script_start")

    sys.argv = [script, *local_rank, *script_args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` would have it
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code in (0, None):
            probe.at_script_end()
        else:
            probe.write_rank_record("failed", reason=f"the script called exit({e.code!r})")
        raise
    except BaseException as e:
        if is_accelerator_oom(e):
            probe.exit_oom(f"accelerator out of memory: {e}")
        probe.write_rank_record("failed", error=f"{type(e).__name__}: {e}"[:500])
        raise
    probe.at_script_end()


if __name__ == "__main__":
    main(sys.argv[1:])
