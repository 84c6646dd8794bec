"""Pull names and the files they choose in a repo (bunkhouse/pull/names.py): pure."""

from __future__ import annotations

import pytest

from bunkhouse.errors import InvalidRequest, ModelNotFound
from bunkhouse.pull.names import choose, hub_spellings, parse, quant_of

FILES = ["README.md", "model-Q4_K_M.gguf", "model-q8_0.gguf", "model-IQ4_XS.gguf",
         "model-F16.gguf", "mmproj-model-f16.gguf",
         "big/model-Q6_K-00001-of-00002.gguf", "big/model-Q6_K-00002-of-00002.gguf"]


@pytest.mark.parametrize(("name", "repo", "tag"), [
    ("org/repo", "org/repo", None),
    ("org/repo:Q4_K_M", "org/repo", "Q4_K_M"),
    ("hf.co/org/repo:q8_0", "org/repo", "q8_0"),
    ("huggingface.co/Org/Re.po-1_GGUF", "Org/Re.po-1_GGUF", None),
    ("  org/repo:dir/file.gguf ", "org/repo", "dir/file.gguf"),
])
def test_names_parse(name: str, repo: str, tag: str | None) -> None:
    parsed = parse(name)
    assert (parsed.repo, parsed.tag) == (repo, tag)


@pytest.mark.parametrize("name", ["", "repo", "org/", "/repo", "org/repo/extra", "../x/y",
                                  "org/re po", "org/repo:../../etc/passwd", "org/-repo",
                                  "org/re--po", 42])
def test_bad_names_are_refused_naming_the_field(name: object) -> None:
    with pytest.raises(InvalidRequest) as e:
        parse(name)  # type: ignore[arg-type]
    assert e.value.param == "model"


def test_quants_are_read_from_names_without_case() -> None:
    assert quant_of("a/model-q4_k_m.gguf") == "Q4_K_M"
    assert quant_of("model.Q8_0.gguf") == "Q8_0"
    assert quant_of("model-IQ4_XS-00001-of-00003.gguf") == "IQ4_XS"
    assert quant_of("model-bf16.gguf") == "BF16"
    assert quant_of("model.gguf") is None


def test_a_tag_chooses_its_quant_and_the_projector_comes_along() -> None:
    choice = choose("org/repo", FILES, None)  # the default: Q4_K_M
    assert choice.model == "model-Q4_K_M.gguf" and choice.quant == "Q4_K_M"
    assert choice.projector == "mmproj-model-f16.gguf"
    assert choice.files == ("model-Q4_K_M.gguf", "mmproj-model-f16.gguf")
    assert choose("org/repo", FILES, "Q8_0").model == "model-q8_0.gguf"
    assert choose("org/repo", FILES, "iq4_xs").model == "model-IQ4_XS.gguf"
    assert choose("org/repo", FILES, "model-F16.gguf").model == "model-F16.gguf"


def test_a_split_model_is_every_part() -> None:
    choice = choose("org/repo", FILES, "q6_k")
    assert choice.parts == ("big/model-Q6_K-00001-of-00002.gguf",
                            "big/model-Q6_K-00002-of-00002.gguf")
    with pytest.raises(ModelNotFound, match="misses its part"):
        choose("org/repo", [f for f in FILES if "-00002-of" not in f], "Q6_K")


def test_what_is_missing_is_refused_naming_what_the_repo_offers() -> None:
    with pytest.raises(ModelNotFound, match=r"no Q2_K quantization; its quantizations: "
                                            r"F16, IQ4_XS, Q4_K_M, Q6_K, Q8_0"):
        choose("org/repo", FILES, "Q2_K")
    with pytest.raises(ModelNotFound, match=r"no Q4_K_M quantization \(the default\); give "
                                            r"one as org/repo:QUANT; its quantizations: Q8_0"):
        choose("org/repo", ["a-q8_0.gguf", "b-Q8_0.gguf"], None)
    with pytest.raises(ModelNotFound, match="has no GGUF model"):
        choose("org/repo", ["README.md", "model.safetensors"], None)
    with pytest.raises(ModelNotFound, match=r"no model file 'x\.gguf'"):
        choose("org/repo", FILES, "x.gguf")
    with pytest.raises(ModelNotFound, match="a later part of a split model: name its first"):
        choose("org/repo", FILES, "big/model-Q6_K-00002-of-00002.gguf")
    assert choose("org/repo", ["only.gguf"], None).model == "only.gguf"  # its only model


def test_the_names_a_pull_answers_to() -> None:
    assert parse("hf.co/org/repo").names("Org/Repo", "Q4_K_M") == (
        "Org/Repo:Q4_K_M", "hf.co/Org/Repo:Q4_K_M", "Org/Repo", "hf.co/Org/Repo")
    assert parse("org/repo:q8_0").names("org/repo", "Q8_0") == (
        "org/repo:Q8_0", "hf.co/org/repo:Q8_0")


def test_the_spellings_a_catalog_looks_a_hub_name_up_by() -> None:
    assert hub_spellings("hf.co/org/repo:q4_k_m") == (
        "org/repo:q4_k_m", "org/repo:Q4_K_M", "hf.co/org/repo:Q4_K_M")
    assert hub_spellings("huggingface.co/org/repo") == ("org/repo",)
    assert "org/repo:m-q4_0" in hub_spellings("org/repo:m-q4_0.gguf")
    assert hub_spellings("gemma3:270m") == hub_spellings("qwen") == ()
