"""Which version each served model's ``champion`` alias names, read from the registry every few
seconds: the endpoint follows the alias whoever moved it (hetflow's gate, a reviewer in MLflow's UI,
a rollback).

MLflow has no notification of an alias moving; one ``search_registered_models`` call returns
every model's aliases, so a poll costs one request whatever the number of models.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from mlflow import MlflowClient

log = logging.getLogger("hetflow.serving")

CHAMPION = "champion"
POLL_SECONDS = 2.0


@dataclass(frozen=True)
class Move:
    model: str
    previous: str | None  # the version served before; None when the model was not served yet
    version: str


def champions(client: MlflowClient, names: tuple[str, ...] = ()) -> dict[str, str]:
    """Registered model name → the version its ``champion`` names, for every registered model that
    has one, or for ``names`` only (a name without a champion is left out)."""
    found = {}
    for model in _registered_models(client):
        if (not names or model.name in names) and CHAMPION in model.aliases:
            found[model.name] = str(model.aliases[CHAMPION])
    return found


def _registered_models(client: MlflowClient):
    page_token = None
    while True:
        page = client.search_registered_models(max_results=100, page_token=page_token)
        yield from page
        page_token = page.token
        if not page_token:
            return


class Follower:
    """Remembers the version served per model and says which champions moved since."""

    def __init__(self, client: MlflowClient, names: tuple[str, ...] = ()):
        self.client = client
        self.names = names
        self.served: dict[str, str] = {}

    def moves(self) -> list[Move]:
        """The models whose champion differs from the version served. The caller says when a move is
        carried out (``served_now``): a rollout in progress is not reported again."""
        current = champions(self.client, self.names)
        return [
            Move(model, self.served.get(model), version)
            for model, version in sorted(current.items())
            if self.served.get(model) != version
        ]

    def served_now(self, model: str, version: str) -> None:
        self.served[model] = version
