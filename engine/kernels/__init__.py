"""GPU kernels in Triton, each with the plain-torch reference it is tested against.

`triton_attention` is paged attention (decode rows and prefill chunks reading the KV
pool in place), `triton_kv_store` writes a step's new keys and values into their
slots. Both are imported only by the backends that launch them
(`engine.triton_backend`), so the engine imports without triton. On a CPU they run
under Triton's interpreter (`TRITON_INTERPRET=1`, set before triton is imported): the
debug mode in which the tests drive the GPU path end to end.
"""
