"""What a box tells the fleet on its own: `metrics`, `ledger` summaries and `events`.

Owns: the sync loop (`sync`), counter deltas and hardware figures (`summaries`), the
ledger's summaries (`ledger_summary`) and the last screen before the outbox (`privacy`).

Never: a prompt, an answer, a redaction's value or any text a customer typed — only
names, ids and numbers leave the box. Next: `link.outbox`, where each body goes.
"""
