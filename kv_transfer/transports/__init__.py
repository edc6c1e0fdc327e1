"""KV transports; built by name through `kv_transfer.registry` (imports stay lazy)."""
