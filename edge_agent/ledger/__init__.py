"""The request ledger: one row per request, in SQLite (`store`, its migrations), written
off the hot path in batches (`writer`), read back as reports (`report`), purged by
retention (`retention`), and the rollouts' release evidence (`evidence`).

Never: a write on the request's own thread, or content kept past its retention. Next:
`writer.LedgerWriter`.
"""
