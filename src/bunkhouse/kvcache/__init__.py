"""KV state that survives eviction: the snapshot store (store.py)."""
