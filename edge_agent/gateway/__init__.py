"""The request path between the HTTP dialects and the engine.

Policy (scope, quotas, ceilings, truncation), redaction, the ledger record, metrics and
deadlines live here, over the engine's narrow interface (a loaded model's tokenizer,
context size and template; submit a job; read its events). The engine knows nothing of
tenants, the ledger or metrics; the dialects know nothing of policy.

Where a request runs is decided here too (`routing`): on the box, or on an upstream
(`upstream`: one OpenAI-compatible server, its breaker and its bounds) within the tenant's
egress (`egress`: personal data as placeholders and back). An upstream's answer arrives as
the engine's events, so the dialects write it as they write a local one. An app's verdict
on an answer, after it, is kept on the request's ledger row and counted (`feedback`).
"""
