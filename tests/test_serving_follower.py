"""The follower reads each registered model's champion from a real MLflow store, and reports a move
whoever made it, once per version served."""

from __future__ import annotations

from hetflow.registry import store
from hetflow.serving.follower import Follower, Move, champions


def _versions(client, name: str, count: int) -> None:
    client.create_registered_model(name)
    for _ in range(count):
        client.create_model_version(name, source="file:///nowhere")


def test_champions_names_every_model_that_has_one_and_only_those_asked(tmp_path):
    client = store.client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    _versions(client, "with-champion", 2)
    _versions(client, "candidate-only", 1)
    _versions(client, "other", 1)
    client.set_registered_model_alias("with-champion", "champion", "2")
    client.set_registered_model_alias("candidate-only", "candidate", "1")
    client.set_registered_model_alias("other", "champion", "1")
    assert champions(client) == {"with-champion": "2", "other": "1"}
    assert champions(client, ("other", "candidate-only")) == {"other": "1"}


def test_a_move_by_anyone_is_reported_until_it_is_served_and_a_move_back_is_none(tmp_path):
    client = store.client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    _versions(client, "m", 3)
    client.set_registered_model_alias("m", "champion", "1")
    follower = Follower(client)
    assert follower.moves() == [Move("m", None, "1")]
    follower.served_now("m", "1")
    assert follower.moves() == []
    client.set_registered_model_alias("m", "champion", "3")  # as a reviewer does in MLflow's UI
    assert follower.moves() == [Move("m", "1", "3")]
    assert follower.moves() == [Move("m", "1", "3")], "reported again while the rollout has not served it"
    client.set_registered_model_alias("m", "champion", "1")  # a rollback moves it back
    assert follower.moves() == []
