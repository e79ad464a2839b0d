"""The one backend interface (hetflow/cluster/backends.py): every backend a spec can name implements
it, and nothing else asks which backend a spec names."""

from __future__ import annotations

import re

from conftest import REPO

from hetflow.spec import ClusterSpec, RunSpec


def test_every_backend_a_spec_can_name_implements_the_one_interface():
    """backend_for is the one choice: each value of spec.backend has a module whose BACKEND has
    every method of the Backend protocol, and no other module asks which backend a spec names."""
    import inspect
    import typing

    from hetflow.cluster.backends import Backend, backend_for

    names = typing.get_args(ClusterSpec.model_fields["backend"].annotation)
    assert set(names) == {"local", "docker", "swarm", "kubernetes"}
    wanted = {name for name, _ in inspect.getmembers(Backend, inspect.isfunction) if not name.startswith("_")}
    for name in names:
        backend = backend_for(RunSpec.from_values({"backend": name}))
        assert {m for m in wanted if callable(getattr(backend, m, None))} == wanted, name
        assert backend.loss_report_seconds >= 0
    chains = [
        str(path.relative_to(REPO))
        for path in (REPO / "hetflow").rglob("*.py")
        if path.parent != REPO / "hetflow" / "spec" and re.search(r"backend\s*(==|!=|in \()", path.read_text())
    ]
    assert chains == []
