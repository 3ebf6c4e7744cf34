"""The XGBoost cost model's parts that CostModelSampler (cost_model_sampler.py) uses: feature encoding
for spaces of different shapes, and a classifier for feasibility (ok vs OOM)."""

import math
from typing import Any, Dict, List, Sequence

import numpy as np

LOG_THRESHOLD = 1000  # numeric knobs at or above this are sizes: encoded on a log2 scale


def encode(params_list: Sequence[Dict[str, Any]], keys: Sequence[str]) -> np.ndarray:
    """One row per params: stage one-hot, micro_batch/gas and sizes as log2, booleans 0/1,
    strings one-hot (by key=value), a knob missing from a stage's space as NaN."""
    strings = sorted({f"{k}={p[k]}" for p in params_list for k in keys if isinstance(p.get(k), str)})
    rows = []
    for p in params_list:
        row = [1.0 if p.get("stage") == s else 0.0 for s in range(4)]
        for k in keys:
            if k == "stage":
                continue
            v = p.get(k)
            if v is None or isinstance(v, str):
                row.append(math.nan)
            elif isinstance(v, bool):
                row.append(float(v))
            elif k in ("micro_batch", "gas") or abs(v) >= LOG_THRESHOLD:
                row.append(math.log2(max(float(v), 1e-9)))
            else:
                row.append(float(v))
        row += [1.0 if f"{k}={p.get(k)}" == s else 0.0 for s in strings for k in [s.split("=")[0]]]
        rows.append(row)
    return np.array(rows, dtype=float)


def all_keys(params_lists: Sequence[Sequence[Dict[str, Any]]]) -> List[str]:
    return sorted({k for ps in params_lists for p in ps for k in p})


class CostModel:
    def __init__(self, seed: int = 0):
        self.seed = seed
        self._clf = None
        self._ooms: List[Dict[str, Any]] = []
        self._feasible_default = 1.0

    def fit_feasibility(self, params_list: List[Dict[str, Any]], ok: List[bool]) -> "CostModel":
        self._clf_keys = all_keys([params_list])
        self._ooms = [p for p, good in zip(params_list, ok) if not good]
        self._clf = None
        if len(set(ok)) < 2:
            self._feasible_default = 1.0 if (not ok or ok[0]) else 0.0
            return self
        import xgboost as xgb

        # min_child_weight low: a session has a handful of labelled runs, and the split that matters
        # (the micro-batch where memory runs out) may rest on one OOM.
        self._clf = xgb.XGBClassifier(n_estimators=30, max_depth=2, min_child_weight=0.05, nthread=1, random_state=self.seed, verbosity=0)
        self._clf.fit(encode(params_list, self._clf_keys), np.asarray(ok, dtype=int))
        return self

    def p_feasible(self, params_list: List[Dict[str, Any]]) -> np.ndarray:
        """P(not OOM). Memory only grows with the micro-batch, so a candidate at or above a measured
        OOM with the same stage and knobs is infeasible whatever the classifier says. (Knobs change
        memory too: bucket sizes and contiguous gradients do, so other knob values are left to the
        classifier.)"""
        if self._clf is None:
            p = np.full(len(params_list), self._feasible_default)
        else:
            p = self._clf.predict_proba(encode(params_list, self._clf_keys))[:, 1]
        for i, c in enumerate(params_list):
            if any(same_but_micro_batch(c, o) and c.get("micro_batch", 0) >= o.get("micro_batch", 1 << 30) for o in self._ooms):
                p[i] = 0.0
        return p


def knobs_of(params: Dict[str, Any]) -> Dict[str, Any]:
    """The params without the micro-batch: the stage and its knobs (and gas)."""
    return {k: v for k, v in params.items() if k != "micro_batch"}


def same_but_micro_batch(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    return knobs_of(a) == knobs_of(b)
