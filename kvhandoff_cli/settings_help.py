"""The help text of every service setting (kvhandoff_cli/settings.py makes the flags): one
line per field of ServiceConfig (SERVICE_HELP) and of PrefillConfig / DecodeConfig (ROLE_HELP)."""

from __future__ import annotations

SERVICE_HELP = {
    "model": "'demo' or a Hugging Face checkpoint directory (Llama, Mistral, Qwen2, Qwen3)",
    "host": "address to bind",
    "port": "gRPC port (0 picks a free one; prefill 50061, decode 50051 by default)",
    "device": "auto, cpu, cuda or cuda:N", "dtype": "auto, float32, float16, bfloat16",
    "kernels": "auto (triton on CUDA, cpu on CPU), triton, cpu or torch (reference)",
    "page_size": "tokens per KV page",
    "pool_tokens": "KV pool size in tokens (0: size from --memory-fraction/--kv-cache-bytes)",
    "memory_fraction": "share of free device memory (or of --kv-cache-bytes on the CPU) for KV",
    "kv_cache_bytes": "KV byte budget on the CPU",
    "max_context_tokens": "context window (0: the model's max_position_embeddings)",
    "allow_context_beyond_pool": "start even if the pool is smaller than the window; the pool "
                                 "then bounds prompts",
    "poison_freed_pages": "fill freed pages with NaN (tests)",
    "scrub_freed_pages": "zero freed pages",
    "check_page_owners": "check every batch's page table against page owners before each step",
    "metrics_port": "Prometheus /metrics port (-1: off, 0: any free port)",
    "tls_cert": "PEM certificate for the prefill<->decode channel (mTLS)",
    "tls_key": "PEM key for --tls-cert", "tls_ca": "PEM CA that signs the peers' certificates",
    "grace_seconds": "drain time on SIGTERM: in-flight requests get this long to finish",
    "allow_protocol_1_0": "accept prefills that speak protocol 1.0 (no nonce, prompt digest or "
                          "frame checksums); logged at start and counted per handoff",
    "content_checks": "check the KV content of every handoff before streaming (layer 0, depth, "
                      "finiteness); --no-content-checks is for benchmarks of their cost only",
    "verify_depth_positions": "random prompt positions decode recomputes through every layer, "
                              "besides the last one",
    "verify_full_fraction": "share of handoffs (0 to 1, drawn unguessably per handoff) for which "
                            "decode recomputes the whole prompt and compares every layer at every "
                            "position (SPEC.md D-49); costs one prefill of the prompt on decode",
    "torch_threads": "torch intra-op threads (0: one per CPU of --cpu-affinity, else torch's "
                     "default)",
    "cpu_affinity": "CPUs the service runs on, e.g. 0-3,6 (empty: the ones it was started with)",
    "borrow_cpus": "the peer service's CPUs this one also computes on while the peer idles, "
                   "e.g. 0 (needs --cpu-affinity and --busy-file; kvhandoff up sets both)",
    "borrow_min_tokens": "prefill: the shortest pass that borrows decode's CPUs (decode then "
                         "checks that handoff's content after the commit, not beside the pass)",
    "busy_file": "lock file shared by a prefill and a decode on one host: decode holds it while "
                 "it computes, prefill borrows decode's CPUs only when it is free",
}
ROLE_HELP = {
    "shm_dir": "directory of the shared-memory regions (a tmpfs both services see)",
    "allow_planes_without_tls": "with TLS configured, still allow data planes whose bytes "
                                "bypass the channel's TLS (shared memory, NIXL)",
    "shared_memory": "offer the shared-memory data plane to decodes on this host",
    "release_grace_s": "seconds out-of-band KV bytes outlive their stream when decode never "
                       "releases them",
    "nixl": "offer the NIXL data plane (decode READs the KV from prefill's NIXL agent)",
    "nixl_read_timeout_s": "seconds one NIXL READ of a chunk may take before it is refused",
    "nixl_from_pages": "serve NIXL handoffs of a host-memory pool straight from the KV pages "
                       "(held until decode releases them) instead of a packed buffer; the "
                       "handoff's slots not yet written are zeroed before they are registered, "
                       "so the peer reads only zeros or this request's KV (SPEC P-68a)",
    "nixl_lease_max_pages": "the most KV pages NIXL handoffs served from the pages may hold at "
                            "once (0: half the pool); past it a handoff is packed",
    "nixl_lease_max_handoffs": "the most NIXL handoffs served from the pages at once; past it "
                               "a handoff is packed",
    "data_plane": "how KV travels from prefill: inline, shared-memory, nixl, or auto (the "
                  "fastest both sides offer, else inline)",
    "max_batch_tokens": "prompt tokens in one prefill forward pass (all prompts in it); the "
                        "activation peak measured at start-up is a pass of this many",
    "prefill_chunk_tokens": "chunked prefill: the most tokens of one prompt a forward pass "
                            "computes; longer prompts take several passes",
    "prefix_cache": "keep whole pages of prompt KV for later requests of the same cache scope "
                    "(the caller's identity and cache_salt; a request with neither shares "
                    "with nobody)",
    "prefix_cache_max_pages": "the most pool pages the prefix cache may hold (0: as many as "
                              "the pool has; unread cached pages count as free)",
    "max_unsent_bytes": "KV bytes packed but not yet sent, over all streams; a slow decode "
                        "pauses its prefill beyond this",
    "prefill_target": "prefill replicas HOST:PORT[,HOST:PORT...]; a DNS name stands for "
                      "every address it resolves to (re-resolved), one replica each",
    "prefill_choice": "how decode picks a prefill replica per request: prefix (the same "
                      "scope and first page go to the same replica, unless it is busy) or "
                      "round-robin",
    "prefill_busy_slack": "handoffs in flight beyond the least loaded replica's at which a "
                          "request's favourite replica counts as busy",
    "http_slow_reader_s": "seconds an HTTP stream may wait for its client to read before "
                          "it is cancelled and its pages freed",
    "http_stream_buffer_bytes": "bytes of an HTTP stream decode may hold for a client that "
                                "reads slowly (socket send buffer and write buffer) before "
                                "generation waits for it",
    "handoff_retries": "times a handoff that failed before any token was sent is asked "
                       "again on another prefill replica",
    "max_batch": "sequences in the running decode batch",
    "max_waiting": "requests waiting for pages or a batch slot before ADMISSION_QUEUE_FULL",
    "default_max_tokens": "max_tokens of a request that sets none",
    "handoff_timeout_s": "seconds a handoff from prefill may take",
    "max_chunk_bytes": "largest KV chunk decode accepts from prefill",
    "prefill_info_interval_s": "seconds between decode's checks of prefill's model, layout "
                               "and limits",
    "api_token": "bearer token clients must send (empty: none; redacted by config show)",
    "api_tokens": "file of 'TENANT TOKEN' lines: the tokens clients may send and the "
                  "tenant each names (reloaded on SIGHUP; not with --api-token)",
    "api_tls_cert": "PEM certificate for the client API (TLS)",
    "api_tls_key": "PEM key for --api-tls-cert",
    "http_port": "OpenAI-compatible HTTP API port: /v1/models, /v1/completions, "
                 "/v1/chat/completions, /health, /metrics (-1: off, 0: any free port)",
    "local_prefill": "compute prompts' KV in this process instead of asking prefill "
                     "(a baseline for benchmarks)",
    "local_prefill_max_tokens": "prompts of at most this many tokens are prefilled by decode "
                                "itself when it is idle, with no handoff (conditional "
                                "disaggregation; 0: every prompt goes to prefill)",
    "local_prefill_burst_tokens": "with --local-prefill-max-tokens: the most prompt tokens "
                                  "decode prefills itself at once when short prompts arrive "
                                  "together at an idle decode; the rest go to prefill, which "
                                  "computes them meanwhile (0: as many as "
                                  "--local-prefill-max-tokens; at most one of decode's passes)",
    "local_prefill_queue_depth": "when this many of decode's prompts wait for prefill, decode "
                                 "prefills the next one itself, of any length it can, in "
                                 "chunks between its decode steps, one such prompt at a time "
                                 "(0: never)",
    "local_prefill_chunk_tokens": "the chunk of a prompt --local-prefill-queue-depth gives "
                                  "decode: prompt tokens per pass between two decode steps",
}
