"""A lock held in the MLflow registry itself, so that promotions from different hosts (each with its
own HETFLOW_HOME, each spelling the tracking URI its own way) exclude each other.

MLflow has no conditional update, but creating a registered model is atomic: the name is unique in
the store and a second create fails with RESOURCE_ALREADY_EXISTS. The lock is therefore a registered
model named after the one it guards, created with its holder's token in a tag and deleted on
release. Its name holds a space and parentheses, which no ``registered_model`` may (RunSpec's
pattern), so it never collides with a model and no lookup of one by name finds it.

While it holds, the holder rewrites a heartbeat tag. A waiter that sees the heartbeat unchanged for
``STALE_AFTER_SECONDS`` by its own clock (hosts' clocks may differ) takes the holder for dead and
renames the lock to a tombstone named after that holder's token. The rename fails when that
tombstone exists, so of two waiters that saw the same dead holder one breaks the lock, and a waiter
that read the dead holder late cannot rename a newer holder's lock away. Tombstones are kept for that
reason, and swept once they are ``SWEEP_AFTER_SECONDS`` old.

A holder on this machine is known dead sooner: it took the lock inside an flock of a file (the
``local_lock`` that ``champion.promotion_lock`` holds), and the lock names that file's identity on
this kernel. A waiter holding the same flock knows that holder is gone and breaks its lock at once.

The one gap left: a holder alive but cut off from the registry for longer than STALE_AFTER_SECONDS
is taken over; it finds out at ``confirm`` (called before it moves ``champion``) and at release."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, RESOURCE_DOES_NOT_EXIST, ErrorCode

from mlflow import MlflowClient

log = logging.getLogger("hetflow.registry")

HEARTBEAT_SECONDS = 5.0
STALE_AFTER_SECONDS = 60.0  # 12 missed heartbeats: a holder this quiet is dead or cut off
POLL_SECONDS = 1.0
SWEEP_AFTER_SECONDS = 24 * 3600.0  # far beyond any waiter's read-then-rename

HOLDER_TAG = "hetflow.promotion_lock.holder"
HEARTBEAT_TAG = "hetflow.promotion_lock.heartbeat"
HELD_BY_TAG = "hetflow.promotion_lock.held_by"
GUARDS_TAG = "hetflow.promotion_lock.guards"
LOCAL_LOCK_TAG = "hetflow.promotion_lock.local_lock"


def lock_name(model: str) -> str:
    return f"{model} (promotion lock)"


def tombstone_prefix(model: str) -> str:
    return f"{model} (stale promotion lock"


def tombstone_name(model: str, holder: str) -> str:
    return f"{tombstone_prefix(model)} of holder {holder})"


def local_lock_identity(handle) -> str:
    """The identity of an open file as flock sees it: one inode on one running kernel. Processes of
    two containers on one host that mount the same file share its flock, and this identity."""
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    stat = os.fstat(handle.fileno())
    return f"boot {boot} device {stat.st_dev} inode {stat.st_ino}"


class PromotionLockLost(RuntimeError):
    """Another process took the promotion lock over while this one believed it held it."""


def _poll_pause(seconds: float) -> None:
    time.sleep(seconds)


def _missing(error: MlflowException) -> bool:
    return error.error_code == ErrorCode.Name(RESOURCE_DOES_NOT_EXIST)


def _utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class RegistryLock:
    """The promotion lock of registered model ``model`` in ``client``'s registry. ``purpose`` says
    who holds it and why, for a person reading MLflow's Models page. ``local_lock``: the identity of
    the flocked file the caller holds (``local_lock_identity``), or None."""

    def __init__(self, client: MlflowClient, model: str, purpose: str, local_lock: str | None = None):
        self.client, self.model, self.name = client, model, lock_name(model)
        self.local_lock = local_lock
        self.token = secrets.token_hex(8)
        self.held_by = f"{socket.gethostname()} pid {os.getpid()}: {purpose}"
        self._stop = threading.Event()
        self._lost: str | None = None
        self._heartbeat: threading.Thread | None = None

    def acquire(self) -> None:
        seen, since = None, time.monotonic()
        while True:
            if self._create():
                break
            try:
                tags = self.client.get_registered_model(self.name).tags
            except MlflowException as error:
                if _missing(error):  # released between our create and this read
                    continue
                raise
            if tags.get(HOLDER_TAG) == self.token:  # our create went through, its reply was lost
                break
            observed = (tags.get(HOLDER_TAG), tags.get(HEARTBEAT_TAG))
            why_dead = None
            if self.local_lock is not None and tags.get(LOCAL_LOCK_TAG) == self.local_lock:
                # Its holder took it under the flock we hold now: it is gone, no need to wait out its heartbeat.
                why_dead = "its holder no longer holds this machine's lock file"
            elif observed != seen:
                if seen is None:
                    log.info("%s: waiting for %s (held by %s)", self.model, self.name, tags.get(HELD_BY_TAG))
                seen, since = observed, time.monotonic()
            elif time.monotonic() - since >= STALE_AFTER_SECONDS:
                why_dead = f"its heartbeat stopped for {STALE_AFTER_SECONDS:g} s"
            if why_dead is not None and self._break(observed[0], tags.get(HELD_BY_TAG), why_dead):
                seen = None
                continue
            _poll_pause(POLL_SECONDS)
        self._heartbeat = threading.Thread(target=self._beat, name=f"heartbeat {self.name}", daemon=True)
        self._heartbeat.start()
        self._sweep_tombstones()

    def _create(self) -> bool:
        try:
            self.client.create_registered_model(
                self.name,
                tags={
                    HOLDER_TAG: self.token,
                    HEARTBEAT_TAG: _utc_now(),
                    HELD_BY_TAG: self.held_by,
                    GUARDS_TAG: self.model,
                    **({LOCAL_LOCK_TAG: self.local_lock} if self.local_lock else {}),
                },
                description=(
                    f"Not a model. hetflow holds this while it decides whether a new version of '{self.model}' "
                    f"takes the alias champion, so that two promotions of that model never interleave. Its holder "
                    f"({HELD_BY_TAG}) rewrites {HEARTBEAT_TAG} every {HEARTBEAT_SECONDS:g} s and deletes it when "
                    f"done; hetflow takes over one whose heartbeat stopped for {STALE_AFTER_SECONDS:g} s by renaming "
                    f"it '{tombstone_prefix(self.model)} ...)', deleted after a day. Leave it alone."
                ),
            )
            return True
        except MlflowException as error:
            # A create refused because the name is taken is answered RESOURCE_DOES_NOT_EXIST when the
            # holder released the lock between the refusal and the store's look-up of the holder.
            if error.error_code == ErrorCode.Name(RESOURCE_ALREADY_EXISTS) or _missing(error):
                return False
            raise

    def _break(self, holder: str | None, held_by: str | None, why: str) -> bool:
        """Rename the stale lock to its holder's tombstone: fails, harmlessly, when another waiter did."""
        tombstone = tombstone_name(self.model, holder)
        try:
            self.client.rename_registered_model(self.name, tombstone)
        except MlflowException as error:
            log.info("%s: another waiter took over the stale lock first (%s)", self.model, error.error_code)
            return False
        log.warning(
            "%s: took over %s held by %s (%s); left as %r", self.model, self.name, held_by, why, tombstone,
        )  # fmt: skip
        return True

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                holder = self.client.get_registered_model(self.name).tags.get(HOLDER_TAG)
                if holder != self.token:
                    self._lost = f"held by {holder} now"
                    log.warning("%s: lost %s: its heartbeat stalled and another took it over", self.model, self.name)
                    return
                self.client.set_registered_model_tag(self.name, HEARTBEAT_TAG, _utc_now())
            except MlflowException as error:
                if _missing(error):
                    self._lost = "gone"
                    log.warning("%s: lost %s: it was taken over", self.model, self.name)
                    return
                log.warning("%s: heartbeat of %s failed, trying again: %s", self.model, self.name, error)
            except OSError as error:  # the registry unreachable for a moment
                log.warning("%s: heartbeat of %s failed, trying again: %s", self.model, self.name, error)

    def confirm(self) -> None:
        """Raise ``PromotionLockLost`` unless this process still holds the lock."""
        try:
            holder = self.client.get_registered_model(self.name).tags.get(HOLDER_TAG)
        except MlflowException as error:
            if not _missing(error):
                raise
            holder = None
        if self._lost or holder != self.token:
            raise PromotionLockLost(
                f"{self.model}: another promotion took over {self.name!r} while this one held it (its heartbeat "
                f"stalled for over {STALE_AFTER_SECONDS:g} s): champion left as it is"
            )

    def release(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        try:
            if self.client.get_registered_model(self.name).tags.get(HOLDER_TAG) == self.token:
                self.client.delete_registered_model(self.name)
        except MlflowException as error:
            if not _missing(error):
                raise

    def _sweep_tombstones(self) -> None:
        prefix = tombstone_prefix(self.model)
        oldest_kept = (time.time() - SWEEP_AFTER_SECONDS) * 1000
        # LIKE's _ matches any one character: the prefix is checked again below.
        for tombstone in self.client.search_registered_models(f"name LIKE '{prefix}%'"):
            if tombstone.name.startswith(prefix) and tombstone.last_updated_timestamp < oldest_kept:
                try:
                    self.client.delete_registered_model(tombstone.name)
                except MlflowException as error:
                    if not _missing(error):  # another holder swept it first
                        raise
