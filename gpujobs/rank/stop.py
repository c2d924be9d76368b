"""The ranks' agreement on a stop: every rank stops after the same step once any rank got USR2.

The signal's flag is torch-free (`gpujobs.attempt.preemption.StopFlag`); agreeing on it is a collective,
so it lives here, on the rank side, and imports torch only when the ranks first agree.

The agreement is a vote started at one step boundary and read at the next (`start_vote`, `vote`): the
tiny all-reduce then runs while the ranks compute a step, and no step waits for the slowest rank to
reach it. A stop costs one step more than a blocking vote would; every rank still stops after the same
step, so the stop's checkpoint is the same agreed one.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Optional

from gpujobs.attempt.preemption import StopFlag

if TYPE_CHECKING:
    from gpujobs.rank.collectives import Pending


class PreemptionWatcher(StopFlag):
    """Turns USR2 into a flag that every rank agrees on at step boundaries."""

    def __init__(self, signum: int = signal.SIGUSR2) -> None:
        super().__init__(signum)
        self._vote: Optional[Pending[bool]] = None

    @property
    def voting(self) -> bool:
        """Whether a vote was started and not read yet."""
        return self._vote is not None

    def start_vote(self) -> None:
        """Start the ranks' agreement on the flag as it is now, without waiting for it (a collective:
        every rank starts it at the same step boundary, and reads it with `vote` at the same later one)."""
        from gpujobs.rank import collectives  # imports torch: only once the ranks agree

        if self._vote is not None:
            raise RuntimeError("a stop vote was started while the previous one was not read")
        self._vote = collectives.start_any_true(self.flagged)

    def vote(self) -> bool:
        """The started vote's answer, the same on every rank: True once any rank had the flag when it
        was started (waits for the vote if it has not finished; False when none was started)."""
        pending, self._vote = self._vote, None
        return pending is not None and pending.wait()
