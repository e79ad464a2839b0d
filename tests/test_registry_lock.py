"""The promotion lock (hetflow/registry/registry_lock.py, taken through champion.promotion_lock): one per
registered model, released when its holder dies, one registry however its URI is spelled, held in
the registry across hosts, taken over once a dead holder's heartbeat stops, and never renamed away
from its next holder. The holders are real processes, over the session's SQLite store or a real
MLflow server."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

from conftest import REPO
from mlflow_hosts import _home


def test_the_promotion_lock_is_one_per_registered_model_and_dies_with_its_holder(hetflow_env):
    """A promotion of another registered model does not wait; one of the same model does, until
    the holder releases it, also by dying (a task SIGKILLed by Airflow leaves no stale lock)."""
    from mlflow import MlflowClient

    _registered(MlflowClient(hetflow_env["MLFLOW_TRACKING_URI"]), "held", "other-model")
    holder = _lock_holder("held", hetflow_env)
    try:
        assert holder.stdout.readline() == "held\n"
        assert _acquired_within("other-model", FREE_WITHIN)
        assert not _acquired_within("held", 2)
        holder.kill()
        holder.wait(10)
        assert _acquired_within("held", FREE_WITHIN)
    finally:
        holder.kill()


def test_the_promotion_lock_holds_against_a_differently_spelled_tracking_uri(hetflow_env, tmp_path):
    """The same registry reached by two spellings of its URI (here the SQLite file through a link
    to its folder; in the compose stack http://mlflow:5000 beside http://127.0.0.1:5000 on the
    host) is one registry: one promotion at a time."""
    from mlflow import MlflowClient

    uri = hetflow_env["MLFLOW_TRACKING_URI"]
    store = Path(uri.removeprefix("sqlite:///"))
    (tmp_path / "store").symlink_to(store.parent)
    other_spelling = f"sqlite:///{tmp_path / 'store' / store.name}"
    assert other_spelling != uri
    _registered(MlflowClient(uri), "spelled")
    holder = _lock_holder("spelled", {**hetflow_env, "MLFLOW_TRACKING_URI": other_spelling})
    try:
        assert holder.stdout.readline() == "held\n"
        assert not _acquired_within("spelled", 2)
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert _acquired_within("spelled", FREE_WITHIN)
    finally:
        holder.kill()


def test_the_promotion_lock_excludes_another_host_that_spells_the_server_uri_its_own_way(mlflow_server, tmp_path):
    """Two hosts (two homes: two flocks that know nothing of each other) reach one MLflow server as
    http://127.0.0.1:PORT and http://localhost:PORT: the second waits in the registry while the
    first holds, and takes the lock once it is released. MLflow's Models page says what the lock
    is and who holds it."""
    from hetflow.registry.registry_lock import HELD_BY_TAG, lock_name
    from mlflow import MlflowClient

    client = MlflowClient(f"http://127.0.0.1:{mlflow_server}")
    _registered(client, "two-hosts")
    first = _lock_holder("two-hosts", _home(tmp_path, "first", f"http://127.0.0.1:{mlflow_server}"))
    second = None
    try:
        assert _Output(first.stdout).says_within("held", FREE_WITHIN)
        second = _lock_holder("two-hosts", _home(tmp_path, "second", f"http://localhost:{mlflow_server}"))
        said, logged = _Output(second.stdout), _Output(second.stderr)
        assert logged.says_within("waiting for two-hosts (promotion lock)", FREE_WITHIN)
        assert not said.says_within("held", 3)
        lock = client.get_registered_model(lock_name("two-hosts"))
        assert f"pid {first.pid}: " in lock.tags[HELD_BY_TAG], lock.tags
        assert lock.description.startswith("Not a model.") and "'two-hosts'" in lock.description, lock.description
        _release(first)
        assert said.says_within("held", FREE_WITHIN), f"the second holder logged: {logged.seen()}"
        _release(second)
        assert client.search_registered_models("name LIKE 'two-hosts (%'") == []
    finally:
        for holder in (first, second):
            if holder:
                holder.kill()


def test_a_dead_holders_lock_in_the_registry_is_taken_over_once_its_heartbeat_stops(
    mlflow_server, tmp_path, monkeypatch
):
    """A holder on another host is SIGKILLed while holding: its flock dies with it, its lock in the
    registry does not. The waiter does not take the lock while the holder lives and beats (two
    stale periods), takes it once the heartbeat has stood still for the stale period, and leaves a
    tombstone named after the dead holder's token, which a later holder sweeps once it is old."""
    from hetflow.registry import registry_lock
    from mlflow import MlflowClient

    name, uri = "dead-holder", f"http://127.0.0.1:{mlflow_server}"
    client = MlflowClient(uri)
    _registered(client, name)
    quick = {"HEARTBEAT_SECONDS": 0.5, "STALE_AFTER_SECONDS": 4, "POLL_SECONDS": 0.2}
    first = _lock_holder(name, _home(tmp_path, "first", uri), quick)
    second = None
    try:
        assert _Output(first.stdout).says_within("held", FREE_WITHIN)
        token = client.get_registered_model(registry_lock.lock_name(name)).tags[registry_lock.HOLDER_TAG]
        second = _lock_holder(name, _home(tmp_path, "second", f"http://localhost:{mlflow_server}"), quick)
        said, logged = _Output(second.stdout), _Output(second.stderr)
        assert logged.says_within(f"waiting for {name} (promotion lock)", FREE_WITHIN)
        assert not said.says_within("held", 8)
        first.kill()
        first.wait(10)
        killed = time.monotonic()
        assert said.says_within("held", FREE_WITHIN), f"the second holder logged: {logged.seen()}"
        assert time.monotonic() - killed > 3  # the stale period, less a heartbeat and a poll
        assert logged.says_within(f"took over {name} (promotion lock) held by ", 1)
        tombstone = client.get_registered_model(registry_lock.tombstone_name(name, token))
        assert tombstone.tags[registry_lock.HOLDER_TAG] == token
        _release(second)
        assert [found.name for found in client.search_registered_models(f"name LIKE '{name} (%'")] == [tombstone.name]
    finally:
        for holder in (first, second):
            if holder:
                holder.kill()
    monkeypatch.setattr(registry_lock, "SWEEP_AFTER_SECONDS", 0)
    later = registry_lock.RegistryLock(client, name, "a later promotion")
    later.acquire()
    later.release()
    assert client.search_registered_models(f"name LIKE '{name} (%'") == []


