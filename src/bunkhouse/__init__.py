"""bunkhouse: a multi-model LLM serving host."""

__version__ = "0.1.0"
