"""Generated protobuf and gRPC stubs (scripts/gen_protos.py); never edit by hand."""
