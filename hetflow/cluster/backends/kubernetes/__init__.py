"""backend=kubernetes: every replica a pod (or a TFJob's), with a headless service for its address
and a NetworkPolicy that admits only the run's own pods."""

from hetflow.cluster.backends import Supports

SUPPORTS = Supports(
    # The kubelet restarts a pod's container in place; it cannot tell a signal from an error code.
    restart_policies=("never", "on_failure"),
    pin_cores_refused="a pod's CPUs are set by replica_cpus",
    slows_workers=False,
    mounts_host_folders=False,  # pods see only the volume claim holding HETFLOW_HOME
)
