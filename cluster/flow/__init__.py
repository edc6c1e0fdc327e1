"""The request data plane: `PDCluster` (the Python API), the per-request owner, the
request flow over prefill and decode workers, the router, disaggregation choices,
the decode streams and the cost models fed by finished requests. It reads the control
plane's worker records (`cluster.control`), never the HTTP layer above it.
"""
