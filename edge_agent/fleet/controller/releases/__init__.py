"""The controller's release repository: The Update Framework's metadata (`repository`),
its signing keys (`signing_keys`) and the HTTP server that hands metadata and model files to boxes
(`artifacts`); whether a release carries what its stage asks (`readiness`), and its
evaluation files summarised into its materials (`evaluation`).

Never: a key in the repository's served folder. Next: `device.release.source`, the box's
client of what this publishes.
"""
