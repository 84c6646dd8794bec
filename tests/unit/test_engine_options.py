"""What each engine adapter owns of a model's options: its slot sizes."""

from __future__ import annotations

from bunkhouse.engines.llamacpp import LlamaCpp
from bunkhouse.engines.whisper import Whisper


def test_llamacpp_slots_are_whole_blocks_of_256_tokens_within_the_ask() -> None:
    slots = LlamaCpp()
    assert [slots.slot_tokens(t) for t in (1, 255, 256, 300, 511, 512, 8192)] == \
        [256, 256, 256, 256, 256, 512, 8192]


def test_whisper_slots_are_as_asked() -> None:
    assert Whisper().slot_tokens(300) == 300
