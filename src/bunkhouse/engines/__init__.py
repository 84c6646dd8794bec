"""Front-side engine adapters: what the front must know of each engine, and nothing more.

These modules never import an engine (the front loads no native ML code); the worker side of
each engine lives in ``bunkhouse.worker.engines``.
"""
