"""The decode service: the client-facing front door; pulls KV from prefill, verifies, generates."""
