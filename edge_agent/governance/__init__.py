"""Governance: who may call (keys, tenants), how much (rates, quotas) and how long
(context and output ceilings)."""