def test_a_waiter_that_read_a_dead_holder_late_cannot_rename_the_next_holders_lock_away(hetflow_env):
    """Two waiters saw the same dead holder. The first renames its lock to that holder's tombstone
    and takes the lock; the second, acting on what it read before, tries the same rename: the
    tombstone's name is taken, so the rename fails and the new holder keeps its lock."""
    from hetflow.registry import registry_lock
    from mlflow import MlflowClient

    name = "late-breaker"
    client = MlflowClient()
    _registered(client, name)
    dead = registry_lock.RegistryLock(client, name, "a task SIGKILLed while it held the lock")
    dead.acquire()
    dead._stop.set()  # its heartbeat dies with it; the lock stays in the registry
    first = registry_lock.RegistryLock(client, name, "the first waiter")
    late = registry_lock.RegistryLock(client, name, "the late waiter")
    assert first._break(dead.token, dead.held_by, "its heartbeat stopped")
    first.acquire()
    try:
        assert not late._break(dead.token, dead.held_by, "its heartbeat stopped (as read before)")
        first.confirm()  # still its lock
        lock = client.get_registered_model(registry_lock.lock_name(name))
        assert lock.tags[registry_lock.HOLDER_TAG] == first.token
    finally:
        first.release()
    assert (
        client.get_registered_model(registry_lock.tombstone_name(name, dead.token)).tags[registry_lock.HOLDER_TAG]
        == dead.token
    )


