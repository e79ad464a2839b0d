"""What runs inside a replica, in every backend: ``python -m hetflow.replica --run-dir DIR``.

- ``__main__``: the entry point; the role comes from ``TF_CONFIG``, the run from the run directory.
- ``runtime``: the replica's devices and threads.
- one module per way of training: ``sync`` (one_device, mirrored, multi_worker_mirrored, with
  equal or speed-balanced batches), ``parameter_server`` (async, ``ClusterCoordinator``),
  ``model_parallel`` (layer groups on different devices); ``balance`` measures the workers over
  before their first step, for balance_batches and strategy=auto.
- what they share: ``loop`` (the epoch loop), ``checkpoint``, ``clock`` (where the time goes),
  ``weights`` and ``record`` (the final weights and training.json).

Only the chief writes the model and ``training.json``; the supervising ``train`` task reads them.
Nothing here imports Airflow or MLflow (the replica image has neither).
"""
