"""The ranks' agreement on a stop: every rank stops after the same step once any rank got USR2.

The signal's flag is torch-free (`gpujobs.attempt.preemption.StopFlag`); agreeing on it is a collective,
so it lives here, on the rank side, and imports torch only when the ranks first agree.
"""

from __future__ import annotations

from gpujobs.attempt.preemption import StopFlag


class PreemptionWatcher(StopFlag):
    """Turns USR2 into a flag that every rank agrees on at step boundaries."""

    def should_stop(self) -> bool:
        """True on every rank once any rank got the signal (a collective: call it on all ranks)."""
        from gpujobs.rank import collectives  # imports torch: only once the ranks agree

        return collectives.any_true(self.flagged)