def test_a_lock_released_while_the_store_refuses_a_waiters_create_is_taken_not_raised(hetflow_env, monkeypatch):
    """The waiter's create fails on the taken name; before MLflow's store looks the holder up to say
    so, the holder releases: the store answers the create with RESOURCE_DOES_NOT_EXIST (a
    clean-clone CI run lost a waiter this way). The waiter tries again and takes the lock."""
    from mlflow.store.model_registry.sqlalchemy_store import SqlAlchemyStore

    from hetflow.registry import registry_lock
    from mlflow import MlflowClient

    name = "released-in-between"
    client = MlflowClient()
    _registered(client, name)
    holder = registry_lock.RegistryLock(client, name, "the holder")
    holder.acquire()
    look_up = SqlAlchemyStore.get_registered_model
    released = []

    def holder_releases_first(store, model_name):
        if model_name == registry_lock.lock_name(name) and not released:
            released.append(True)
            holder.release()
        return look_up(store, model_name)

    monkeypatch.setattr(SqlAlchemyStore, "get_registered_model", holder_releases_first)
    waiter = registry_lock.RegistryLock(client, name, "the waiter")
    waiter.acquire()
    try:
        assert (
            released
            and client.get_registered_model(registry_lock.lock_name(name)).tags[registry_lock.HOLDER_TAG]
            == waiter.token
        )
    finally:
        waiter.release()


class _Output:
    """The lines a process writes to one of its pipes, read as they come."""

    def __init__(self, stream):
        self.lines: queue.Queue[str] = queue.Queue()
        self._seen: list[str] = []
        threading.Thread(target=lambda: [self.lines.put(line) for line in stream], daemon=True).start()

    def seen(self) -> str:
        """Every line so far, for a failure's message: what a holder logged says why it never took the lock."""
        while not self.lines.empty():
            self._seen.append(self.lines.get())
        return "".join(self._seen)[-4000:]

    def says_within(self, text: str, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                self._seen.append(self.lines.get(timeout=left))
                if text in self._seen[-1]:
                    return True
            except queue.Empty:
                return False
        return False


def _release(holder: subprocess.Popen) -> None:
    holder.stdin.write("\n")
    holder.stdin.flush()
    assert holder.wait(30) == 0


def _registered(client, *names: str) -> None:
    for name in names:
        try:
            client.create_registered_model(name)
        except Exception:  # noqa: BLE001  (made by an earlier test of the session)
            client.get_registered_model(name)


def _acquired_within(name: str, seconds: float) -> bool:
    """Whether this process takes ``name``'s promotion lock within ``seconds``; an error taking it
    is raised here, not lost in the thread."""
    from hetflow.registry.champion import promotion_lock

    got, errors = threading.Event(), []

    def take():
        try:
            with promotion_lock(name):
                got.set()
        except Exception as error:  # noqa: BLE001  (re-raised below, in the test)
            errors.append(error)
            got.set()

    threading.Thread(target=take, daemon=True).start()
    acquired = got.wait(seconds)
    if errors:
        raise errors[0]
    return acquired


# A lock that is free is taken well within this, also on a loaded machine (the registry is asked
# for the model first); the waits that must time out are 2 s.
FREE_WITHIN = 30


def _lock_holder(name: str, env: dict[str, str], lock_settings: dict[str, float] | None = None) -> subprocess.Popen:
    """A process that takes ``name``'s promotion lock, says "held" and keeps it until a line comes;
    it logs at INFO to stderr. ``lock_settings``: values of ``registry_lock``'s timings."""
    script = "import logging\nlogging.basicConfig(level=logging.INFO)\nfrom hetflow.registry import registry_lock\n"
    script += "".join(f"registry_lock.{setting} = {value!r}\n" for setting, value in (lock_settings or {}).items())
    script += f"from hetflow.registry.champion import promotion_lock\nwith promotion_lock({name!r}):\n"
    script += "    print('held', flush=True)\n    input()"
    return subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
