"""The search, one module per job:

- settings.py: SearchSettings
- candidates.py: what can be run (default knobs, knob combinations, the study's distributions)
- ledger.py: every experiment as an Optuna trial (public API, plain param names), resume, pending trials of other workers
- search.py: the search (profiling, then the acquisition's best candidate until the stop rule says stop; docs/search.md)
- step.py: a step (what to measure next, and why), and what the search shares with profiling
- profiling.py: the first runs and the memory model
- constrained.py: the space every sampler proposes from
- model.py: throughput with its uncertainty (a Gaussian process); fits.py: P(fits) (the memory model as prior)
- smc.py: draws from a posterior by tempered resample-move (fits.py's OOM evidence)
- acquisition.py: expected gain of the declared optimum per second, OOM risk as a cost
- stop.py: the stop rule
- samplers/: gridsearch, random, any Optuna sampler (search.sampler), and the CostModelSampler
- tuner.py: the loop that asks the search, claims a trial, runs it and records it
"""

from mlautotune.search.candidates import base_params, product
from mlautotune.search.ledger import METRIC_KEYS, Measured, experiments_in
from mlautotune.search.settings import SearchSettings
from mlautotune.search.profiling import first_experiments
from mlautotune.search.tuner import Outcome, Tuner

__all__ = ["METRIC_KEYS", "Measured", "Outcome", "SearchSettings", "Tuner", "base_params", "experiments_in", "first_experiments", "product"]
