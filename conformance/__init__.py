"""The kvhandoff.v1 conformance suite: checks a prefill or a decode implementation against
protos/kvhandoff/v1/SPEC.md over the wire. It imports only the generated stubs (common/pb), gRPC
and its own code, never our services' internals, so it judges ours like any other peer."""
