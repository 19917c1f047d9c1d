"""Governance: who may call (`keys`: API keys, stored as hashes; `tenants`: scopes,
rates, quotas, context and output ceilings) and what is kept of what they sent
(`redaction`: detectors, the redaction log, metadata scrubbing).

Never: the request path or the engine's internals — the gateway asks, this answers.
Next: `gateway.service` applies it per request.
"""
