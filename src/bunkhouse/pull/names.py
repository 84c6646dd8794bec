"""What a pull names and which of a repo's files it means. Pure: no I/O.

A name is ``ORG/REPO[:TAG]``, also spelled as Ollama spells hub models
(``hf.co/ORG/REPO:TAG``, ``huggingface.co/...``). The tag is a quantization (``Q4_K_M``,
``q8_0``, ``IQ4_XS``, ``F16``: compared without case, as llama-server's ``-hf`` compares it),
a file's path in the repo ending in ``.gguf``, or nothing: then :data:`DEFAULT_QUANT`, or the
repo's only model, or a refusal that lists the quantizations the repo offers. A split model
(``NAME-00001-of-00003.gguf``) is all of its parts; a vision projector (a ``.gguf`` file
with ``mmproj`` in its name) in the repo comes with the model (the one in the model's own
folder first, then the first by name).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from bunkhouse.errors import InvalidRequest, ModelNotFound

DEFAULT_QUANT = "Q4_K_M"
"""The quantization a name without a tag means: Ollama's and llama-server's default."""

_HOSTS = ("hf.co/", "huggingface.co/", "https://huggingface.co/", "https://hf.co/")
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_REPO_RE = re.compile(rf"{_PART}/{_PART}")  # the hub's own rule, less its rarer corners
_SHARD_RE = re.compile(r"-(\d{5})-of-(\d{5})$")
_QUANT_RE = re.compile(r"(?:^|[-._])((?:I?Q\d+(?:_[A-Z0-9]+)*)|BF16|F16|F32|FP16|MXFP4(?:_MOE)?)$",
                       re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class PullName:
    """A parsed pull name: the repo as typed, and the tag (None: none given)."""

    repo: str
    tag: str | None

    @property
    def text(self) -> str:
        return f"{self.repo}:{self.tag}" if self.tag else self.repo

    def names(self, repo: str, quant: str | None) -> tuple[str, ...]:
        """The names a model pulled by this name answers to, with ``repo`` as the hub
        spells it: ``ORG/REPO:QUANT`` and Ollama's ``hf.co/ORG/REPO:QUANT`` (and both without
        the tag for the default quantization, as Ollama names it)."""
        tag = quant or self.tag
        if tag is None:
            return (repo, f"hf.co/{repo}")
        names = [f"{repo}:{tag}", f"hf.co/{repo}:{tag}"]
        if self.tag is None or (quant or "").upper() == DEFAULT_QUANT:
            names += [repo, f"hf.co/{repo}"]
        return tuple(names)


def _without_host(name: str) -> str:
    """``name`` stripped, less a hub host Ollama's users type (``hf.co/``...)."""
    text = name.strip()
    for host in _HOSTS:
        if text.lower().startswith(host):
            return text[len(host):]
    return text


def hub_spellings(name: str) -> tuple[str, ...]:
    """Other spellings of a name a model may have been pulled by, as the catalog looks them
    up: without the hub's host (``hf.co/``, ``huggingface.co/``), the tag in upper case (a
    quantization), and a file tag without ``.gguf`` (the id the hub cache gives it).
    Nothing for a name that is no pull name."""
    repo, _, tag = _without_host(name).partition(":")
    if not _REPO_RE.fullmatch(repo):
        return ()
    if not tag:
        return (repo,) if repo != name else ()
    out = [f"{repo}:{tag}", f"{repo}:{tag.upper()}", f"hf.co/{repo}:{tag.upper()}"]
    if tag.endswith(".gguf"):
        stem = _SHARD_RE.sub("", tag.removesuffix(".gguf"))
        out.append(f"{repo}:{stem}")
    return tuple(dict.fromkeys(n for n in out if n != name))


def parse(name: str, param: str = "model") -> PullName:
    """``name`` as a pull name; InvalidRequest naming ``param`` if it is not one."""
    if not isinstance(name, str) or not name.strip():
        raise InvalidRequest("give a Hugging Face repo to pull, as ORG/REPO[:QUANT]",
                             param=param)
    repo, _, tag = _without_host(name).partition(":")
    if not _REPO_RE.fullmatch(repo) or ".." in repo or "--" in repo:
        shown = name if len(name) <= 200 else f"{name[:200]}..."
        raise InvalidRequest(f"{shown!r} is not a Hugging Face repo name; give ORG/REPO"
                             "[:QUANT], e.g. Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF:Q4_K_M",
                             param=param)
    if tag and (tag != tag.strip() or "\\" in tag or tag.startswith("/") or ".." in tag.split("/")
                or len(tag) > 500):
        raise InvalidRequest(f"{tag!r} is not a quantization or a file in the repo",
                             param=param)
    return PullName(repo, tag or None)


