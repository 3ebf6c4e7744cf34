"""The micro-batch search along one line (a stage with fixed knobs): the memory edge, then the
throughput peak, which need not be at the edge (CPU runs, communication-bound ones, memory pressure).

Pure functions of what was measured on the line. The peak search brackets the best micro-batch on
a log scale and prices every unmeasured stretch optimistically: throughput against log(micro-batch)
is taken to be concave (rising with diminishing returns, then falling), so beyond measured points
it lies under the lines through neighbouring pairs; and it is never more than proportional to the
micro-batch from the nearest smaller measured size (a larger batch never makes a step faster).
Outside a line's own points, a reference line (the stage's default knobs, or the stage below,
stretched to this line's memory edge and scaled to its level: the stage below at each size by the
ratio at the line's nearest point) caps it too, and so do the reference's points between two of
the line's sizes that bound nothing (no pair of points on either side). A stretch whose optimistic
value cannot beat the target is never probed.
"""

import math
from typing import Dict, List, Optional, Sequence, Set, Tuple

Point = Tuple[int, float]  # (micro-batch, value)
DENSE_UP_TO = 64  # every integer up to this is a candidate; above it, 160 log-spaced sizes
MIN_STRETCH = 1.15  # measured sizes closer than this ratio leave nothing worth probing between them
EDGE_TOLERANCE = 20  # the edge is known once the largest run is within 1/20 (5%) below the smallest OOM


