"""Where a run may read data from: HETFLOW_HOME/data and the roots the machine's operator allows."""

from __future__ import annotations

import os

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
