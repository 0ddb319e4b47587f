"""Service configuration: one frozen dataclass per role, built once at start and passed down.

Values measured at start (pool pages, effective limits) live in `Capacity`, never here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads only when a device or dtype is asked for: `kvhandoff prefill
    import torch   # --help` and the CLI's checks of its flags run without it (seconds faster)


@dataclass(frozen=True)
class ServiceConfig:
    """Settings shared by both services. pool_tokens of 0 means: size the pool from memory."""

    model: str = "demo"
    host: str = "127.0.0.1"
    port: int = 0
    device: str = "auto"
    dtype: str = "auto"
    kernels: str = "auto"
    page_size: int = 16
    pool_tokens: int = 65536
    memory_fraction: float = 0.0
    kv_cache_bytes: int = 0
    max_context_tokens: int = 0
    allow_context_beyond_pool: bool = False
    poison_freed_pages: bool = False
    scrub_freed_pages: bool = False
    check_page_owners: bool = False
    metrics_port: int = -1
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    grace_seconds: float = 5.0
    # data planes (SPEC.md section 10): where shared-memory regions live, and whether planes that
    # bypass the channel's TLS may be used when TLS is configured
    shm_dir: str = "/dev/shm"
    allow_planes_without_tls: bool = False
    # CPU placement (common/server/cpu_placement.py): torch's intra-op threads (0: one per CPU
    # of cpu_affinity, else torch's default) and the CPUs the process runs on ("": unchanged)
    torch_threads: int = 0
    cpu_affinity: str = ""
    # core borrowing (common/server/core_borrowing.py): the peer's CPUs this service may also
    # use while the peer idles, and the lock file of the pair (decode holds it while it computes)
    borrow_cpus: str = ""
    busy_file: str = ""
    borrow_min_tokens: int = 512  # prefill: the shortest pass that borrows

    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        names = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
        if self.dtype not in names:
            raise ValueError(f"dtype {self.dtype!r}: choose auto, {', '.join(names)}")
        return names[self.dtype]


# Chunked prefill: the most tokens of one prompt a forward pass computes. 2048 keeps a GPU's
# matmuls large (a 2k x hidden GEMM is compute-bound on every current part); >= max_batch_tokens
# gives one prompt a whole pass.
DEFAULT_PREFILL_CHUNK_TOKENS = 2048
# The pass budget (--max-batch-tokens), all prompts of a pass together. 2048, vLLM's default for
# its CPU and OpenAI-server engines: eight waiting 1024-token prompts then finish two by two
# instead of all at the end of one 8192-token pass (TTFT p50 5/8 of it), and on the CPU the
# smaller pass is also cheaper per token (its activations stay in cache): 8 x 1024 tokens on
# the bench checkpoint, 1 thread, thread CPU time, 1.08-1.18x against 8192
# (bench/prefill_pass_profile.py, docs/benchmarks.md).
DEFAULT_MAX_BATCH_TOKENS = 2048


@dataclass(frozen=True)
class PrefillConfig:
    service: ServiceConfig
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS
    max_unsent_bytes: int = 512 << 20
    shared_memory: bool = True  # offer the shared-memory plane (same host only)
    release_grace_s: float = 5.0  # how long out-of-band bytes outlive their stream unreleased
    prefix_cache: bool = True  # keep whole prompt pages for later requests of the same scope
    prefix_cache_max_pages: int = 0  # the most pages the cache may own (0: the whole pool)
    nixl: bool = True  # offer the NIXL plane (when the nixl-cu12 wheel loads and TLS allows)
    # NIXL handoffs of a CPU pool READ straight from the pages, held until released (P-68)
    nixl_from_pages: bool = True
    nixl_lease_max_pages: int = 0  # the most pages such handoffs hold at once (0: half the pool)
    nixl_lease_max_handoffs: int = 64


@dataclass(frozen=True)
class DecodeConfig:
    service: ServiceConfig
    prefill_target: str = "127.0.0.1:50061"
    max_batch: int = 64
    max_waiting: int = 256
    default_max_tokens: int = 256
    handoff_timeout_s: float = 60.0
    max_chunk_bytes: int = 4 << 20
    prefill_info_interval_s: float = 5.0
    api_token: str = ""
    api_tokens: str = ""  # a file of `TENANT TOKEN` lines (common/server/tenants.py)
    api_tls_cert: str = ""
    api_tls_key: str = ""
    http_port: int = -1  # the OpenAI-compatible HTTP API (decode_svc/http): -1 off, 0 any free
    local_prefill: bool = False
    # prompts of at most this many tokens decode prefills itself while idle (0: never;
    # decode_svc/conditional_prefill.py)
    local_prefill_max_tokens: int = 0
    # the prompt tokens decode may be prefilling itself at once, a burst's share (0: as many as
    # local_prefill_max_tokens)
    local_prefill_burst_tokens: int = 0
    # with this many of decode's prompts waiting for prefill, decode prefills the next one
    # itself, in chunks between its steps (0: never; decode_svc/conditional_prefill.py)
    local_prefill_queue_depth: int = 0
    local_prefill_chunk_tokens: int = 256  # the chunks of those prompts
    allow_protocol_1_0: bool = False
    content_checks: bool = True
    verify_depth_positions: int = 4
    verify_full_fraction: float = 0.0  # share of handoffs decode recomputes in full (D-49)
    data_plane: str = "inline"  # inline, shared-memory, nixl, or auto (the fastest both offer)
    nixl_read_timeout_s: float = 5.0  # a NIXL READ of one chunk not done by then is refused
    prefill_choice: str = "prefix"  # prefix (rendezvous + load) or round-robin (prefill_choice.py)
    prefill_busy_slack: int = 4  # the favourite is busy at this many more in flight than the least
    handoff_retries: int = 2  # retries of a failed handoff on other replicas, before any token
    http_slow_reader_s: float = 30.0  # an HTTP stream whose client reads nothing this long ends
    http_stream_buffer_bytes: int = 256 << 10  # bytes a slow HTTP stream may queue in decode
