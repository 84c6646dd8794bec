"""Every default deadline and limit, in one place: the command line, the config file, the
supervisor, residency and the front all read them from here.

Figures are our choices unless a source is named.
"""

from __future__ import annotations

READY_TIMEOUT_S = 120.0
"""Seconds a worker may take from spawn to answering health (a cold 7B GGUF from a slow disk
takes tens of seconds; a timeout that large only matters for a stuck load)."""

STOP_GRACE_S = 10.0
"""Seconds a worker gets between SIGTERM and SIGKILL, and running requests between the front's
stop signal and the workers being stopped."""

DRAIN_GRACE_S = 30.0
"""Seconds an operator's unload waits for running requests before it reports them."""

ADMISSION_WAIT_S = 30.0
"""Seconds a load waits for models in use to make room before 503 ``insufficient_memory``."""

RETRY_AFTER_S = 5
"""The ``Retry-After`` of a 503 ``insufficient_memory``."""

COMPUTE_TURN_S = 0.5
"""Seconds a model computes, while another model waits, before the compute gate suspends it
and passes the turn on (a short request's wait behind a long generation, at most about this
much; measured in docs/benchmarks.md, "Head-of-line blocking across models")."""

SPARE_BYTES = 64 * 1024 * 1024
"""What a spare worker (an engine imported, no model; supervisor/launcher.py) may hold,
counted in the memory budget while it waits: one with llama.cpp's engine imported measured
41 MiB resident (xllamacpp 2026.10.11549)."""

PROBE_INTERVAL_S = 5.0
"""Seconds between liveness probes of each ready worker (also each probe's timeout)."""

PROBE_FAILURES = 2
"""Consecutive missed probes before a worker is replaced."""

GENERATION_FAILURES = 3
"""Consecutive failed requests (5xx, broken stream) before a worker is replaced."""

MAX_BODY_BYTES = 16 * 1024 * 1024
"""Largest request body; larger ones get 413."""

HEALTH_POLL_S = 0.05
"""How often a starting worker's health is polled while it loads."""

CONNECT_TIMEOUT_S = 5.0
"""Connecting to a worker's socket (a Unix socket connects in microseconds when it is up)."""

MAX_HEAD_BYTES = 64 * 1024
"""Largest request head (request line and headers); larger gets 431. nginx's default buffers
allow 32 KiB, Node's 16 KiB; 64 KiB leaves room for long tokens and cookies."""

MAX_HEADERS = 100
"""Most header fields in one request; more gets 431 (Apache's LimitRequestFields default)."""

BODY_TIMEOUT_S = 20.0
"""Seconds a client has to send a request body, plus one second for every BODY_MIN_RATE bytes
it has sent (Apache mod_reqtimeout's default, body=20,MinRate=500); then the connection
closes."""

BODY_MIN_RATE = 500
"""Bytes per second a slow body must keep up (see BODY_TIMEOUT_S)."""

BODY_MAX_S = 300.0
"""Seconds a client has at most to send a request body, however fast it keeps sending: the
ceiling on BODY_TIMEOUT_S's growing deadline (Apache mod_reqtimeout's ``body=20-MAX``), which
would give a 16 MiB body nine hours and a 25 MB upload fourteen while it holds its bytes of
a shared budget. Five minutes send OpenAI's largest upload (25 MB) at 0.7 Mbit/s and the
largest body (16 MiB) at 0.5 Mbit/s; then the connection closes."""

LARGE_INPUT_BYTES = 64 * 1024
"""Request bodies and prompt texts from this size on are parsed, checked and measured on a
thread, not on the event loop (a 16 MiB body takes a few hundred milliseconds of CPU)."""

BODIES_IN_FLIGHT_BYTES = 256 * 1024 * 1024
"""Request body bytes the front holds at once, all requests together; a request that would
pass it gets 503 ``server_busy`` with Retry-After (each body alone is bounded by --max-body)."""

HEAD_TIMEOUT_S = 10.0
"""Seconds a client has to send a request head, from connecting or from its last answer's end;
then 408 and the connection closes (a slowloris holds no connection longer)."""

KV_MIN_TOKENS = 256
"""Fewest tokens a slot must hold for its KV state to be saved, and a snapshot must share
with a prompt to be restored: on 2 cores the packaged Qwen prefills 256 tokens in about
1.6 s and restores them in a few milliseconds, while a shorter prefix costs little to prefill
and its file (about 12 KiB a token) would crowd the disk budget."""

KV_IDLE_FLUSH_S = 2.0
"""Seconds a slot stays idle after a request before it is saved in the background."""

KV_FLUSH_TIMEOUT_S = 20.0
"""Seconds a drain's saves of one model's slots may take together; then the worker is stopped
with the rest unsaved (reported as failed). A slot of 8,192 tokens of a 7B model is about
1 GiB: a few seconds on an ordinary SSD."""

KV_CACHE_DISK_SHARE = 0.10
"""The default snapshot budget (``--kv-cache-max``): this share of the disk space free when
the front starts, at most KV_CACHE_MAX_BYTES."""

KV_CACHE_MAX_BYTES = 32 * 1024**3
"""The default snapshot budget's ceiling."""

RESPONSES_KEEP = 10_000
"""Stored Responses API answers kept, oldest dropped first (``--responses-keep``)."""
RESPONSES_MAX_BYTES = 1024**3
"""Bytes the stored Responses API answers may take together, oldest dropped first
(``--responses-max``): 1 GiB, room for RESPONSES_KEEP answers of 100 KiB each (a conversation
is stored again with each turn), and for the largest single row: one answer to a request
at the body limit (16 MiB) echoes its ``text.format`` and tools and holds its input twice,
about 48 MiB. Rows alone are no bound: a 15.7 MB schema made a 2-token answer 15.7 MB."""
RESPONSES_MAX_AGE_S = 30 * 86400.0
"""Age at which a stored response is dropped: 30 days, as OpenAI keeps stored responses
(``--responses-days``)."""

DEFAULT_SLOT_TOKENS = 8192
"""Tokens each slot holds when no context is configured: a prompt of a few thousand tokens
with the ``max_tokens: 4096`` many clients send by default fits (the packaged models were
trained for 32,768, so 4 slots of 8,192 stay inside it)."""

MAX_AUDIO_BYTES = 25 * 1000 * 1000
"""The largest audio upload to POST /v1/audio/transcriptions, bytes: OpenAI's 25 MB."""

UPLOADS_IN_FLIGHT_BYTES = 1 << 30
"""Upload bytes held (on disk, while read and transcribed) by all requests together; one
client holds at most a share of them (bunkhouse/shares.py: a quarter, 256 MiB, ten uploads
of OpenAI's 25 MB)."""
