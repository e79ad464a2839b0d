"""
### Roll a new champion out on the running endpoint

Runs by itself each time `register` moves a registered model's `champion` (an event on the Asset
`hetflow://registry/champion`), or by hand with **Trigger**, naming a *model* and a *version*
(the version `champion` names now: the endpoint rolls out the champion).

Each task is a step of the endpoint's rollout (`hetflow serve`, `make serve`), so this grid shows
where a rollout stopped: **stage** (the version's files copied and checked), **start** (its model
servers), **warm_and_check** (warm requests, answers checked), **canary** (10%, then 50% of the
traffic, each step judged on the canary's errors and p99), **promote** (all traffic; the old version
drains and stops). Each task's log gives its step's figures. A rolled-back rollout fails the task of
the step that failed, with the reason as one line; `champion` is back on the previous version.

With no endpoint running, *stage* is skipped, saying how to start one, and so is the rest.
"""

# For developers: wiring only. Every task calls ``hetflow.tasks.deploy.deploy`` with its own step; the
# endpoint carries the rollout out, and the step tasks follow it through its control socket.

from __future__ import annotations

from airflow.sdk import Asset, dag, task

from hetflow.pipeline.task_log import DAG_ARGUMENTS
from hetflow.serving.control import CHAMPION_ASSET_URI
from hetflow.spec.form import form_param

CHAMPION_MOVES = Asset(CHAMPION_ASSET_URI)


def _events(triggering_asset_events) -> list[dict]:
    """The extras of the champion events that scheduled this run (none for a run triggered by hand)."""
    if not triggering_asset_events:
        return []
    return [dict(event.extra) for event in triggering_asset_events.get(CHAMPION_MOVES, [])]


@dag(
    dag_id="hetflow_deploy",
    description="Roll a new champion out on the running endpoint, step by step",
    doc_md=__doc__,
    params={
        "model": form_param(
            None, type=["null", "string"], minLength=1, maxLength=256, description="a registered model"
        ),
        "version": form_param(
            None,
            type=["null", "string", "integer"],
            pattern=r"^[1-9][0-9]{0,9}$",
            minimum=1,
            description="its version: a number, 1 or more",
        ),
    },
    **{**DAG_ARGUMENTS, "schedule": [CHAMPION_MOVES]},
)
def hetflow_deploy():
    @task
    def stage(run_id: str | None = None, dag_run=None, triggering_asset_events=None):
        from airflow.sdk.exceptions import AirflowSkipException

        from hetflow.serving.control import NoEndpoint
        from hetflow.tasks import deploy as stage

        try:
            return stage.deploy(run_id, "stage", dag_run.conf or {}, _events(triggering_asset_events))
        except NoEndpoint as absent:  # every task after it is skipped too: a run with no endpoint is no error
            raise AirflowSkipException(str(absent)) from None

    def step(name: str):
        @task(task_id=name)
        def follow(run_id: str | None = None, dag_run=None, triggering_asset_events=None):
            from hetflow.tasks import deploy as stage

            return stage.deploy(run_id, name, dag_run.conf or {}, _events(triggering_asset_events))

        return follow()

    stage() >> step("start") >> step("warm_and_check") >> step("canary") >> step("promote")


hetflow_deploy()