def quant_of(filename: str) -> str | None:
    """The quantization a GGUF file's name ends with, upper case (``...-q4_k_m.gguf``:
    ``Q4_K_M``); None when its name has none."""
    stem = filename.rsplit("/", 1)[-1].removesuffix(".gguf")
    stem = _SHARD_RE.sub("", stem)
    found = _QUANT_RE.search(stem)
    return found.group(1).upper() if found else None


def is_projector(filename: str) -> bool:
    return "mmproj" in filename.rsplit("/", 1)[-1].lower()


@dataclass(frozen=True, slots=True)
class Choice:
    """The files a pull downloads: the model's (a split model's parts in order) and its
    projector; ``quant``: the model's quantization, None when its name has none."""

    model: str  # its first file, as a path in the repo
    parts: tuple[str, ...]
    projector: str | None
    quant: str | None

    @property
    def files(self) -> tuple[str, ...]:
        return (*self.parts, self.projector) if self.projector else self.parts


def choose(repo: str, files: Iterable[str], tag: str | None) -> Choice:
    """The model ``tag`` means among the repo's ``files`` (paths in the repo). Raises
    ModelNotFound naming what the repo offers: no GGUF model, no such quantization or file,
    a split model with parts missing."""
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    models = [f for f in ggufs if not is_projector(f) and _first_part(f)]
    if not models:
        raise ModelNotFound(f"the repo {repo} has no GGUF model", param="model")
    if tag is not None and tag.endswith(".gguf"):
        chosen = [f for f in models if f == tag]
        if not chosen and tag in ggufs and not is_projector(tag):
            raise ModelNotFound(f"{tag} is a later part of a split model: name its first "
                                "part (...-00001-of-...), which brings every part",
                                param="model")
        if not chosen:
            raise ModelNotFound(f"the repo {repo} has no model file {tag!r}; its GGUF models: "
                                f"{_listed(models)}", param="model")
    else:
        wanted = (tag or DEFAULT_QUANT).upper()
        chosen = [f for f in models if quant_of(f) == wanted]
        if not chosen and tag is None and len(models) == 1:
            chosen = models
        if not chosen:
            quants = sorted({q for f in models if (q := quant_of(f)) is not None})
            offers = f"its quantizations: {', '.join(quants)}" if quants else \
                f"its GGUF models: {_listed(models)}"
            what = f"no {wanted} quantization" if tag else \
                f"no {DEFAULT_QUANT} quantization (the default); give one as {repo}:QUANT"
            raise ModelNotFound(f"the repo {repo} has {what}; {offers}", param="model")
    model = chosen[0]
    parts = _parts(model, ggufs)
    folder = model.rpartition("/")[0]
    projectors = sorted((f.rpartition("/")[0] != folder, f) for f in ggufs if is_projector(f))
    return Choice(model, parts, projectors[0][1] if projectors else None, quant_of(model))


def _first_part(filename: str) -> bool:
    shard = _SHARD_RE.search(filename.removesuffix(".gguf"))
    return shard is None or int(shard.group(1)) == 1


def _parts(model: str, ggufs: list[str]) -> tuple[str, ...]:
    stem = model.removesuffix(".gguf")
    shard = _SHARD_RE.search(stem)
    if shard is None:
        return (model,)
    count = int(shard.group(2))
    base = stem[: shard.start()]
    parts = tuple(f"{base}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1))
    missing = [p for p in parts if p not in ggufs]
    if missing:
        raise ModelNotFound(f"the split model {model} misses its part(s) "
                            f"{_listed(missing)} in the repo", param="model")
    return parts


def _listed(names: list[str], most: int = 12) -> str:
    shown = ", ".join(names[:most])
    return f"{shown} and {len(names) - most} more" if len(names) > most else shown
