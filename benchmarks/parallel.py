"""Simulated wall-clock time with N workers: the product's real tuner, N times, on one Optuna study.

Each worker is its own `Tuner` (its own Study object on one shared in-memory storage, `alone=False`,
exactly as separate `mlautotune worker` processes on one database). Time is simulated: an event
queue ordered by each experiment's finish time, from the landscape's wall time for its params.

- At time t every idle worker asks its tuner for a step (`Tuner.propose`): the trial is claimed
  (RUNNING in the study, so the other workers see it as pending) and finishes at t + its wall time.
- The earliest finish is popped: the clock moves there, the experiment is measured on the landscape
  (the noise is drawn then) and recorded through `Tuner.run`; then every idle worker asks again.
- A worker with nothing to propose while others' trials are pending waits for the next finish;
  the run ends when no trial is in flight and no worker proposes anything (or the budget is spent).

The runner's log is in finish order, each entry with `end_s`, the simulated time it finished.
"""

import heapq
import itertools
from typing import Any, Callable, Dict, List, Tuple


def simulate(make_tuner: Callable[[Any], Any], storage: Any, workers: int, runner: Any) -> Any:
    """Run `workers` tuners (make_tuner(storage) -> Tuner, whose run function measures on `runner`)
    to the end; the first tuner, whose `best()` is the declared optimum of the whole study."""
    tuners = [make_tuner(storage) for _ in range(workers)]
    clock, order = 0.0, itertools.count()
    in_flight: List[Tuple[float, int, int, Any, Any]] = []  # (finish time, tie-break, worker, trial, step)
    idle = list(range(workers))
    stopped: set = set()
    while True:
        for w in list(idle):
            claimed = tuners[w].propose()
            if claimed == "budget":
                stopped.add(w)
                idle.remove(w)
            elif claimed is not None:
                trial, step = claimed
                wall = runner.truth(dict(trial.params))[2]
                heapq.heappush(in_flight, (clock + wall, next(order), w, trial, step))
                idle.remove(w)
        if not in_flight:
            break
        clock, _, w, trial, step = heapq.heappop(in_flight)
        runner.clock, runner.why = clock, step.why
        tuners[w].run(trial, step)
        idle = [i for i in range(workers) if i not in stopped and not any(f[2] == i for f in in_flight)]
    tuners[0].ledger.refresh()
    return tuners[0]


def finish_times(log: List[Dict[str, Any]]) -> List[float]:
    """Each logged experiment's finish time: simulated (`end_s`) where present, else the running sum of wall times."""
    total, out = 0.0, []
    for e in log:
        total += e["wall_time_s"]
        out.append(e.get("end_s", total))
    return out

