"""Float32 CPU kernels of our own (the `.c` files here), compiled once per machine and
cached.

`build.py` compiles the shipped sources, `bindings.py` declares every entry point's
typed signature, `ops.py` loads them (`native_kernels()`, `kernel_status()`) and runs
the decoder layer's grouped operations on them, `attention.py` is the paged attention
backend reading the pool in place, `decode_step.py` a whole decode step in one call.
Chosen by `kernels: auto|native` (engine.layer_ops) and `attention_backend: auto|native`
(engine.attention); where they cannot be built (no C compiler) the engine falls back to
torch ops and says so in one warning. `python -m engine.native` builds them and reports.
"""
