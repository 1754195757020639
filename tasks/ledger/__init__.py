"""The ledger: what courier records in Redis and reads back — jobs and delivery receipts, leases, due times,
every key, signatures, a job's event stream and the Lua scripts. It knows no delivery format (no spec's
fields, no platform) and imports no other subsystem: of tasks/ itself only the metrics, the task names, the
states and the workspace paths (tests/test_layers.py)."""
