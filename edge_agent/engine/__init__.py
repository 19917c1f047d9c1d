"""The engine: models on disk, llama.cpp running them, and every request's tokens.

Its rooms, from the bottom up (import-linter holds the order; a room imports only those
below it):

- `request`: what a generation or embedding request is, as the engine takes it;
- `models/`: the model store (catalog, installed versions, the active pointer, GGUF probe);
- `text/`: chat templates and the text stream a client reads;
- `runtime/`: llama.cpp's library, models, contexts and batches;
- `constrained/`: JSON schemas and tools as grammars, and each token chosen within one;
- `scheduling/`: the admission queue, the worker that batches every running sequence, and
  speculation (prompt lookup, a draft model);
- `registry`: the loaded models, each with its scheduler (load, evict, acquire);
- `prompt` (a request's prompt against a loaded model) and `modelops` (the one door for
  model management: install, switch, remove, used by the API and the fleet).

Where is the grammar for a JSON schema built? `constrained/json_grammar.py`. Where does a
request wait for a slot? `scheduling/admission.py`, then `scheduling/scheduler.py`.

Never: tenants, the ledger, metrics or the request path (import-linter holds it: it
imports only `config` and the bottom layer). Next: `registry.ModelRegistry.acquire`.
"""
