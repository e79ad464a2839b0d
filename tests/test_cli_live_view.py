"""What `hetflow run` prints while the DAG runs, from the records a run emits."""

from __future__ import annotations

import io
import logging

from hetflow.cli.live_view import LiveView


def _shown(*records: tuple[str, int, str]) -> list[str]:
    out = io.StringIO()
    view = LiveView(out)
    for name, level, message in records:
        view.emit(logging.getLogger(name).makeRecord(name, level, __file__, 1, message, (), None))
    return out.getvalue().splitlines()


DAG = "airflow.sdk.definitions.dag"
CLUSTER = "hetflow.cluster"
INFO, ERROR = logging.INFO, logging.ERROR


def test_tasks_replicas_and_one_bar_per_epoch_of_the_chief_only():
    lines = _shown(
        (DAG, INFO, "[DAG TEST] starting task_id=train map_index=-1"),
        (DAG, INFO, "[DAG TEST] running task <TaskInstance: hetflow_train.train>"),
        (CLUSTER, INFO, "started worker-0 (keeper pid 41) at 127.0.0.1:5000, pinned to core 0"),
        (CLUSTER, INFO, "[worker-0] I0000 00:00:17 grpc_server_lib.cc:470] Started server"),
        (CLUSTER, INFO, "[worker-1] Epoch 1/4"),
        (CLUSTER, INFO, "[worker-0] Epoch 1/4"),
        (CLUSTER, INFO, "[worker-1] 39/39 - 1s - loss: 1.9086 - accuracy: 0.5665"),
        (CLUSTER, INFO, "[worker-0] 39/39 - 1s - loss: 1.9086 - accuracy: 0.5665 - val_loss: 1.5 - val_accuracy: 0.78"),
        (CLUSTER, INFO, "worker-1 killed by SIGKILL"),
        ("hetflow.stages", INFO, "spec: {'dataset': 'uci_digits', 'model': 'mlp'}"),
        (DAG, INFO, "[DAG TEST] end task task_id=train map_index=-1"),
    )
    assert lines[0] == "> train"
    assert lines[1:5] == [
        "  + worker-0 started (keeper pid 41) at 127.0.0.1:5000, pinned to core 0",
        "  [worker-0] Epoch 1/4 [#####...............] loss 1.9086 - accuracy 0.5665 - val_loss 1.5000 - "
        "val_accuracy 0.7800",
        "  - worker-1 killed by SIGKILL",
        lines[4],
    ]
    assert lines[4].startswith("  train done in ") and len(lines) == 5


def test_an_error_inside_a_task_marks_it_failed():
    lines = _shown(
        (DAG, INFO, "[DAG TEST] starting task_id=train map_index=-1"),
        ("airflow.task", ERROR, "Task failed with exception\nTraceback ..."),
        (DAG, INFO, "[DAG TEST] end task task_id=train map_index=-1"),
    )
    assert lines[:2] == ["> train", "  ! Task failed with exception"]
    assert lines[2].startswith("  train failed in ")
