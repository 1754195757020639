"""The turn: an agent's turn (turn), its reply's MEDIA tags (reply), typing and progress in the
chat (activity), the extraction of its files (extract, behind a breaker per sandbox: breaker)."""
