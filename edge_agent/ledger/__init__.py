"""The request ledger: one row per request, in SQLite, written off the hot path."""
