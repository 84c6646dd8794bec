"""The llama.cpp engine: xllamacpp's embedded llama-server, listening on the worker's socket."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import xllamacpp

from bunkhouse.engines import llamacpp_spec as spec
from bunkhouse.engines.llamacpp import EMBEDDING_BATCH, LlamaCppOptions, parse_options
from bunkhouse.engines.options import decode
from bunkhouse.worker.engine import EngineLoadError, WorkerConfig

log = logging.getLogger(__name__)

TRIAL_TIMEOUT_S = 60
"""The longest a trial load of the model with some adapters may take (a load of the
packaged Qwen takes about a second here, ten on a loaded machine)."""


def build_params(config: WorkerConfig, socket: Path | None = None) -> Any:
    """Engine parameters, every memory-relevant one set explicitly.

    xllamacpp's defaults (the model's full trained context, one slot, an 8 GiB RAM prompt
    cache) would wreck a memory budget.
    """
    own = decode(config.engine_options, parse_options)
    params = xllamacpp.CommonParams()
    params.model.path = str(config.model_path)
    params.model_alias = {config.model_id}
    params.hostnames = [str(socket or config.socket)]  # a path ending in .sock: a Unix socket
    params.n_ctx = config.context  # total context, shared by the slots
    params.n_parallel = config.parallel
    params.cont_batching = True
    # With embeddings on, llama.cpp lowers n_batch to n_ubatch anyway (and warns): say so.
    params.n_batch = EMBEDDING_BATCH
    params.n_ubatch = EMBEDDING_BATCH  # residency.estimate assumes it (SWA cache size)
    params.kv_unified = False  # each slot owns context / parallel tokens: predictable KV need
    params.swa_full = own.swa_full  # the estimate counts it (engines/llamacpp.py)
    params.cache_ram_mib = own.cache_ram_mib
    params.cpuparams.n_threads = own.threads
    params.cpuparams_batch.n_threads = own.threads
    if config.embeddings:  # /v1/embeddings next to generation
        params.embedding = True
        pooling = xllamacpp.llama_pooling_type
        # unspecified: llama.cpp takes the GGUF's own pooling type (CLS for a BERT-style
        # model, which mean pooling would make wrong)
        params.pooling_type = (pooling.LLAMA_POOLING_TYPE_UNSPECIFIED
                               if config.pooling == "model" else pooling.LLAMA_POOLING_TYPE_MEAN)
    if config.snapshot_dir is not None:
        # llama.cpp joins this and a file name without a separator (its own flag adds it)
        params.slot_save_path = f"{config.snapshot_dir}/"
    params.endpoint_metrics = True
    params.endpoint_slots = True
    params.n_threads_http = max(2, config.parallel + 1)
    if config.chat_template:
        _set_template(params, config.chat_template)
    _set_kv_and_speculation(params, own, config.draft)
    if config.adapters:
        # every adapter at 0 until a request sets the scales (the front always sends them all)
        params.lora_adapters = [xllamacpp.CommonAdapterLoraInfo(str(p), 0.0)
                                for p in config.adapters]
        params.lora_init_without_apply = True
    return params


_SPEC = xllamacpp.common_speculative_type
_KINDS = {spec.NGRAM: _SPEC.COMMON_SPECULATIVE_TYPE_NGRAM_MOD,
          spec.DRAFT: _SPEC.COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE,
          spec.MTP: _SPEC.COMMON_SPECULATIVE_TYPE_DRAFT_MTP}
_FLASH = {"auto": xllamacpp.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_AUTO,
          True: xllamacpp.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_ENABLED,
          False: xllamacpp.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_DISABLED}


def _cache_type(name: str) -> Any:
    return getattr(xllamacpp.ggml_type, f"GGML_TYPE_{name.upper()}")


def _set_kv_and_speculation(params: Any, own: LlamaCppOptions, draft: Path | None) -> None:
    """The KV cache types, flash attention and speculative decoding (engines/
    llamacpp_spec.py). The speculative type is always set with its model: llama.cpp given a
    draft model without one loads it and never drafts."""
    params.cache_type_k = _cache_type(own.cache_type_k)
    params.cache_type_v = _cache_type(own.cache_type_v)
    params.flash_attn_type = _FLASH[own.flash_attention]
    s = own.speculation
    if s.kind is None:
        return
    if s.kind == spec.DRAFT and draft is None:
        raise EngineLoadError("a draft model is configured but none was given (--draft)")
    params.speculative.types = [_KINDS[s.kind]]
    if s.kind == spec.NGRAM:
        params.speculative.ngram_mod.n_max = s.draft_max
        params.speculative.ngram_mod.n_min = s.draft_min
        return
    params.speculative.draft.n_max = s.draft_max
    params.speculative.draft.n_min = s.draft_min
    if s.kind == spec.MTP:
        params.load_mtp = True
        return
    params.speculative.draft.mparams.path = str(draft)
    params.speculative.draft.cache_type_k = params.cache_type_k
    params.speculative.draft.cache_type_v = params.cache_type_v
    params.speculative.draft.cpuparams.n_threads = own.threads
    params.speculative.draft.cpuparams_batch.n_threads = own.threads


def _set_template(params: Any, value: str) -> None:
    """A configured chat template: a .jinja file's text (rendered by llama.cpp's Jinja engine),
    or the name of one of llama.cpp's built-in templates (``chatml``, ``gemma``, ``llama3``
    ...), which only its non-Jinja path knows by name."""
    path = Path(value)
    if not path.is_absolute():
        params.use_jinja = False
        params.chat_template = value
        return
    try:
        params.chat_template = path.read_text(encoding="utf-8")
    except OSError as e:
        raise EngineLoadError(f"cannot read chat template {path}: {e.strerror}") from e


_FD = "/proc/self/fd/"


def _model_fds(path: Path) -> tuple[int, ...]:
    """The descriptors a child needs to open the model at ``path`` as this process does:
    the front hands a worker its model as ``/proc/self/fd/N``, or a split model as a folder
    of links to such paths (supervisor/process.py ``open_model_file``)."""
    text = str(path)
    if text.startswith(_FD):
        targets = [text]
    elif path.is_dir():
        targets = [os.readlink(p) for p in path.iterdir() if p.is_symlink()]
    else:
        return ()
    return tuple(int(t[len(_FD):].split("/")[0]) for t in targets if t.startswith(_FD))


class LlamaCppEngine:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self._server: Any = None

    def start(self) -> None:
        if not self.config.model_path.is_file():
            raise EngineLoadError(f"model file not found: {self.config.model_path}")
        # A configured chat template is checked before the socket appears where the front
        # looks for it: the server listens on a staging path until then.
        final = self.config.socket
        staging = final.with_name(f"{final.stem}t.sock") if self.config.chat_template else final
        staging.unlink(missing_ok=True)
        try:
            self._server = xllamacpp.Server(build_params(self.config, staging))
        except Exception as e:
            if not self.config.adapters:
                raise self._load_error(e) from e
            self._server = self._without_bad_adapters(staging, e)
        if self.config.chat_template:
            try:
                self._check_template(self.config.chat_template, staging)
            except EngineLoadError:
                staging.unlink(missing_ok=True)
                raise
            os.replace(staging, final)

    def _load_error(self, e: Exception) -> EngineLoadError:
        hint = (f" (the configured chat template {self.config.chat_template!r} may be the "
                "cause: look for a parser error above)" if self.config.chat_template else "")
        return EngineLoadError(f"llama.cpp failed to load {self.config.model_path}: {e}{hint}")

    def _without_bad_adapters(self, socket: Path, first: Exception) -> Any:
        """The engine failed with adapters: the base alone, then each adapter added to those
        that loaded, each tried in a child process (llamacpp_trial.py) on a socket nobody
        reaches, so that a bad adapter file costs its own requests and no one else's (the
        front learns which mounted from ``/lora-adapters``). The base failing alone is the
        model's own load failure."""
        scratch = socket.with_name(f"{socket.stem}x.sock")
        if not self._mounts((), scratch):
            raise self._load_error(first) from first
        good: list[Path] = []
        for path in self.config.adapters:
            if self._mounts((*good, path), scratch):
                good.append(path)
            else:
                log.error("model %s: adapter %s not mounted: llama.cpp refused it (its lines "
                          "above say why); its requests fail, the base and its other adapters "
                          "serve", self.config.model_id, path)
        socket.unlink(missing_ok=True)
        return xllamacpp.Server(build_params(dataclasses.replace(
            self.config, adapters=tuple(good)), socket))

    def _mounts(self, adapters: tuple[Path, ...], socket: Path) -> bool:
        """Whether the engine loads the model with ``adapters`` (a child process's answer,
        within the trial's deadline)."""
        argv = [sys.executable, "-m", "bunkhouse.worker.engines.llamacpp_trial",
                str(self.config.model_path), str(socket), *map(str, adapters)]
        try:
            return subprocess.run(argv, timeout=TRIAL_TIMEOUT_S, check=False,
                                  pass_fds=_model_fds(self.config.model_path)).returncode == 0
        except subprocess.TimeoutExpired:
            log.error("model %s: a trial load took more than %d s", self.config.model_id,
                      TRIAL_TIMEOUT_S)
            return False

    def _check_template(self, template: str, socket: Path) -> None:
        """Render one message, so that a template name llama.cpp does not know fails the load
        (the engine accepts any name and fails at the first chat otherwise)."""
        transport = httpx.HTTPTransport(uds=str(socket), retries=20)
        with httpx.Client(transport=transport, base_url="http://worker", timeout=30) as client:
            resp = client.post("/apply-template",
                               json={"messages": [{"role": "user", "content": "hi"}]})
        if resp.status_code != 200:
            raise EngineLoadError(
                f"chat template {template!r} does not render: {resp.text[:300]}; use a name "
                "llama.cpp knows (chatml, gemma, llama3, mistral-v7, phi4, ...) or a .jinja file")

    def stop(self) -> None:
        self._server = None
