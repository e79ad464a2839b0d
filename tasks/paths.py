"""Where a run's files live: ``$HETFLOW_HOME/runs/<run_id>/`` and the shared data dir."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def hetflow_home() -> Path:
    return Path(os.environ.get("HETFLOW_HOME", REPO_ROOT / ".hetflow")).resolve()


def data_dir(home: Path | None = None) -> Path:
    """TFDS data dir, shared by all runs so a dataset is prepared once."""
    return (home or hetflow_home()) / "data"


def safe_run_id(run_id: str) -> str:
    """Airflow run ids carry ':' and '+' (``manual__2026-01-01T00:00:00+00:00``): keep them path-safe."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", run_id)


@dataclass(frozen=True)
class RunPaths:
    root: Path

    @property
    def spec(self) -> Path:
        return self.root / "spec.json"

    @property
    def dataset(self) -> Path:
        return self.root / "dataset.json"

    @property
    def cluster(self) -> Path:
        return self.root / "cluster.json"

    @property
    def probes(self) -> Path:
        return self.root / "probe"

    @property
    def plan(self) -> Path:
        return self.root / "plan.json"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def restarts(self) -> Path:
        return self.root / "restarts.json"

    @property
    def replicas(self) -> Path:
        """How each local replica ended, and the supervisor's lease (tasks.cluster.keeper)."""
        return self.root / "replicas"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def model(self) -> Path:
        return self.root / "model.keras"

    @property
    def training(self) -> Path:
        return self.root / "training.json"

    @property
    def evaluation(self) -> Path:
        return self.root / "evaluation.json"

    @property
    def compressed(self) -> Path:
        return self.root / "compressed"

    @property
    def compression(self) -> Path:
        return self.root / "compression.json"

    @property
    def saved_model(self) -> Path:
        return self.root / "export" / "saved_model"

    @property
    def export(self) -> Path:
        return self.root / "export.json"

    @property
    def plots(self) -> Path:
        return self.root / "plots"

    @property
    def registry(self) -> Path:
        return self.root / "registry.json"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"


def run_paths(run_id: str) -> RunPaths:
    return RunPaths(hetflow_home() / "runs" / safe_run_id(run_id))
