"""Text in and out: a checkpoint's tokenizer files, the incremental detokenizer, chat
templates and stop strings."""
