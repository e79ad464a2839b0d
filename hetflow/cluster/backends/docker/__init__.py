"""backend=docker: every replica a container on this machine's Docker engine, in a network of the
run's own."""

from hetflow.cluster.backends import Supports

SUPPORTS = Supports()
