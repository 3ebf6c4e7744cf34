"""Step 5, noise: measuring a configuration again.

A disturbed measurement is re-measured before the search builds on it (the leader first), and its
re-measurement replaces it. Near-ties between the two leaders (within their intervals) are
re-measured in turn, the leader first and the rival while its optimistic value may still beat the
leader by more than the stop rule's margin, until they separate or the pair has had 2 x `remeasure`
repeats; a pick still tied when that budget is spent is measured again once if it stands on one
window.
"""

from typing import List, Optional

from mlautotune.search.candidates import params_key
from mlautotune.search.ledger import Measured
from mlautotune.search.step import Step


class Repeats:
    def __init__(self, strategy):
        self.st = strategy

    def disturbed_step(self, runs: List[Measured]) -> Optional[Step]:
        """The best disturbed measurement, again (a low disturbed value would close its line)."""
        st = self.st
        disturbed = [m for m in runs if m.value is not None and m.disturbed and not self._pending(m)]
        if not disturbed or st.s.remeasure <= 0:
            return None
        m = max(disturbed, key=lambda m: st.score(m.final_value))
        return Step(m.params, f"{m.result.name} was disturbed: re-measured before the search builds on it", repeat_of=m)

    def step(self, runs: List[Measured], target: float) -> Optional[Step]:
        """The best two, if their values overlap within their intervals, are measured again in turn
        until they separate or the two have 2 x remeasure repeats between them. The budget is the
        pair's: when a re-measured leader falls behind, the two now on top get theirs (a lucky
        first window of the new leader would otherwise be declared unchecked). The leader is
        measured again first (the luckiest of its near-ties reads high); then the rival only while
        it may still win (`_may_win`)."""
        st = self.st
        ok = sorted((m for m in runs if m.value is not None), key=lambda m: -st.score(m.final_value))
        if len(ok) < 2 or st.s.remeasure <= 0:
            return None
        lead = ok[0]
        ties = [m for m in ok[1:2] if st.tied(lead, m)]
        if not ties:
            return None
        if sum(self._count(m) for m in [lead, *ties]) >= 2 * st.s.remeasure:  # the pair's own repeats: a leader re-measured and beaten leaves the new pair theirs
            if self._count(lead) == 0:  # that does not settle by then is a tie, but the pick is not left on one window
                return Step(lead.params, f"the pick, tied with {ties[0].result.name}, on one measurement", repeat_of=lead)
            return None
        if self._count(lead) and not self._may_win(ties[0], target):
            return None  # the leader, measured again, stands: the rival could at best tie it
        for round_ in range(1, st.s.remeasure + 1):
            for m in [lead, *ties]:
                if self._count(m) < round_:
                    st.note("re-measuring near-tied leaders: " + ", ".join(x.result.name for x in [lead, *ties]))
                    return Step(m.params, f"near-tie with {lead.result.name}", repeat_of=m)
        return None

    def _may_win(self, m: Measured, target: float) -> bool:
        """The rival's optimistic value (its value and interval) beats the incumbent by more than the
        stop rule's margin, the rule every candidate answers to: a rival below the leader that could
        at best tie it is not worth a launch, whichever of the two is picked."""
        return self.st.score(m.final_value) * (1 + m.interval) > target

    def _pending(self, m: Measured) -> int:
        return self.st.pending_repeats.get(params_key(m.params), 0)

    def _count(self, m: Measured) -> int:
        """Re-measurements of m, done or being done by another worker."""
        return len(m.repeats) + self._pending(m)
