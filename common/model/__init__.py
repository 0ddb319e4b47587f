"""The Llama-family decoder, its checkpoint loader, the demo model and the model fingerprint."""
