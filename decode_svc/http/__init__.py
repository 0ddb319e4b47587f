"""The OpenAI-compatible HTTP front door on decode (see decode_svc.http.app)."""
