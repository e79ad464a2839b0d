"""`hetflow serve`'s options: a wrong one is refused in one line naming it and what it allows, before
anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetflow.cli.main import main
from hetflow.registry import store


@pytest.mark.parametrize(
    "arguments, line",
    [
        (["--port", "70000"], "hetflow serve: --port 70000: a TCP port from 1 to 65535"),
        (["--replicas", "0"], "hetflow serve: --replicas 0: from 1 to 16 model-server processes per version"),
        (
            ["--canary-steps", "10,5,100"],
            "hetflow serve: --canary-steps '10,5,100': percentages rising from above 0 to 100, e.g. 10,50,100",
        ),
        (
            ["--canary-steps", "10,50"],
            "hetflow serve: --canary-steps '10,50': percentages rising from above 0 to 100, e.g. 10,50,100",
        ),
        (["--max-error-rate", "1.5"], "hetflow serve: --max-error-rate 1.5: a fraction from 0 to below 1, e.g. 0.01"),
        (
            ["--host", "0.0.0.0"],
            "hetflow serve: --host 0.0.0.0: listening beyond 127.0.0.1 needs a token in $HETFLOW_SERVE_TOKEN",
        ),
    ],
)
def test_a_wrong_option_is_one_line_naming_it(arguments, line, capsys, monkeypatch):
    monkeypatch.delenv("HETFLOW_SERVE_TOKEN", raising=False)
    assert main(["serve", *arguments]) == 2
    assert capsys.readouterr().err == line + "\n"


def test_a_model_without_a_champion_is_refused_naming_those_with_one(capsys, tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = store.client(uri)
    client.create_registered_model("served")
    client.create_model_version("served", source="file:///nowhere")
    client.set_registered_model_alias("served", "champion", "1")
    capsys.readouterr()  # MLflow's notices of the new store
    assert main(["serve", "--model", "hetflow-cats"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "hetflow serve: --model hetflow-cats: not a registered model with a champion; those with one: served"
    )


def test_a_port_taken_by_another_program_stops_it_in_one_line_leaving_nothing(capsys, tmp_path, monkeypatch):
    import socket

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 1
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("hetflow serve: stopped: ") and str(port) in last, last
    assert not list(Path("/tmp").glob(f"hetflow-serve-{port}-*"))
