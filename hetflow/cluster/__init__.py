"""Provisioning: a backend-neutral cluster layout, and the backends that start its replicas."""
