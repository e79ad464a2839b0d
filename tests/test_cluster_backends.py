"""The one backend interface (hetflow/cluster/backends/base.py) and the rooms (hetflow/cluster/backends/
<name>/): every backend a spec can name implements the interface from its own room and declares there
what it supports; the spec asks those declarations, and nothing asks which backend a spec names."""

from __future__ import annotations

import dataclasses
import re

import pytest
from conftest import REPO

from hetflow.spec import ClusterSpec, SpecError, parse_spec


def test_every_backend_a_spec_can_name_implements_the_one_interface_from_its_own_room():
    """backend_for is the one choice: each value of spec.backend is a room whose BACKEND is a Backend
    with no abstract method left, and nothing in the package asks which backend a spec names."""
    import typing

    from hetflow.cluster.backends import NAMES
    from hetflow.cluster.backends.base import Backend, backend_for

    names = typing.get_args(ClusterSpec.model_fields["backend"].annotation)
    assert names == NAMES == ("local", "docker", "swarm", "kubernetes")
    for name in names:
        backend = backend_for(parse_spec({"backend": name}))
        assert isinstance(backend, Backend) and not type(backend).__abstractmethods__, name
        assert type(backend).__module__ == f"hetflow.cluster.backends.{name}.backend"
        assert backend.loss_report_seconds >= 0
    chains = [
        str(path.relative_to(REPO))
        for path in (REPO / "hetflow").rglob("*.py")
        if re.search(r"backend\s*(==|!=|in \(|not in \()", path.read_text())
    ]
    assert chains == []


def test_a_rooms_declaration_is_what_the_spec_checks(monkeypatch):
    """The spec's backend checks follow what each room declares: kubernetes refuses exit_code and a
    slowed worker until its declaration says otherwise, and the message names the backends that do."""
    from hetflow.cluster.backends import kubernetes

    values = {"backend": "kubernetes", "restart_policy": "exit_code"}
    with pytest.raises(SpecError, match=r"restart_policy=exit_code is invalid with backend=kubernetes"):
        parse_spec(values)
    slowed = {"backend": "kubernetes", "strategy": "multi_worker_mirrored", "workers": 2}
    slowed["worker_devices"] = [{"slowdown": 1.0}, {"slowdown": 2.0}]
    with pytest.raises(SpecError, match=r"simulated by backend=local, docker or swarm only\)"):
        parse_spec(slowed)

    declared = dataclasses.replace(
        kubernetes.SUPPORTS, restart_policies=("never", "on_failure", "exit_code"), slows_workers=True
    )
    monkeypatch.setattr(kubernetes, "SUPPORTS", declared)
    assert parse_spec(values).cluster.run_policy.restart_policy == "exit_code"
    assert parse_spec(slowed).cluster.worker.each[1].slowdown == 2.0


def test_a_backend_that_limits_nothing_refuses_the_container_limits_with_the_backends_that_do(monkeypatch):
    from hetflow.cluster.backends import docker

    monkeypatch.setattr(docker, "SUPPORTS", dataclasses.replace(docker.SUPPORTS, limits_cpus_and_gpus=False))
    with pytest.raises(SpecError) as refused:
        parse_spec({"backend": "docker", "replica_cpus": 1.5})
    assert str(refused.value) == (
        "replica_cpus=1.5 is invalid with backend=docker: expected 0.0 "
        "(CPU limits and GPU requests apply to backend=swarm or kubernetes)"
    )


def test_the_table_of_docs_backends_md_is_what_the_rooms_declare():
    from hetflow.cluster.backends import NAMES, supports

    rows = {
        "`replica_cpus`, `request_gpus`": lambda s: s.limits_cpus_and_gpus,
        "`restart_policy=exit_code`": lambda s: "exit_code" in s.restart_policies,
        "`worker_devices` `node`": lambda s: s.places_on_named_nodes,
        "`encrypt_network=false`": lambda s: s.network_encryption_optional,
        "`pin_cores`": lambda s: not s.pin_cores_refused,
        "`worker_devices` `slowdown`": lambda s: s.slows_workers,
        "`data_dir`, `dataset=folder:PATH`": lambda s: s.mounts_host_folders,
    }
    table = {}
    for line in (REPO / "docs" / "backends.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if cells[0] in rows:
            table[cells[0]] = cells[1:]
    assert table == {row: ["yes" if does(supports(n)) else "no" for n in NAMES] for row, does in rows.items()}
