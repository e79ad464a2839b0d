"""The served check: the model behind MLflow's own scoring server, sandboxed (``server``), reached
through a relay inside the sandbox's network (``relay``)."""
