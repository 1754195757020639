"""Delivery: a chat's lane driven in order (lanes), its items, albums and parts
sent once each, the send lock, the shared rate limits and pacing, and the one
decision to retry a step or give up. Imports the ledger and tasks/'s base only."""
