"""What both services share at run time: model bring-up, the gRPC server, stats, shutdown."""
