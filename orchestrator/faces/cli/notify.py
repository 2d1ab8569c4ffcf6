"""`autoresearch notify test` (filled in below)."""
