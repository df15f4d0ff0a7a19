"""How many stream switches a rank and the kernel keep in exact order (a token bucket): used on both sides
of the wire, by the rank before it sends a ``Mark`` and by the kernel before it flushes a stream."""
from __future__ import annotations

import time

# Keeping a rank's stdout and stderr in order costs, at each switch of stream, a messages.Mark in the rank
# and a flush of the kernel's other stream (which waits for ipykernel's IO thread). Both are budgeted:
# ORDER_BURST switches in exact order, then ORDER_RATE a second; past that, the two streams interleave
# in ipykernel's 0.2 s batches, as a plain cell's do.
ORDER_BURST = 500


ORDER_RATE = 100.0


class Budget:
    """A token bucket: ``take()`` is True for ``burst`` calls, then ``rate`` a second (checked lazily:
    the clock is read only once the tokens are spent)."""

    def __init__(self, burst: int = ORDER_BURST, rate: float = ORDER_RATE, clock=time.monotonic):
        self.burst, self.rate, self.clock = burst, rate, clock
        self.tokens = float(burst)
        self.since = clock()

    def take(self) -> bool:
        if self.tokens < 1:
            now = self.clock()
            self.tokens = min(float(self.burst), self.tokens + (now - self.since) * self.rate)
            self.since = now
            if self.tokens < 1:
                return False
        self.tokens -= 1
        return True
