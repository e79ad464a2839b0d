"""The served check: the model behind MLflow's own scoring server, sandboxed (``server``), reached
through a relay inside the sandbox's network (``relay``); and ``hetflow serve``'s endpoint, which
follows each registered model's champion (``endpoint``: HAProxy steered by ``balancer``, sandboxed
model servers by ``replicas``, rollouts by ``rollout``)."""
