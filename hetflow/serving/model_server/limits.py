"""The model server's limits that its launcher (``hetflow.serving.replicas``) also reads: it imports
nothing, so the pipeline can import it where the server's other modules (plain-name imports of one
another, run as ``python -I model_server``) could not be."""

DEFAULT_MAX_INSTANCES = 256
DEFAULT_MAX_BODY_BYTES = 16 << 20
DRAIN_SECONDS = 10.0  # on SIGTERM, how long requests in flight may take to finish
