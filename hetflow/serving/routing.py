"""What the balancer routes, as it holds it: each model in a backend slot, its versions each in a
version slot with a traffic share, a state and its replicas, its labels; and the maps HAProxy routes
by, made from that whole (``hetflow.serving.balancer`` publishes them)::

    models       NAME -> m<i>                       the model's traffic split
    selectors    NAME/versions/N, NAME/labels/L -> m<i>s<j>   one version
    status       NAME[/versions/N | /labels/L] -> TF Serving's status JSON (GET /v1/models/...)
    invocations  default -> m<i>, or several -> 1   what POST /invocations reaches
"""

import json
from dataclasses import dataclass, field

MAPS = ("models", "selectors", "status", "invocations")


@dataclass
class Version:
    slot: int
    percent: int = 0
    state: str = "AVAILABLE"
    message: str = ""
    replicas: dict = field(default_factory=dict)  # socket path -> replica number
    next_replica: int = 0


@dataclass
class Model:
    slot: int
    versions: dict = field(default_factory=dict)  # version number -> Version
    labels: dict = field(default_factory=dict)  # label -> version number


def status_json(versions):
    return json.dumps(
        {
            "model_version_status": [
                {
                    "version": str(number),
                    "state": entry.state,
                    "status": {
                        "error_code": "OK" if entry.state != "END" or not entry.message else "UNKNOWN",
                        "error_message": entry.message,
                    },
                }
                for number, entry in sorted(versions.items(), reverse=True)
            ]
        },
        separators=(",", ":"),
    )


def route_maps(models, default_model, hidden=None):
    """Each map's entries for ``models`` (name -> Model); ``hidden``: a (model, version) left out, as
    if already gone."""
    maps = {name: {} for name in MAPS}
    for name, model in models.items():
        maps["models"][name] = f"m{model.slot}"
        shown = {n: v for n, v in model.versions.items() if (name, n) != hidden}
        maps["status"][name] = status_json(shown)
        routes = {f"versions/{n}": n for n in shown}
        routes.update({f"labels/{label}": n for label, n in model.labels.items() if n in shown})
        for route, number in routes.items():
            maps["selectors"][f"{name}/{route}"] = f"m{model.slot}s{shown[number].slot}"
            maps["status"][f"{name}/{route}"] = status_json({number: shown[number]})
    default = default_model or (next(iter(models)) if len(models) == 1 else None)
    if default:
        maps["invocations"]["default"] = f"m{models[default].slot}"
    elif len(models) > 1:
        maps["invocations"]["several"] = "1"
    return maps
