"""The `kvhandoff` command."""
