"""The OpenAI-compatible HTTP layer: the FastAPI frontend, request bodies and their
validation, sampling parameters, responses, tool calls, tokenize/detokenize, limits and
draining. It drives requests through `cluster.flow` and reads `cluster.control`'s metrics.
"""
