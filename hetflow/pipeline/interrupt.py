"""Stopping replicas when Airflow stops a task: SIGTERM, then SIGKILL a few seconds later (so a
``finally`` that waits for replicas would never run). Each train registers how to stop its
replicas; the main thread's handler stops all of them, also those of trains running in other
threads (a study's trials side by side), and each such train ends Interrupted, not failed."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable

log = logging.getLogger("hetflow.stages")


# Airflow 3 SIGKILLs a task 5 s after its SIGTERM: the replicas get 2 s to stop before SIGKILL, so
# the teardown (the network namespace's deletion included) is over before the task is killed.
SIGTERM_STOP_GRACE_SECONDS = 2.0


class Interrupted(RuntimeError):
    pass


# The replicas' stop of each train running in this process, by thread: a study's trials train side
# by side (hetflow.tasks.run_study), and a signal reaches the main thread only.
_running_stops: dict[int, Callable[[], None]] = {}
_sigterm_received = threading.Event()


@contextlib.contextmanager
def replicas_stopped_on_sigterm(interrupt_here: bool = True):
    """While in this block (main thread), SIGTERM stops the replicas of every train running in the
    process, then raises Interrupted: at once, or, where ``interrupt_here`` is false (the trains run
    in other threads, which end Interrupted), once the block's work has waited for them."""

    def on_sigterm(signum, frame):
        log.warning("SIGTERM: stopping the replicas")
        _sigterm_received.set()
        for stop in list(_running_stops.values()):
            stop()
        if interrupt_here:
            raise Interrupted("stopped by SIGTERM; the replicas were stopped")

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
        if _sigterm_received.is_set():
            raise Interrupted("stopped by SIGTERM; the replicas were stopped")
    finally:
        signal.signal(signal.SIGTERM, previous)
        _sigterm_received.clear()


@contextlib.contextmanager
def stopped_on_sigterm(stop: Callable[[], None]):
    """Run ``stop`` when SIGTERM arrives. In a thread of its own (a study's trial), the main thread's
    handler (``replicas_stopped_on_sigterm``) runs it, and this train ends Interrupted, not failed."""
    thread = threading.get_ident()
    _running_stops[thread] = stop
    try:
        if threading.current_thread() is threading.main_thread():
            with replicas_stopped_on_sigterm():
                yield
        else:
            if _sigterm_received.is_set():  # a trial that reached training after the SIGTERM
                raise Interrupted("stopped by SIGTERM before training")
            try:
                yield
            except Exception:
                if _sigterm_received.is_set():
                    raise Interrupted("stopped by SIGTERM; the replicas were stopped") from None
                raise
    finally:
        del _running_stops[thread]
