"""Clients of a running service: the load generator (``loadgen``)."""
