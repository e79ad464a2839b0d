"""``hetflow serve``: the endpoint that follows each registered model's ``champion``
(``hetflow/serving/endpoint.py``), on TensorFlow Serving's REST port, until Ctrl-C or SIGTERM."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

from hetflow.serving import policy

TF_SERVING_REST_PORT = 8501
TOKEN_ENV = "HETFLOW_SERVE_TOKEN"


class ServeOptionError(ValueError):
    """One line naming the option and what it allows."""


def add_parser(commands) -> None:
    serve = commands.add_parser("serve", help="serve every registered model's champion and follow the alias")
    serve.add_argument("--port", type=int, default=TF_SERVING_REST_PORT, help="default 8501, TF Serving's REST port")
    serve.add_argument("--host", default="127.0.0.1", help=f"another than 127.0.0.1 requires a token in ${TOKEN_ENV}")
    serve.add_argument(
        "--model", action="append", default=[], metavar="NAME", help="serve only this model (repeatable)"
    )
    serve.add_argument("--replicas", type=int, default=1, help="model-server processes per version (default 1)")
    defaults = policy.Limits()
    serve.add_argument(
        "--canary-steps", default=",".join(map(str, defaults.steps)), help="traffic shares in percent, rising to 100"
    )
    serve.add_argument(
        "--step-seconds", type=float, default=defaults.step_seconds, help="how long each canary step lasts at least"
    )
    serve.add_argument(
        "--max-error-rate", type=float, default=defaults.max_error_rate, help="a canary over it rolls back"
    )
    serve.add_argument(
        "--max-p99-ratio",
        type=float,
        default=defaults.max_p99_ratio,
        help="canary p99 over this times the stable's rolls back",
    )
    serve.add_argument(
        "--render",
        metavar="TARGET",
        help="print each champion's manifest instead of serving: kubernetes (a KServe InferenceService)",
    )
    serve.set_defaults(handler=run)


def limits_from(args) -> policy.Limits:
    try:
        steps = tuple(int(step) for step in args.canary_steps.split(","))
    except ValueError:
        steps = ()
    if not steps or steps[-1] != 100 or any(not 0 < a < b for a, b in zip(steps, steps[1:])) or steps[0] <= 0:
        raise ServeOptionError(
            f"--canary-steps {args.canary_steps!r}: percentages rising from above 0 to 100, e.g. 10,50,100"
        )
    if args.step_seconds <= 0:
        raise ServeOptionError(f"--step-seconds {args.step_seconds:g}: a number of seconds above 0")
    if not 0 <= args.max_error_rate < 1:
        raise ServeOptionError(f"--max-error-rate {args.max_error_rate:g}: a fraction from 0 to below 1, e.g. 0.01")
    if args.max_p99_ratio < 1:
        raise ServeOptionError(f"--max-p99-ratio {args.max_p99_ratio:g}: a ratio of 1 or more, e.g. 2")
    return policy.Limits(
        steps=steps,
        step_seconds=args.step_seconds,
        max_error_rate=args.max_error_rate,
        max_p99_ratio=args.max_p99_ratio,
    )


def check_options(args) -> str | None:
    """The token, where one is needed; raises ServeOptionError before anything starts."""
    if not 0 < args.port < 65536:
        raise ServeOptionError(f"--port {args.port}: a TCP port from 1 to 65535")
    if not 1 <= args.replicas <= 16:
        raise ServeOptionError(f"--replicas {args.replicas}: from 1 to 16 model-server processes per version")
    token = os.environ.get(TOKEN_ENV) or None
    if args.host != "127.0.0.1" and not token:
        raise ServeOptionError(f"--host {args.host}: listening beyond 127.0.0.1 needs a token in ${TOKEN_ENV}")
    return token


def check_models(client, names: list[str]) -> None:
    from hetflow.serving.follower import champions

    served = champions(client)
    unknown = [name for name in names if name not in served]
    if unknown:
        offered = ", ".join(sorted(served)) or "none yet (make run registers one)"
        raise ServeOptionError(
            f"--model {unknown[0]}: not a registered model with a champion; those with one: {offered}"
        )


RENDER_TARGETS = ("kubernetes",)


def render(args) -> int:
    """``--render kubernetes``: each champion as a KServe InferenceService, YAML on stdout."""
    import yaml

    from hetflow.registry import store
    from hetflow.serving import kserve
    from hetflow.serving.follower import champions

    try:
        if args.render not in RENDER_TARGETS:
            raise ServeOptionError(f"--render {args.render}: one of {', '.join(RENDER_TARGETS)}")
        limits = limits_from(args)
        check_options(args)
        tracking_uri = store.tracking_uri()
        client = store.client(tracking_uri)
        check_models(client, args.model)
        served = champions(client, tuple(args.model))
        documents, left_out = kserve.render(
            client, tracking_uri, served, args.replicas, limits.steps[0], named=bool(args.model)
        )
    except (ServeOptionError, kserve.RenderError) as error:
        print(f"hetflow serve: {error}", file=sys.stderr)
        return 2
    for line in left_out:
        print(f"hetflow serve: left out: {line}", file=sys.stderr)
    if not documents:
        print("hetflow serve: no champion to render (make run registers one)", file=sys.stderr)
        return 1
    print(yaml.safe_dump_all(documents, sort_keys=False), end="")
    return 0


def run(args) -> int:
    from hetflow.registry import store
    from hetflow.serving.endpoint import Endpoint

    if args.render is not None:
        return render(args)
    try:
        limits = limits_from(args)
        token = check_options(args)
        tracking_uri = store.tracking_uri()
        check_models(store.client(tracking_uri), args.model)
    except ServeOptionError as error:
        print(f"hetflow serve: {error}", file=sys.stderr)
        return 2
    # Copying a version's files draws MLflow's progress bar, a screenful of carriage returns in a log.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    # The endpoint's working folder (version copies, sockets, HAProxy's files) is short-lived and
    # short-named: a Unix socket's path holds at most 107 bytes, which a checkout's path can exhaust.
    folder = Path(tempfile.mkdtemp(prefix=f"hetflow-serve-{args.port}-"))
    endpoint = Endpoint(
        tracking_uri,
        folder,
        host=args.host,
        port=args.port,
        models=tuple(args.model),
        replicas=args.replicas,
        limits=limits,
        token=token,
    )
    stop = threading.Event()
    ready = threading.Event()
    for signal_number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signal_number, lambda *_: stop.set())
    failures: list[BaseException] = []
    worker = threading.Thread(target=_serve, args=(endpoint, stop, ready, failures), name="endpoint")
    worker.start()
    while worker.is_alive() and not ready.wait(0.5):
        pass
    if ready.is_set():
        served = (
            ", ".join(f"{model} v{version}" for model, (version, _) in sorted(endpoint.serving.items()))
            or "nothing yet"
        )
        print(
            f"hetflow serve: http://{args.host}:{args.port}/v1/models/<name>:predict serves {served}; Ctrl-C stops it",
            flush=True,  # a pipe's reader (a script waiting for the endpoint, `| tee`) sees it now
        )
    while worker.is_alive():
        worker.join(0.5)  # the main thread stays free to take the signals
    shutil.rmtree(folder, ignore_errors=True)
    if failures:
        print(f"hetflow serve: stopped: {' '.join(str(failures[0]).split())}", file=sys.stderr)
        return 1
    print("hetflow serve: stopped; its model servers and HAProxy have ended", flush=True)
    return 0


def _serve(endpoint, stop: threading.Event, ready: threading.Event, failures: list[BaseException]) -> None:
    """The endpoint's thread (the processes it starts die with it); what ended it, for the command's
    one line (the traceback goes to the log)."""
    try:
        endpoint.serve(stop, ready)
    except Exception as error:
        logging.getLogger("hetflow.serving").debug("the endpoint stopped", exc_info=True)
        failures.append(error)
