"""The ids of the models shipped in the `models` extra, as the tests name them: one place
to change when a packaged model changes. Literal strings, not read from bunkhouse's own
tables, so that a test of what bunkhouse serves does not take bunkhouse's word for it."""

from __future__ import annotations

QWEN = "qwen2.5-coder-0.5b-instruct"  # the default chat model, ~470 MiB
GEMMA = "gemma-3-270m"  # a completion model (no chat template), ~240 MiB
WHISPER = "whisper-tiny.en"  # the transcription model, served as whisper-1
