"""The request path between the HTTP dialects and the engine.

Policy (scope, quotas, ceilings, truncation), redaction, the ledger record, metrics and
deadlines live here, over the engine's narrow interface (a loaded model's tokenizer,
context size and template; submit a job; read its events). The engine knows nothing of
tenants, the ledger or metrics; the dialects know nothing of policy.
"""
