"""The statistics of the adaptive measurement window, and the threads and cores a CPU rank gets. Pure Python.

The probe in every rank collects the step times (slowest rank per step) from start_profile_step on
and asks `decide` every few steps whether to stop: leading steps that are still settling are
skipped as warm-up, and the window ends once the median step time is known to within the target
relative confidence interval, or once the measuring budget is spent. The interval is
distribution-free: order statistics of the sample, with ranks from the binomial distribution, for the
sample's effective size (step times that follow each other count as fewer independent ones).
"""

import math
import os
import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple


# What metrics.json says about its measurement window (beyond throughput, latency, FLOPS_per_gpu), one list for
# every reader: the console, the child runs.
WINDOW_KEYS = ("interval_rel", "target_reached", "disturbed", "step_time_shift", "cpu_wait_share", "thread_wait_share",
               "warmup_steps", "measured_steps", "measure_seconds", "threads_per_rank", "cores_pinned", "window_cut_by_script")


MIN_STEPS_FOR_AUTOCORRELATION = 10
MAX_AUTOCORRELATION = 0.9


@dataclass(frozen=True)
class Decision:
    stop: bool
    warmup: int  # leading steps skipped as warm-up
    interval_rel: float  # relative half-width of the median's confidence interval (inf: too few steps), at least the disturbance's cost
    target_reached: bool  # interval_rel <= the target; a window that ends short of it is not disturbed, only less precise
    disturbed: bool  # a rank's training thread waited for a CPU longer than max_cpu_wait of the window, or the step time shifted
    shift: float = 0.0  # step_time_shift of the measured steps


def median_interval(times: Sequence[float], confidence: float = 0.95, n_eff: Optional[float] = None) -> Tuple[float, float, float]:
    """(median, low, high): a distribution-free confidence interval for the median.

    [x_(j), x_(n+1-j)] of the sorted sample covers the median with probability 1 - 2 P(B <= j-1),
    B ~ Binomial(n, 1/2); j is the largest rank that keeps this at least `confidence`. Below 6 values
    no pair reaches 95%, and the interval is the whole range [min, max]. `n_eff`: the sample is worth
    only this many independent values (correlated steps, `effective_size`); the ranks are found for
    n_eff values and taken at the same quantiles of the whole sample.
    """
    x = sorted(times)
    n = len(x)
    if n == 0:
        raise ValueError("no step times")
    m = n if n_eff is None else max(1, min(n, int(n_eff)))
    alpha = (1.0 - confidence) / 2.0
    j, cdf = 1, 0.5**m  # cdf = P(B <= j-1)
    while j < (m + 1) // 2:
        nxt = cdf + math.comb(m, j) * 0.5**m  # P(B <= j)
        if nxt > alpha:
            break
        j, cdf = j + 1, nxt
    if m < n:
        j = max(1, math.floor(j * (n + 1) / (m + 1)))  # the same quantile, j / (m + 1), of the n values
    return statistics.median(x), x[j - 1], x[n - j]


def lag1_autocorrelation(times: Sequence[float]) -> float:
    """How much each step time follows the one before (0: independent; near 1: long slow and fast stretches)."""
    mean = statistics.fmean(times)
    total = sum((t - mean) ** 2 for t in times)
    return sum((a - mean) * (b - mean) for a, b in zip(times, times[1:])) / total if total > 0 else 0.0


def effective_size(times: Sequence[float]) -> float:
    """How many independent step times the window is worth. Step times come in stretches (the machine's
    other work, the clock) when they follow each other: with lag-1 autocorrelation r, n (1 - r) / (1 + r)
    (AR(1)). r is taken less half its spread under independence (1 / sqrt(n)), so that independent steps
    are seldom taken for correlated ones by chance, and within [0, MAX_AUTOCORRELATION]; below
    MIN_STEPS_FOR_AUTOCORRELATION steps it is not estimated."""
    n = len(times)
    if n < MIN_STEPS_FOR_AUTOCORRELATION:
        return float(n)
    r = min(max(lag1_autocorrelation(times) - 0.5 / math.sqrt(n), 0.0), MAX_AUTOCORRELATION)
    return n * (1 - r) / (1 + r)


def fewest_steps(confidence: float = 0.95) -> int:
    """The fewest values whose range [min, max] covers the median with `confidence` (6 for 95%): below it
    no interval from order statistics has that coverage, whatever the values."""
    return max(2, math.ceil(math.log2(2.0 / (1.0 - confidence))))


