"""The run's supervisor lease, and how a replica tells that its supervisor is gone.

The supervisor of a run (the ``train`` task, ``hetflow.cluster.supervisor``) holds the run's lease for
as long as it supervises: an exclusive ``flock`` of ``replicas/supervisor.lock``, which the kernel
drops when its holder dies, however it dies. On docker and swarm it also beats a heartbeat:
it rewrites ``replicas/supervisor.heartbeat`` every ``HEARTBEAT_SECONDS``.

One rule (``Supervision``) decides from what is seen of those over time that the supervisor is gone:
it was seen (the lease held, or else the heartbeat changing) and no longer is, or none was seen
within ``ATTACH_TIMEOUT_SECONDS`` of the replica's start. A local replica's keeper applies it to the lease
(``hetflow.cluster.backends.local.keeper``); a container replica applies it to itself (``SupervisorWatch``, started
by ``python -m hetflow.replica --watch-supervisor ...``) and exits, so that a SIGKILLed ``train`` leaves
no container running until its deadline (the replica's ``timeout``, up to 7 days).

Which signals a replica watches is its backend's choice:

- docker: the lease and the heartbeat. The run directory is bind-mounted from the supervisor's
  host, so the replica's ``flock`` probe meets the supervisor's lock on the same inode and sees it
  go within ``WATCH_SECONDS``. The heartbeat covers an engine that shares the files but not the
  kernel (Docker Desktop's VM, a remote engine on shared storage), where the lease is never seen.
- swarm: the heartbeat only. The run directory is on shared storage (NFS) read from other
  machines, where a ``flock`` is emulated by the server's byte-range locks, or kept on the one
  client (``local_lock=flock``), or lost and granted again when the server restarts: a replica
  could see a live supervisor's lease as released, or never see it held. A heartbeat is a file's contents: NFS's
  close-to-open consistency gives each fresh ``open`` the last closed write, and the replica times
  changes on its own clock, so no two machines' clocks are compared.

A hostile replica can ignore all this (it is its own process): the deadline, teardown and
``hetflow sweep`` still end it. The watch is for the replicas the pipeline runs, which should not
train on for days for nobody.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from pathlib import Path
from typing import Iterable

from hetflow.paths import RunPaths

log = logging.getLogger("hetflow.cluster")

# From provisioning to the train task's start: Airflow schedules the next task within seconds,
# but a busy scheduler can take minutes.
ATTACH_TIMEOUT_SECONDS = 600.0
HEARTBEAT_SECONDS = 2.0
# Five beats missed: a supervisor busy on two loaded cores still beats well within it.
HEARTBEAT_STALE_SECONDS = 10.0
WATCH_SECONDS = 2.0
# A replica's exit code when it ends itself because its supervisor is gone.
SUPERVISOR_GONE_EXIT_CODE = 3
# How long take_lease waits out a probe's brief shared lock (a keeper's, a replica's, a sweep's).
_CONTENDED_SECONDS = 1.0
SIGNALS = ("lease", "heartbeat")


def lease_path(run_dir: Path) -> Path:
    return RunPaths(run_dir).replicas / "supervisor.lock"


def heartbeat_path(run_dir: Path) -> Path:
    return RunPaths(run_dir).replicas / "supervisor.heartbeat"


class Lease:
    """The run's lease as its supervisor holds it; ``close`` (or the holder's death) releases it."""

    def __init__(self, lock_file, run_dir: Path, heartbeat: bool):
        self._lock_file = lock_file
        self._stopped = threading.Event()
        self._beating = None
        if heartbeat:
            beat(run_dir)  # at once: a replica that starts watching now sees the next beat change it
            self._beating = threading.Thread(target=self._beat, args=(run_dir,), name="heartbeat", daemon=True)
            self._beating.start()

    def _beat(self, run_dir: Path) -> None:
        while not self._stopped.wait(HEARTBEAT_SECONDS):
            try:
                beat(run_dir)
            except OSError as error:  # a hiccup of the shared storage: the next beat may go through
                log.warning("could not beat the run's heartbeat: %s", error)

    def close(self) -> None:
        self._stopped.set()
        if self._beating is not None:
            self._beating.join()
        self._lock_file.close()


def take_lease(run_dir: Path, heartbeat: bool = False) -> Lease:
    """Take the run's supervisor lease, beating its heartbeat while it is held where ``heartbeat``
    (the backends whose replicas watch it: docker, swarm). Raises ReplicaFailed when another process
    holds it."""
    from hetflow.cluster.supervisor import ReplicaFailed

    lease_path(run_dir).parent.mkdir(parents=True, exist_ok=True)
    lock_file = open(lease_path(run_dir), "a+")
    deadline = time.monotonic() + _CONTENDED_SECONDS
    while True:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return Lease(lock_file, run_dir, heartbeat)
        except BlockingIOError:
            if time.monotonic() > deadline:
                lock_file.close()
                raise ReplicaFailed(
                    f"another process supervises the replicas of {run_dir} (it holds the lease)"
                ) from None
            time.sleep(0.05)


def supervisor_holds_lease(run_dir: Path) -> bool:
    """Whether a process holds the run's lease. Opens the lock read-only: a container replica sees
    the supervisor's records through a read-only mount."""
    try:
        descriptor = os.open(lease_path(run_dir), os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False  # no supervisor has taken it yet
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(descriptor)  # releases the probe's shared lock, if it got one
    return False


def beat(run_dir: Path) -> None:
    """One heartbeat: the file's contents change (a count of nanoseconds, never read as a time),
    written in place and closed, which is what NFS shows the next reader that opens it."""
    descriptor = os.open(heartbeat_path(run_dir), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        os.write(descriptor, f"{time.time_ns()}\n".encode())
    finally:
        os.close(descriptor)


def read_heartbeat(run_dir: Path) -> bytes | None:
    """The heartbeat's contents as a fresh open reads them; None where there is none yet."""
    try:
        descriptor = os.open(heartbeat_path(run_dir), os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        return os.read(descriptor, 64)
    finally:
        os.close(descriptor)


class Supervision:
    """Whether the supervisor of a replica started at ``started`` (a monotonic time) is gone,
    from what is seen over time of the signals it watches (``SIGNALS``): ``gone``."""

    def __init__(
        self,
        started: float,
        signals: Iterable[str],
        attach_timeout: float = ATTACH_TIMEOUT_SECONDS,
        stale_after: float = HEARTBEAT_STALE_SECONDS,
    ):
        self.signals = frozenset(signals)
        self._started = started
        self._attach_timeout = attach_timeout
        self._stale_after = stale_after
        self._lease_seen = False
        self._beat: bytes | None = None
        self._beat_read = False
        self._beat_changed_at: float | None = None

    def gone(self, now: float, lease_held: bool = False, heartbeat: bytes | None = None) -> str | None:
        """Why the supervisor is gone, or None while it supervises or may still come.

        :param lease_held: whether the lease is held now (where the lease is watched).
        :param heartbeat: the heartbeat's contents now, None where there is no file (where the
            heartbeat is watched). The first contents read are only a baseline: a file an earlier
            supervisor left is no sign of this one until it changes; nor is the file's removal.
        """
        if "lease" in self.signals:
            if lease_held:
                self._lease_seen = True
            elif self._lease_seen:
                return "it no longer holds the run's lease (replicas/supervisor.lock)"
        if "heartbeat" in self.signals:
            if self._beat_read and heartbeat is not None and heartbeat != self._beat:
                self._beat_changed_at = now
            self._beat, self._beat_read = heartbeat, True
            # A lease seen held is exact: a heartbeat late behind a busy supervisor's lock does not
            # overrule it. The heartbeat decides where the lease cannot be seen.
            stale = self._beat_changed_at is not None and now - self._beat_changed_at > self._stale_after
            if stale and not self._lease_seen:
                silent = now - self._beat_changed_at
                return f"its heartbeat (replicas/supervisor.heartbeat) has not changed for {silent:.0f} s"
        if not self._lease_seen and self._beat_changed_at is None and now - self._started > self._attach_timeout:
            return f"no supervisor took the run within {self._attach_timeout:.0f} s of the replica's start"
        return None


class SupervisorWatch:
    """In a replica: a daemon thread that looks at ``signals`` (``SIGNALS``) every
    ``WATCH_SECONDS`` and ends the process, with a line saying why and
    ``SUPERVISOR_GONE_EXIT_CODE``, once ``Supervision`` says its supervisor is gone."""

    def __init__(self, run_dir: Path, signals: Iterable[str]):
        self._run_dir = run_dir
        self._supervision = Supervision(time.monotonic(), signals)
        self._looking = threading.Lock()  # Supervision remembers what it saw: one look at a time
        threading.Thread(target=self._watch, name="supervisor-watch", daemon=True).start()

    def _watch(self) -> None:
        while True:
            self.look()
            time.sleep(WATCH_SECONDS)

    def look(self) -> None:
        """One look now; ends the process where its supervisor is gone."""
        signals = self._supervision.signals
        with self._looking:
            reason = self._supervision.gone(
                time.monotonic(),
                lease_held="lease" in signals and supervisor_holds_lease(self._run_dir),
                heartbeat=read_heartbeat(self._run_dir) if "heartbeat" in signals else None,
            )
        if reason:
            print(f"replica pid {os.getpid()} ends: its supervisor is gone: {reason}", flush=True)
            os._exit(SUPERVISOR_GONE_EXIT_CODE)
