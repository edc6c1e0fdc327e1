"""The control plane: the controller that starts, watches and restarts workers (and its
record of each, `WorkerInfo`), the local Ray head, prestarted processes, the core plan
and the Prometheus metrics. It knows nothing of individual requests' flow; the data plane
above it (`cluster.flow`) reads its worker records.
"""