def interval_rel(times: Sequence[float], confidence: float = 0.95) -> float:
    """The larger side of the median's confidence interval, relative to the median (0.02: +-2%), for
    the window's effective number of independent steps."""
    if len(times) < 2:
        return math.inf
    med, lo, hi = median_interval(times, confidence, effective_size(times))
    return max(med - lo, hi - med) / med if med > 0 else math.inf


def warmup_steps(times: Sequence[float], tolerance: float, cap: int, keep: int) -> int:
    """Leading steps still settling: each is slower than (1 + tolerance) x the median of the steps after it.

    At most `cap`, at most half the steps (a noisy run is not all warm-up), and never so many that
    fewer than `keep` steps remain.
    """
    limit = max(0, min(cap, len(times) // 2, len(times) - keep))
    for d in range(limit):
        if times[d] <= (1.0 + tolerance) * statistics.median(times[d + 1:]):
            return d
    return limit


def step_time_shift(times: Sequence[float], confidence: float = 0.95) -> float:
    """How far the median step time moved between the window's two halves, relative to the whole window's
    median, when the halves' confidence intervals do not even overlap (a change of regime: work that began
    or ended on the machine mid-window); 0.0 otherwise, or when a half has too few steps to tell."""
    half = len(times) // 2
    if half < fewest_steps(confidence):
        return 0.0
    (m1, lo1, hi1), (m2, lo2, hi2) = median_interval(times[:half], confidence), median_interval(times[half:], confidence)
    return abs(m1 - m2) / statistics.median(times) if hi1 < lo2 or hi2 < lo1 else 0.0


def decide(times: Sequence[float], elapsed_s: float, min_steps: int, settings: Dict, cpu_wait: float = 0.0) -> Decision:
    """Whether the window can end now. `times`: step times from start_profile_step on (slowest rank per
    step); `elapsed_s`: seconds since the window opened (warm-up included); `min_steps`: the user's
    window length (end_profile_step - start_profile_step + 1), a minimum; `cpu_wait`: the largest share
    of the window a rank's training thread spent runnable but waiting for a CPU (another process or
    thread took it): the step time it may have cost, at most.

    Not reaching the target is not a disturbance: the interval says how precise the figure is. A window
    is disturbed when its training threads waited for CPUs, even when its step times agree (a constant
    slowdown), or when its step time shifted between its halves by more than the target. It goes on to
    the budget, so the disturbance weighs less if it passes, and is flagged (the search re-measures it),
    with an interval of at least the wait or the shift: what the disturbance may have cost."""
    adaptive = settings["adaptive"]
    w = warmup_steps(times, settings["warmup_tolerance"], settings["max_warmup_steps"], min_steps) if adaptive else 0
    measured = times[w:]
    rel = interval_rel(measured, settings["confidence"])
    reached = rel <= settings["target_interval"] and len(measured) >= fewest_steps(settings["confidence"])  # 3 close values prove nothing
    shift = step_time_shift(measured, settings["confidence"])
    cost = max(cpu_wait if cpu_wait > settings["max_cpu_wait"] else 0.0, shift if shift > settings["target_interval"] else 0.0)
    disturbed = cost > 0
    enough = len(measured) >= min_steps
    return Decision(stop=not adaptive or (enough and ((reached and not disturbed) or elapsed_s >= settings["budget_s"])),
                    warmup=w, interval_rel=max(rel, cost), target_reached=reached, disturbed=disturbed, shift=shift)


def cut_short_note(metrics: Dict) -> Optional[str]:
    """Advice when the script's own end closed a measurement window short of its target interval (and
    of its budget): the figure stands on fewer steps than the window would have taken."""
    if not metrics.get("window_cut_by_script") or metrics.get("target_reached"):
        return None
    return ("the script ended before its measurement window reached the target interval (measure.target_interval) or the "
            "budget (measure.budget_s), so those figures stand on fewer steps, with wider intervals (window_cut_by_script on the "
            "experiment's child run). Give the script more steps (its own argument, e.g. --steps or --max_steps): mlautotune ends "
            "every experiment once it is measured, so the budget, not the script's length, bounds each experiment")


def check_due(n: int, end: int, settings: Dict) -> bool:
    """Whether the ranks check the window after optimizer step n (1-based; `end`: end_profile_step)."""
    if not settings["adaptive"]:
        return n == end
    return n >= end and (n - end) % settings["check_every"] == 0


def replay(times: Sequence[float], start: int, end: int, settings: Dict, cpu_wait: float = 0.0) -> Tuple[int, Decision]:
    """Where the probe's window would close on recorded step times (times[0] is step `start`), and its decision:
    the probe's loop without the training, for tests and offline study. (len(times) + start - 1, last
    decision) when the recording ends first."""
    decision = None
    for n in range(end, start + len(times)):
        if check_due(n, end, settings):
            measured = times[:n - start + 1]
            decision = decide(measured, sum(measured), end - start + 1, settings, cpu_wait)
            if decision.stop:
                return n, decision
    return start + len(times) - 1, decision


def cpu_wait_seconds(this_thread: bool = False) -> Optional[float]:
    """Seconds this process's threads (or only the calling thread) have spent runnable but waiting for a CPU
    (Linux schedstat); None elsewhere."""
    try:
        paths = ["/proc/thread-self/schedstat"] if this_thread else [f"/proc/self/task/{t}/schedstat" for t in os.listdir("/proc/self/task")]
        total = 0
        for path in paths:
            try:
                with open(path) as f:
                    total += int(f.read().split()[1])
            except FileNotFoundError:  # a thread that just ended
                continue
    except (OSError, ValueError, IndexError):
        return None
    return total / 1e9


# ---- a CPU rank's memory ---------------------------------------------------------------------------

def resident_file_pages() -> Dict[str, int]:
    """Resident bytes of each file this process maps (from /proc/self/smaps: the libraries' code and
    data it has touched), {} where unknown."""
    pages: Dict[str, int] = {}
    path = None
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                if line[0] in "0123456789abcdef":  # a mapping's header: address range, perms, offset, device, inode, path
                    fields = line.split(None, 5)
                    path = fields[5].strip() if len(fields) > 5 and fields[5].startswith("/") else None
                elif path is not None and line.startswith("Rss:"):
                    pages[path] = pages.get(path, 0) + int(line.split()[1]) * 1024
    except OSError:
        return {}
    return pages


def not_yet_resident(baseline: Dict[str, int]) -> int:
    """Bytes of the baseline's resident file pages that this process has not made resident (yet). A
    forked process starts with few: fork does not copy the page tables of shared file mappings."""
    if not baseline:
        return 0
    now = resident_file_pages()
    return sum(max(0, size - now.get(path, 0)) for path, size in baseline.items())


# ---- threads and cores per CPU rank -------------------------------------------------------------

THREAD_VARIABLES = ("OMP_NUM_THREADS",)
BIND_FLAG = "--bind_cores_to_rank"
PIN_VARIABLE = "MLAUTOTUNE_CORES_PER_RANK"  # set by the tuner, read by the probe in each CPU rank


def usable_cores() -> int:
    """The cores this process may run on (affinity and cpusets respected where the OS tells)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def thread_env(device: str, local_ranks: int, launcher_args: List[str], pin: bool = False,
               environ: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """OMP_NUM_THREADS = cores / local ranks for CPU ranks (torch takes its intra-op threads from it), and
    with `pin`, the share of cores each rank is pinned to (`rank_cores`) when every rank can have one.

    Nothing when the ranks run on an accelerator, when the user set OMP_NUM_THREADS, or when
    DeepSpeed's --bind_cores_to_rank divides the cores itself.
    """
    environ = os.environ if environ is None else environ
    if device != "cpu" or any(v in environ for v in THREAD_VARIABLES) or BIND_FLAG in launcher_args:
        return {}
    cores = usable_cores()
    per_rank = str(max(1, cores // max(1, local_ranks)))
    pin = pin and cores >= local_ranks  # fewer cores than ranks: no share for some, so none is pinned (DeepSpeed's bind refuses it)
    return {"OMP_NUM_THREADS": per_rank, **({PIN_VARIABLE: per_rank} if pin else {})}


def rank_cores(available: Sequence[int], local_rank: int, per_rank: int) -> List[int]:
    """The cores of local rank `local_rank`: its consecutive share of the cores the tuner may use, as
    DeepSpeed's --bind_cores_to_rank divides them (all of them when there are fewer than the ranks)."""
    cores = sorted(available)
    return cores[local_rank * per_rank:(local_rank + 1) * per_rank] or cores


def pin_rank(environ: Optional[Dict[str, str]] = None) -> Optional[List[int]]:
    """Pins this CPU rank to its share of cores when the tuner asked for it (PIN_VARIABLE); called before
    torch starts its threads, which inherit the affinity. A rank that keeps its cores has no other
    rank's threads migrating onto them mid-window. The cores pinned, or None."""
    environ = os.environ if environ is None else environ
    per_rank = int(environ.get(PIN_VARIABLE) or 0)
    if per_rank < 1 or not hasattr(os, "sched_setaffinity"):
        return None
    cores = rank_cores(os.sched_getaffinity(0), int(environ.get("LOCAL_RANK") or 0), per_rank)
    os.sched_setaffinity(0, cores)
    return cores
