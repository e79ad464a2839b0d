"""Where a run may read data from: HETFLOW_HOME/data and the roots the machine's operator allows."""

from __future__ import annotations

import os
from pathlib import Path

DATA_ROOTS_ENV = "HETFLOW_DATA_ROOTS"


def data_roots() -> list[str]:
    """Where a data_dir or a dataset folder may lie: HETFLOW_HOME/data and the folders the machine's
    operator lists in HETFLOW_DATA_ROOTS (``:``-separated), links resolved. Not a form field: a
    data_dir is shown to every replica, and one anywhere (the stack's secrets, /run and its Docker
    socket) would show them what they must not see; a folder's images become training data that the
    replicas read and the registered model was fitted to, so a folder anywhere would hand them any
    file the pipeline can read."""
    from hetflow.paths import data_dir

    listed = [root for root in os.environ.get(DATA_ROOTS_ENV, "").split(":") if root.startswith("/")]
    return [os.path.realpath(root) for root in [str(data_dir()), *listed]]


def under_a_root(path: str, roots: list[str]) -> bool:
    resolved = os.path.realpath(path)
    return any(resolved == root or resolved.startswith(root.rstrip("/") + "/") for root in roots)


def confined(path: str, field: str, roots: list[str]) -> Path:
    """``path`` resolved once, to be used resolved from then on (opened, recorded, bound), so that what
    was checked is what is used: a link along it swapped later changes nothing. ValueError, one line
    naming ``field``, when it lies under none of ``roots``."""
    resolved = os.path.realpath(path)
    if not under_a_root(resolved, roots):
        raise ValueError(
            f"{field}={path} is invalid: expected a folder under {', '.join(roots)} "
            f"(the machine's operator may allow more roots in {DATA_ROOTS_ENV})"
        )
    return Path(resolved)


def as_checked(path: str, within: str, what: str) -> Path:
    """``path``, recorded resolved when it was checked and used, to be shown to replicas now: refused
    (ValueError, one line) when it resolves elsewhere now (a link swapped in along it since) or lies
    outside ``within`` as that resolves now; a path handed on is followed again by whoever binds it."""
    now, inside = os.path.realpath(path), os.path.realpath(within)
    if now != path:
        raise ValueError(f"{what} {path} is refused: it resolves to {now} now (a link along it changed since checked)")
    if not under_a_root(path, [inside]):
        raise ValueError(f"{what} {path} is refused: it lies outside {within}, which resolves to {inside} now")
    return Path(path)
