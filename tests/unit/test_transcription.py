"""The transcription route's pure parts: upload sniffing, option fields, subtitle formats;
and Whisper model directories in the catalog."""

from __future__ import annotations

import dataclasses
import io
import shutil
from pathlib import Path
from typing import Any

import pytest
from starlette.datastructures import FormData, Headers, UploadFile

from bunkhouse.catalog import build_catalog
from bunkhouse.config import Settings, load_config_file
from bunkhouse.engines import ENGINES
from bunkhouse.errors import ConfigError, InvalidRequest
from bunkhouse.front.audio import looks_like_audio, parse_fields, srt, timestamp, vtt
from tests.helpers import silent_flac, whisper_dir, write_tiny_gguf

FIXTURE = Path(__file__).parent.parent / "fixtures" / "speech.wav"


@pytest.mark.parametrize("head", [
    FIXTURE.read_bytes()[:16], b"ID3\x04\x00", b"\xff\xfb\x90\x00", b"\xff\xf1\x50\x80",
    b"fLaC\x00\x00", b"OggS\x00\x02", b"\x00\x00\x00\x1cftypM4A ", b"\x1a\x45\xdf\xa3\x9f",
    b"FORM\x00\x00\x00\x00AIFF", b"#!AMR\n"])
def test_audio_containers_are_recognized(head: bytes) -> None:
    assert looks_like_audio(head)


@pytest.mark.parametrize("head", [b"these are my notes", b"{\"a\": 1}", b"%PDF-1.7",
                                  b"\x89PNG\r\n\x1a\n", b"", b"\xff", b"PK\x03\x04"])
def test_other_files_are_not_audio(head: bytes) -> None:
    assert not looks_like_audio(head)


def _form(**fields: str | list[str]) -> FormData:
    items: list[tuple[str, str | UploadFile]] = []
    for name, value in fields.items():
        for v in value if isinstance(value, list) else [value]:
            items.append((name.replace("__", "[]"), v))
    return FormData(items)


def test_option_fields_are_read_as_openai_defines_them() -> None:
    options = parse_fields(_form(model="whisper-1", language="en", prompt="Bunkhouse",
                                 temperature="0.2", response_format="verbose_json",
                                 timestamp_granularities__=["word", "segment"],
                                 stream="false", chunking_strategy="auto"))
    assert (options.model, options.language, options.prompt, options.temperature) == \
        ("whisper-1", "en", "Bunkhouse", 0.2)
    assert options.granularities == ("word", "segment") and not options.stream
    assert options.worker_options()["words"] is True
    defaults = parse_fields(_form())
    assert (defaults.response_format, defaults.temperature, defaults.stream) == ("json", 0, False)


