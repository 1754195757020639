"""The turn: an agent's turn (turn), its reply's MEDIA tags (reply), typing and
progress in the chat (activity), and the extraction of its files into storage
(extract, behind a circuit breaker per sandbox: breaker). Imports the ledger,
delivery, dispatch and tasks/'s base."""
