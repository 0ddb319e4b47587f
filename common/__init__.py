"""Shared pieces of kvhandoff: protocol stubs, model, KV pool, ops, handoff codec and verifier."""
