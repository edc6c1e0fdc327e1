"""The worker shell both roles share: the Ray actor base that runs an engine on its
loop (`actor`), the health report (`health`), the typed messages that cross Ray
(`messages`) and the spec the controller hands each worker (`spec`).

It sits above `engine` and `kv_transfer` and below `prefill_worker`/`decode_worker`,
so the engine itself imports nothing of ours.
"""
