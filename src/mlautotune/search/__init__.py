"""The search, one module per step:

- settings.py: SearchSettings
- candidates.py: what can be run (default knobs, knob combinations, the study's distributions)
- ledger.py: every experiment as an Optuna trial (public API, plain param names), resume, pending trials of other workers
- microbatch.py: the memory edge and the throughput peak along the micro-batch (pure functions)
- strategy.py: the order of the steps, and what they share (the incumbent, the noise, the global stop rule)
- step.py: a step (what to measure next, and why)
- profiling.py, lines.py, knobs.py, repeats.py: the steps (profiling and the memory model; each
  stage's micro-batch; knobs and the best knobs' micro-batch; measuring again)
- tuner.py: the loop that asks the strategy, claims a trial, runs it and records it

search.strategy=v3 (docs/search.md) replaces the steps with one model, one acquisition, one stop rule:
- v3.py: the strategy (profiling, then the acquisition's best candidate until the stop rule says stop)
- constrained.py: the space every sampler proposes from
- model.py: throughput with its uncertainty (a Gaussian process) and P(fits) (the memory model as prior)
- acquisition.py: expected gain of the declared optimum per second, OOM risk as a cost
- stop.py: the stop rule
"""

from mlautotune.search.candidates import base_params, product
from mlautotune.search.ledger import METRIC_KEYS, Measured, experiments_in
from mlautotune.search.settings import SearchSettings
from mlautotune.search.profiling import first_experiments
from mlautotune.search.tuner import Outcome, Tuner

__all__ = ["METRIC_KEYS", "Measured", "Outcome", "SearchSettings", "Tuner", "base_params", "experiments_in", "first_experiments", "product"]
