"""Serving: a stable endpoint (a reverse proxy per deployment) in front of Triton backends.

Pure decisions live in ``ports``, ``topology`` and ``haproxy`` (rendering); ``probe`` talks
HTTP to Triton; ``stoker.containers.engine`` talks to the Docker engine; ``promote`` composes them
into the steps of a promotion (reconcile, stage, switch, watch), and ``retire`` drains and removes the old
backend.
"""
