"""The paged KV pool: the security boundary between requests."""