@pytest.mark.parametrize(("fields", "param"), [
    ({"response_format": "mp3"}, "response_format"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": "1.5"}, "temperature"),
    ({"temperature": "nan"}, "temperature"),
    ({"language": "english"}, "language"),
    ({"language": "e\nn"}, "language"),
    ({"stream": "yes"}, "stream"),
    ({"timestamp_granularities__": "char", "response_format": "verbose_json"},
     "timestamp_granularities"),
    ({"timestamp_granularities__": "word"}, "timestamp_granularities"),  # json: refused
    ({"model": ["a", "b"]}, "model"),
])
def test_bad_option_fields_get_400_naming_the_field(fields: dict[str, str | list[str]],
                                                    param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        parse_fields(_form(**fields))
    assert refused.value.param == param


def test_a_file_given_where_text_is_expected_is_refused() -> None:
    import io
    upload = UploadFile(io.BytesIO(b"x"), filename="m.txt", headers=Headers())
    with pytest.raises(InvalidRequest) as refused:
        parse_fields(FormData([("model", upload)]))
    assert refused.value.param == "model"


SEGMENTS = [{"start": 0.0, "end": 2.5, "text": " Hello there."},
            {"start": 3661.2, "end": 3662.0049, "text": " Line one\n\nline --> two"}]


def test_srt_and_vtt_are_well_formed() -> None:
    assert timestamp(3661.2, ",") == "01:01:01,200"
    assert timestamp(-0.1, ".") == "00:00:00.000"
    assert srt(SEGMENTS) == ("1\n00:00:00,000 --> 00:00:02,500\nHello there.\n\n"
                             "2\n01:01:01,200 --> 01:01:02,005\nLine one line -> two\n\n")
    assert vtt(SEGMENTS) == ("WEBVTT\n\n00:00:00.000 --> 00:00:02.500\nHello there.\n\n"
                             "01:01:01.200 --> 01:01:02.005\nLine one line -> two\n\n")
    assert srt([]) == "" and vtt([]) == "WEBVTT\n\n"


def test_a_whisper_model_takes_its_own_options_only(tmp_path: Path) -> None:
    from bunkhouse.engines.whisper import Whisper

    own = whisper_dir(tmp_path)
    config = tmp_path / "bunkhouse.toml"
    entry = f'[[models]]\nid = "mine"\npath = "{own}"\nengine = "whisper"\n'
    config.write_text(f"[defaults]\nswa_full = true\n\n{entry}threads = 1\n")
    settings = Settings(cache_dir=tmp_path, include_packaged=False)
    mine = build_catalog(load_config_file(config, settings), engines=ENGINES).get("mine")
    assert mine.options.engine_keys == (("threads", 1),)  # llama.cpp's default is not its
    assert Whisper().worker_args(mine) == ["--parallel", "1", "--engine-options",
                                           '{"threads": 1}']
    config.write_text(f"{entry}swa_full = true\n")
    with pytest.raises(ConfigError, match=r"model 'mine': unknown key\(s\) \['swa_full'\]"):
        build_catalog(load_config_file(config, settings), engines=ENGINES)


def test_a_whisper_directory_without_its_tokenizer_is_refused_by_name(tmp_path: Path) -> None:
    own = whisper_dir(tmp_path, tokenizer=False)
    config = tmp_path / "bunkhouse.toml"
    config.write_text(f'[[models]]\nid = "mine"\npath = "{own}"\nengine = "whisper"\n')
    with pytest.raises(ConfigError, match=r"tokenizer\.json"):
        build_catalog(load_config_file(config, Settings(cache_dir=tmp_path)), engines=ENGINES)
    shutil.rmtree(own)
    with pytest.raises(ConfigError, match="no Whisper model directory"):
        build_catalog(load_config_file(config, Settings(cache_dir=tmp_path)), engines=ENGINES)


def _decoded(data: bytes, **limits: Any) -> int:
    """What the Whisper worker's decoder writes for ``data``: 16 kHz mono samples."""
    from bunkhouse.worker.engines.whisper import decode

    return decode(io.BytesIO(data), io.BytesIO(), **limits)


def test_audio_within_the_bounds_is_decoded_whole() -> None:
    from bunkhouse.worker.engines.whisper import MAX_AUDIO_S, MAX_DECODED_SAMPLES

    assert abs(_decoded(FIXTURE.read_bytes()) - 7.55 * 16_000) < 16_000
    assert MAX_DECODED_SAMPLES >= MAX_AUDIO_S * 48_000 * 2  # 48 kHz stereo fits
    ten = _decoded(silent_flac(10, rate=48_000, layout="stereo"), max_s=11,
                   max_samples=11 * 48_000 * 2)
    assert 10 * 16_000 <= ten <= 11 * 16_000


def test_audio_declared_longer_than_the_bound_is_refused_before_decoding() -> None:
    from bunkhouse.worker.engines.whisper import AudioTooLong

    with pytest.raises(AudioTooLong) as refused:
        _decoded(silent_flac(20), max_s=10)
    assert "(20 s)" in str(refused.value) or "(21 s)" in str(refused.value)  # the header's


def test_audio_whose_header_understates_it_is_refused_as_it_is_decoded() -> None:
    import av

    from bunkhouse.worker.engines.whisper import AudioTooLong

    lying = silent_flac(20, declared_s=1)
    with av.open(io.BytesIO(lying)) as container:
        assert container.duration is not None and container.duration <= 2_000_000
    with pytest.raises(AudioTooLong) as refused:
        _decoded(lying, max_s=10)
    assert "longer than the limit of 10 s" in str(refused.value)


def test_audio_decoding_to_too_many_samples_is_refused_whatever_its_length() -> None:
    """A high rate and many channels multiply the decoder's work (an 8-channel 384 kHz file
    is 32 times a stereo 48 kHz one of the same length): the bound counts samples."""
    from bunkhouse.worker.engines.whisper import AudioTooLong

    stereo = silent_flac(10, rate=96_000, layout="stereo")
    with pytest.raises(AudioTooLong) as declared:  # the header says so
        _decoded(stereo, max_s=60, max_samples=60 * 16_000)
    assert "samples" in str(declared.value)
    lying = silent_flac(10, rate=96_000, layout="stereo", declared_s=0.1)
    with pytest.raises(AudioTooLong) as counted:  # the frames say so
        _decoded(lying, max_s=60, max_samples=60 * 16_000)
    assert "samples" in str(counted.value)


def test_a_transcription_model_is_never_the_default(tmp_path: Path) -> None:
    own = whisper_dir(tmp_path)
    write_tiny_gguf(tmp_path / "t.gguf")
    config = tmp_path / "bunkhouse.toml"
    config.write_text(f'[[models]]\nid = "mine"\npath = "{own}"\nengine = "whisper"\n'
                      f'[[models]]\nid = "text"\npath = "{tmp_path / "t.gguf"}"\n')
    settings = Settings(cache_dir=tmp_path, include_packaged=False)
    catalog = build_catalog(load_config_file(config, settings), engines=ENGINES)
    assert catalog.default_id == "text"
    with pytest.raises(InvalidRequest, match="transcription model") as refused:
        catalog.set_default("mine")
    assert refused.value.param == "model" and catalog.default_id == "text"
    chosen = dataclasses.replace(settings, default_model="mine")
    with pytest.raises(ConfigError, match="'mine' is a transcription model"):
        build_catalog(load_config_file(config, chosen), engines=ENGINES)
