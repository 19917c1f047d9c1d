"""Signed releases on the box: The Update Framework's client (`source`), a model file's
resumable, verified transfer (`transfer`), the lookup the rollout runner calls
(`signed_releases`) and `edge-agent models pull NAME@VERSION` (`pull`).

Never: install a file whose length and hashes the signed metadata does not give, or
download from a hub. Next: `protocol.manifest` for what the controller signs.
"""
