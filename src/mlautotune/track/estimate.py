"""The full-run estimate: the planned run's wall time and GPU-hours at the optimum and at the user's
starting configuration, and the hours saved, each with the 95% interval of the measurements behind it.

Pure arithmetic on the measured configurations; no files, no tracking. The planned length becomes
samples (steps x samples per step, or tokens / tokens per sample), and a configuration's time is
samples / its throughput. The throughput's interval is the median step time's (`interval_rel`,
narrowed by re-measurements): the hours, proportional to the step time, carry it as it is. The hours
saved take each end from the worst case of the two intervals (start low - optimum high, start high -
optimum low), so they hold at least as surely as either measurement does.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional

from mlautotune.inputs.planned import Planned
from mlautotune.search import Measured


BATCH_OF_OPTIMUM = "the optimum's: the ds_config gives no single batch size"


@dataclass(frozen=True)
class Hours:
    mid: float
    low: float
    high: float

    def times(self, k: float) -> "Hours":
        return Hours(self.mid * k, self.low * k, self.high * k)


def throughput_of(m: Measured, metric: str) -> float:
    """The configuration's throughput (samples/s) at the median of its measurements of `metric`: its
    first measurement's throughput, scaled as the metric's median is to that measurement's value
    (throughput and FLOPS grow as the step time falls, latency with it)."""
    first = float(m.result.metrics["throughput"])
    if metric == "latency":
        return first * m.value / m.final_value
    return first * m.final_value / m.value


def run_hours(samples: float, throughput: float, interval_rel: float) -> Hours:
    """Hours to train `samples` at `throughput` samples/s, whose step time is known to +-interval_rel."""
    mid = samples / throughput / 3600.0
    return Hours(mid, max(0.0, mid * (1.0 - interval_rel)), mid * (1.0 + interval_rel))


def saved_hours(start: Hours, optimum: Hours, same: bool = False) -> Hours:
    """Start minus optimum; the ends are the worst cases of the two intervals. The same configuration
    (the start is the optimum) saves exactly nothing: one measurement, not two."""
    if same:
        return Hours(0.0, 0.0, 0.0)
    return Hours(start.mid - optimum.mid, start.low - optimum.high, start.high - optimum.low)


def planned_samples(planned: Planned, samples_per_step: Optional[int], tokens_per_sample: Optional[int]) -> Optional[float]:
    """The planned run in samples, or None when it needs what is not known (epochs: the data set's
    size; tokens: the sequence length; steps: a batch size)."""
    if planned.unit == "samples":
        return planned.amount
    if planned.unit == "steps" and samples_per_step:
        return planned.amount * samples_per_step
    if planned.unit == "tokens" and tokens_per_sample:
        return planned.amount / tokens_per_sample
    return None


@dataclass
class Estimate:
    """What summary.txt, the console and the parent run say about the full run."""

    lines: List[str]
    metrics: Dict[str, float]

    @property
    def tag(self) -> str:
        return " ".join(" ".join(self.lines).split())


def full_run(planned: Optional[Planned], optimum: Optional[Measured], start: Optional[Measured], start_why: str, *, metric: str,
             world_size: int, user_batch: Optional[int], tokens: Optional[tuple] = None) -> Optional[Estimate]:
    """The estimate for the optimum and the user's start (`start`: its measurement when it ran;
    `start_why`: why there is none, else ''). `user_batch`: the ds_config's samples per step when it
    gives one; `tokens`: (tokens per sample, the flag it came from). None without an optimum."""
    if optimum is None or optimum.final_value is None:
        return None
    head = "Full-run estimate:"
    if planned is None:
        return Estimate([f"{head} none: give the full run's length as autotuning.planned_steps, planned_samples or planned_tokens "
                         "for its wall time and GPU-hours at the optimum."], {})
    what = f"{_count(planned.amount)} {planned.unit} ({planned.source})"
    opt_batch = int(optimum.result.metrics.get("train_batch_size") or 0) or None
    per_step = user_batch or opt_batch
    samples = planned_samples(planned, per_step, tokens[0] if tokens else None)
    if samples is None:
        need = {"epochs": "the data set's size in samples, which the script does not report: give autotuning.planned_samples (epochs x samples per epoch) or planned_steps instead",
                "tokens": "the sequence length (tokens per sample), which the script's arguments do not give (--seq_len, --seq_length, --block_size or --max_seq_length): give autotuning.planned_samples or planned_steps instead",
                "steps": "the batch size in samples per step, which neither the ds_config nor the optimum's measurement gives"}[planned.unit]
        return Estimate([f"{head} none for {what}: it needs {need}."], {})
    if planned.unit == "steps":
        basis = f" x {per_step} samples per step ({'your batch size' if user_batch else BATCH_OF_OPTIMUM})"
    elif planned.unit == "tokens":
        basis = f" / {tokens[0]} tokens per sample ({tokens[1]})"
    else:
        basis = ""
    lines = [f"{head} {what}{basis} = {_count(samples)} samples." if basis else f"{head} {what}."]
    if planned.unit == "steps" and user_batch and opt_batch and opt_batch != user_batch:
        lines.append(f"  The optimum's batch is {opt_batch} samples per step: the same samples take {_count(samples / opt_batch)} of its steps.")
    rate = throughput_of(optimum, metric)
    opt = run_hours(samples, rate, optimum.interval)
    metrics = {"estimate.planned_samples": samples, "estimate.optimum_throughput": rate, **_hours_metrics("optimum", opt, world_size)}
    lines.append(f"  At the optimum {optimum.result.name}: {_span(opt)}, {_gpu(opt, world_size)}.")
    if start is None or start.final_value is None:
        lines.append(f"  Your starting configuration: {start_why or 'not measured'}, so there is no time to compare with.")
        return Estimate(lines, metrics)
    start_rate = throughput_of(start, metric)
    begin = run_hours(samples, start_rate, start.interval)
    saved = saved_hours(begin, opt, same=start.trial_number == optimum.trial_number)
    metrics.update({"estimate.start_throughput": start_rate, **_hours_metrics("start", begin, world_size), **_hours_metrics("saved", saved, world_size)})
    lines.append(f"  At your starting configuration {start.result.name}: {_span(begin)}, {_gpu(begin, world_size)}.")
    lines.append(f"  Saved: {_span(saved)}, {_gpu(saved, world_size)}."
                 + (" Your starting configuration is the optimum." if start.trial_number == optimum.trial_number else ""))
    return Estimate(lines, metrics)


def _hours_metrics(name: str, h: Hours, world_size: int) -> Dict[str, float]:
    gpu = h.times(world_size)
    return {f"estimate.{name}_hours": h.mid, f"estimate.{name}_hours_low": h.low, f"estimate.{name}_hours_high": h.high,
            f"estimate.{name}_gpu_hours": gpu.mid, f"estimate.{name}_gpu_hours_low": gpu.low, f"estimate.{name}_gpu_hours_high": gpu.high}


UNITS = (("h", 1.0), ("min", 60.0), ("s", 3600.0))


def unit_of(hours: float) -> str:
    """Hours from an hour on (and for 0), minutes under an hour, seconds under a minute."""
    size = abs(hours)
    return "h" if size >= 1 or size == 0 else "min" if size * 60 >= 1 else "s"


def duration(hours: float, unit: Optional[str] = None) -> str:
    """4 significant digits in `unit` (by default the one that suits the size)."""
    unit = unit or unit_of(hours)
    return f"{_num(hours * dict(UNITS)[unit])} {unit}"


def _span(h: Hours) -> str:
    """The three in the middle's unit, so they read at a glance."""
    u = unit_of(h.mid)
    return f"{duration(h.mid, u)} ({duration(h.low, u)} to {duration(h.high, u)}, 95% interval)"


def _gpu(h: Hours, world_size: int) -> str:
    g = h.times(world_size)
    return f"{_num(g.mid)} GPU-hours ({_num(g.low)} to {_num(g.high)}) on {world_size} device{'s' * (world_size != 1)}"


def _num(x: float) -> str:
    """4 significant digits, and every digit of the whole part from 1,000 on (never 1.2e+04)."""
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"


def _count(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 or float(x).is_integer() else f"{x:.4g}"
