"""The ops interface the model and the handoff call, with torch and Triton backends."""