def edge_probe(ok: Sequence[int], ooms: Sequence[int], low: int, cap: Optional[int], predicted: Optional[int],
               chunky: bool = False) -> Optional[int]:
    """The next micro-batch to try on the way to the largest that fits, or None once it is known:
    within 5% below the smallest OOM, at the cap, or where the memory model (calibrated on the
    largest run) says nothing larger fits. With a model: predict, verify, and bisect once both a run
    and an OOM are known (a model calibrated on the run creeps up one at a time). Without one:
    double, then bisect. `chunky`: memory grows in steps (a CPU rank's RSS, in allocator chunks), so
    the size just under one that ran out of memory most likely runs out too: after an OOM the next
    try is 5% below it, where the edge counts as known, not one below."""
    lo = max(ok) if ok else None
    hi = min(ooms) if ooms else None
    if hi is not None and hi <= low:
        return None
    if lo is not None and ((hi is not None and hi - lo <= _edge_margin(hi)) or (cap is not None and lo >= cap)):
        return None
    floor = lo + 1 if lo is not None else low
    bounds = [x for x in (hi - 1 if hi is not None else None, cap) if x is not None]
    ceiling = min(bounds) if bounds else None
    if ceiling is not None and ceiling < floor:
        return None
    if predicted is not None:
        if lo is not None and predicted <= lo:
            return None
        guess = max(floor, predicted)
        if ceiling is not None:
            guess = min(guess, ceiling)
        if lo is not None and hi is not None:
            guess = max(guess, (lo + hi) // 2)
        if hi is not None and len(ooms) >= 2:
            guess = min(guess, max(floor, (floor + hi) // 2))  # wrong twice here: bisect rather than walk down
        elif hi is not None and chunky:
            guess = max(floor, min(guess, hi - _edge_margin(hi)))
        return guess
    if hi is None:
        guess = low if lo is None else lo * 2
        return min(guess, ceiling) if ceiling is not None else guess
    return (lo + hi) // 2 if lo is not None else max(low, hi // 2)


def _edge_margin(oom: int) -> int:
    """How far below the smallest OOM the largest run may be for the edge to count as known."""
    return max(1, math.ceil(oom / EDGE_TOLERANCE))


def sizes_between(low: int, high: int, allowed: Optional[Sequence[int]] = None) -> List[int]:
    """Candidate micro-batches in [low, high]: the allowed list if given, else every integer up to
    64 and log-spaced sizes above."""
    if allowed is not None:
        return sorted(m for m in set(allowed) if low <= m <= high)
    sizes = set(range(low, min(high, DENSE_UP_TO) + 1))
    if high > DENSE_UP_TO:
        base = max(low, DENSE_UP_TO)
        sizes |= {round(base * (high / base) ** (i / 160)) for i in range(161)}
    return sorted(m for m in sizes if low <= m <= high)


def _line(a: Point, b: Point, m: int) -> float:
    xa, xb, x = math.log(a[0]), math.log(b[0]), math.log(m)
    return a[1] + (b[1] - a[1]) * (x - xa) / (xb - xa)


def concave_bound(points: Sequence[Point], m: int) -> float:
    """The largest value at m of a curve concave in log(micro-batch) through the points: under the
    line through the two points left of m extended right, and the two right of m extended left.
    Infinite where neither pair exists."""
    pts = sorted(points)
    for pm, v in pts:
        if pm == m:
            return v
    left = [p for p in pts if p[0] < m]
    right = [p for p in pts if p[0] > m]
    bounds = []
    if len(left) >= 2:
        bounds.append(_line(left[-2], left[-1], m))
    if len(right) >= 2:
        bounds.append(_line(right[0], right[1], m))
    return min(bounds) if bounds else math.inf


def interpolate(points: Sequence[Point], m: int) -> float:
    """The line's value at m: linear in log(m) between its points, flat beyond them."""
    pts = sorted(points)
    if m <= pts[0][0]:
        return pts[0][1]
    if m >= pts[-1][0]:
        return pts[-1][1]
    below = max(p for p in pts if p[0] <= m)
    above = min(p for p in pts if p[0] >= m)
    return below[1] if below[0] == above[0] else _line(below, above, m)


def prior(points: Sequence[Point], m: int) -> float:
    """A line's expected value at m: interpolated between its points, extended beyond them along
    the nearest two (rising on, or falling on), flat if it has one point."""
    sizes = [p[0] for p in points]
    if min(sizes) <= m <= max(sizes):
        return interpolate(points, m)
    extended = concave_bound(points, m)
    return extended if extended < math.inf else interpolate(points, m)


def _ratios(own: Sequence[Point], reference: Sequence[Point]) -> List[Point]:
    """(micro-batch, ratio) of this line's points to the reference there."""
    return [(m, v / ref) for m, v in own if (ref := interpolate(reference, m)) > 0]


def _ratio(ratios: Sequence[Point], prior_ratio: float, at: Optional[int]) -> float:
    if not ratios:
        return prior_ratio
    if at is None:
        return max(r for _, r in ratios)
    return min(ratios, key=lambda p: (abs(math.log(p[0] / at)), -p[1]))[1]


def reference_ratio(own: Sequence[Point], reference: Sequence[Point], prior_ratio: float, at: Optional[int] = None) -> float:
    """This line's ratio to the reference, else prior_ratio: at its point nearest to micro-batch `at`
    (on a log scale; the larger of two as near), or without `at` the largest at any of its points."""
    return _ratio(_ratios(own, reference), prior_ratio, at)


def _scaled(own: Sequence[Point], reference: Sequence[Point], prior_ratio: float, by_size: bool) -> List[Point]:
    """Every point of the reference scaled to this line by `reference_ratio` (at its size if `by_size`)."""
    if not reference:
        return []
    ratios = _ratios(own, reference)
    return [(m, v * _ratio(ratios, prior_ratio, m if by_size else None)) for m, v in reference]


def _outside(own: Sequence[Point], points: Sequence[Point]) -> List[Point]:
    """The points where this line has none: outside the range of its own points once it has two."""
    if len(own) < 2:
        return [(m, v) for m, v in points if m not in {pm for pm, _ in own}]
    lo, hi = min(m for m, _ in own), max(m for m, _ in own)
    return [(m, v) for m, v in points if m < lo or m > hi]  # own points decide within their range


def scaled_reference(own: Sequence[Point], reference: Sequence[Point], prior_ratio: float) -> List[Point]:
    """The reference line's points scaled to this line (by the largest `reference_ratio`), where this
    line has no points: outside the range of its own points once it has two."""
    return _outside(own, _scaled(own, reference, prior_ratio, by_size=False))


def linear_cap(own: Sequence[Point], m: int) -> float:
    """Throughput at m is at most proportional to m from the nearest smaller measured size: a
    larger micro-batch never makes a step faster."""
    below = [p for p in own if p[0] < m]
    if not below:
        return math.inf
    pm, v = max(below)
    return v * m / pm


def stretched(points: Sequence[Point], edge: Optional[int], new_edge: Optional[int], keep_rise: bool = False) -> List[Point]:
    """A line moved to another memory edge: sizes scaled by new_edge / edge. Where throughput falls
    before the edge it is memory pressure, which comes at the same fraction of the edge (GPU).
    `keep_rise`: moved to a smaller edge, no point is worth more than the line itself at its new
    size. The rise with the micro-batch is per-step costs shared by more samples, which do not move
    with the edge: pressed into a stage that fits 4 samples (10b's z2), z3's value at 4 would
    otherwise price z2 at 1, and its value at 7 z2 at 2."""
    if not points or not edge or not new_edge or edge == new_edge:
        return list(points)
    moved: Dict[int, float] = {}
    for m, v in points:
        at = max(1, round(m * new_edge / edge))
        if keep_rise and new_edge < edge:
            v = min(v, interpolate(points, at))
        moved[at] = max(v, moved.get(at, v))
    return sorted(moved.items())


def peak_probe(own: Sequence[Point], reference: Sequence[Point], candidates: Sequence[int], taken: Set[int], target: float,
               prior_ratio: float = 1.0, high_probe: Optional[int] = None, rate: bool = True,
               pending: Set[int] = frozenset(), reach: Optional[int] = None, reference_above: bool = True, by_size: bool = False,
               cover: Optional[float] = None, noise: float = 0.0) -> Tuple[Optional[int], float]:
    """The next micro-batch to measure on this line and its optimistic value, or (None, best bound)
    when no unmeasured stretch can beat `target`.

    Stretches lie between this line's measured sizes. Each is priced by the highest optimistic value
    of its candidates (own points plus the scaled reference), and the best-priced one is probed: at
    its log-midpoint; for the stretch below everything measured, where the reference puts it highest
    if the reference has sizes there, else at half the smallest size; and for the stretch above, at
    `high_probe` (the edge search's next size) or its top, unless the line cannot beat `target` there
    (a line that peaks inside the stretch): then where its bound is highest. `rate`: values are
    per-sample rates (throughput), so `linear_cap` applies too. `pending`: sizes being measured by
    other workers; they split stretches like measured sizes (so parallel probes spread out) but carry no value, and a
    line with nothing measured yet waits for its pending first look. `reach`: the largest size to
    probe: stretches are still priced beyond it, and probed within it. `reference_above=False`: the
    reference prices the line below its own sizes only, and above them its own points alone do.
    `by_size`: the reference is scaled at each size by the line's ratio to it at its nearest point,
    not by the largest ratio at any of its points. `cover`: a stretch whose ends lie more than this
    ratio apart (the stretch above: its top), above a size that ties the line's best (within two
    intervals of one measurement, `noise`), is probed whatever its bound, widest first. Its bound
    extends the line from the pair of sizes below, and near the top that pair's slope is mostly
    noise: one draw low (or high) closes the whole stretch, and a measured throughput curve need not
    be concave there (on CPU it can rise again after a flat stretch)."""

    def _bound(points: Sequence[Point], m: int) -> float:
        """The own points' concave bound (and linear cap); outside their range, at most the line
        through own and reference points too."""
        bound = concave_bound(own, m)
        inside = bool(own) and lowest < m < highest
        if not inside and len(points) > len(own) and (reference_above or not own or m < lowest):
            bound = min(bound, prior(points, m))  # outside its own range, the reference has measured
        elif inside and bound == math.inf and inner:  # between two own sizes that bound nothing: the reference there
            lo, hi = max(s for s, _ in own if s < m), min(s for s, _ in own if s > m)
            there = [v for rm, v in inner if lo < rm < hi]
            bound = max(there) if there else bound
        return min(bound, linear_cap(own, m)) if rate else bound

    def _within_reach(sizes: List[int]) -> List[int]:
        """The sizes a probe may take: those up to `reach`, else the smallest."""
        return [m for m in sizes if reach is None or m <= reach] or [min(sizes)]

    free = [m for m in candidates if m not in taken]
    if not free:
        return None, -math.inf
    scaled = _scaled(own, reference, prior_ratio, by_size)
    pts = list(own) + _outside(own, scaled)
    lowest, highest = min((m for m, _ in own), default=0), max((m for m, _ in own), default=0)
    inner = [(m, v) for m, v in scaled if lowest < m < highest]
    if not own and not pts:
        if pending:
            return None, math.inf
        near = _within_reach(free)
        return (high_probe if high_probe in near else max(near)), math.inf
    sizes = sorted({m for m, _ in own} | set(pending))
    stretches: Dict[Tuple[int, int], List[int]] = {}
    for m in free:
        below = max((s for s in sizes if s < m), default=0)
        above = min((s for s in sizes if s > m), default=0)
        stretches.setdefault((below, above), []).append(m)
    best: Tuple[Optional[int], float] = (None, -math.inf)
    widest = 0.0
    values = dict(own)
    top = max(values.values(), default=math.inf)
    for (below, above), ms in sorted(stretches.items()):
        if below and above and above / below < MIN_STRETCH:
            continue  # a size between two this close is within about 1% of one of them near a peak
        bounds = {m: _bound(pts, m) for m in ms}
        bound = max(bounds.values())
        width = (above or max(_within_reach(ms))) / below if below else 0.0
        wide = cover is not None and values.get(below, -math.inf) * (1 + 2 * noise) >= top and width > max(cover, widest)
        if not wide and (widest or bound <= best[1]):
            continue  # once a wide stretch is found, only a wider one replaces it
        if wide:
            widest = width
        ms = _within_reach(ms)
        top_bound = max(ms, key=lambda m: (bounds[m], m))  # where the stretch's bound is highest (the larger of ties)
        if above == 0 and below == 0:
            pick = max(ms) if high_probe is None or high_probe not in ms else high_probe
            if pts:
                pick = top_bound
        elif above == 0:  # the memory edge first, unless the line cannot beat the target there
            pick = high_probe if high_probe in ms and (wide or bounds[high_probe] > target) else top_bound
        elif below == 0 and any(m < lowest for m, _ in pts):  # the reference has sizes below this line's
            pick = top_bound
        elif below == 0:
            pick = min(ms, key=lambda m: (abs(math.log(m / (above / 2))), -m))
        else:
            mid = math.sqrt(below * above)
            pick = min(ms, key=lambda m: (abs(math.log(m / mid)), -m))
        best = (pick, bound)
    if widest:
        return best
    if best[0] is None or best[1] <= target:
        return None, best[1]
    return best

