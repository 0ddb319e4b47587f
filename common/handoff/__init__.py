"""The kvhandoff.v1 handoff: frame codec, dtype mapping, refusal reasons and the verifier."""
