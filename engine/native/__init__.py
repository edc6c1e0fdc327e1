"""Float32 CPU kernels of our own (kernels.c), compiled once per machine and cached.

`build.py` compiles and loads the library, `ops.py` runs the decoder layer's grouped
operations on it, `attention.py` is the paged attention backend reading the pool in
place. Chosen by `kernels: auto|native` (engine.layer_ops) and
`attention_backend: auto|native` (engine.attention); where no C compiler exists the
engine falls back to torch ops.
"""
