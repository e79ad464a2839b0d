"""backend=swarm: every replica a service on a Docker Swarm whose nodes may be several machines,
on an overlay network of the run's own."""

from hetflow.cluster.backends import Supports

SUPPORTS = Supports(
    places_on_named_nodes=True,
    network_encryption_optional=True,
    pin_cores_refused="Swarm services set CPUs by replica_cpus",
)
