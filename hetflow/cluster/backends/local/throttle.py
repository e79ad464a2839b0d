"""A slower machine, simulated from outside the replica: its process group stopped and continued so
that it runs for a set share of the time (``worker_devices``' ``slowdown``)."""

from __future__ import annotations

import signal
import threading
import time

from hetflow.cluster.processes import signal_group


class Throttle(threading.Thread):
    """Simulates a machine ``slowdown`` times slower: the replica's process group runs for
    1/slowdown of the time and is stopped (SIGSTOP) for the rest, the way ``cpulimit`` does.
    A real limit on CPU time from outside the process, not a sleep inside the training loop."""

    # Short, so the replica is slow all the time rather than absent for long stretches: with 100 ms
    # it was stopped for 50 ms at a time (slowdown 2) and every collective could wait that long.
    PERIOD_SECONDS = 0.02
    MAX_STOP_PERIODS = 4

    def __init__(self, pid: int, slowdown: float):
        super().__init__(daemon=True)
        self.pid, self.running_share = pid, 1.0 / slowdown
        self.done = threading.Event()

    def run(self) -> None:
        running_phase = self.PERIOD_SECONDS * self.running_share
        # The moment at which what the replica has run so far is its share of the time.
        even_at = continued_at = time.monotonic()
        while True:
            if self._wait_until(continued_at + running_phase):
                break
            if not signal_group(self.pid, signal.SIGSTOP):
                return
            stopped_at = time.monotonic()
            # Resume at that moment, so a late SIGSTOP lengthens the stop to match: this thread
            # wakes 2-3 ms late when the scheduler puts it on the replica's busy core, and with
            # fixed phases slowdown 4 gave the replica 0.34 of a core, slowdown 2 0.57. A stop lasts
            # at most MAX_STOP_PERIODS; longer debt (this thread stalled) is forgotten rather than
            # paid back in one long absence.
            even_at += (stopped_at - continued_at) / self.running_share
            even_at = min(max(even_at, stopped_at), stopped_at + self.MAX_STOP_PERIODS * self.PERIOD_SECONDS)
            stop_requested = self._wait_until(even_at)
            continued_at = time.monotonic()  # before the call: the replica runs before kill() returns
            signal_group(self.pid, signal.SIGCONT)
            if stop_requested:
                break
        signal_group(self.pid, signal.SIGCONT)

    def _wait_until(self, deadline: float) -> bool:
        """Sleeps until ``deadline`` (monotonic); True when stop() was called meanwhile."""
        return self.done.wait(max(0.0, deadline - time.monotonic()))

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=1)
