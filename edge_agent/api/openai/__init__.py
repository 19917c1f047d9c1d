"""The OpenAI dialect (/v1/*), in the shape of vLLM's: `protocol` (the bodies, and the
file, batch and page objects), `serving` (chat, completions and embeddings on a validated
body, its controls and its tenant), `routes` (the model endpoints over HTTP), and beside
them the Batch API: `batches` (the Files and Batches resources), `batch_runner` (their
lines through `serving`) and `batch_routes` (both over HTTP).
"""
