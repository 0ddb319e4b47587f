"""The prefill service: computes a prompt's KV cache and streams it to decode (kvhandoff.v1)."""
