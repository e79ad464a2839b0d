"""The event on the champion Asset (``hetflow://registry/champion``, hetflow_deploy's schedule) that
each DAG's ``register`` adds for every model whose ``champion`` it moved, model and version in its extra.

Through an alias: a task's plain outlets would get an event on every run, moved or not."""

from __future__ import annotations

from typing import Any

from airflow.sdk import Asset, AssetAlias

from hetflow.serving.control import CHAMPION_ASSET_URI

CHAMPION_MOVES = AssetAlias("hetflow_champion_moves")


def add_champion_events(outlet_events: Any, registered: dict[str, Any]) -> None:
    """One event per move in what ``hetflow.tasks.register.register`` returned."""
    for moved in registered["champion_moves"]:
        outlet_events[CHAMPION_MOVES].add(Asset(CHAMPION_ASSET_URI), extra=moved)
