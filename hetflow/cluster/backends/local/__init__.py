"""backend=local: every replica a process of this machine, in a sandbox of its own under a keeper
(``keeper``), listening only in the run's network namespace (``netns``)."""

from hetflow.cluster.backends import Supports

# Plain processes: nothing enforces a CPU limit or asks for a GPU.
SUPPORTS = Supports(limits_cpus_and_gpus=False)
