"""GGUF model files: their header's metadata (``meta``), read without an engine.

Neutral ground: the catalog reads it to list models, the engine adapters to size them; it
imports nothing of bunkhouse but its errors.
"""
