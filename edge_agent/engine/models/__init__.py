"""The model store: what is installed, where its bytes are, and which version serves.

Owns `<state-dir>/blobs`, `models.db` and the `manifests/` mirror: the catalog of names a box
may install (`catalog`, reading `models/*.toml`), the installed versions and the active
pointer (`versions`), the mirror older tools read (`manifests`), bytes on their way in
(`staging`), the safe GGUF header reader that sees every file before llama.cpp does
(`gguf_probe`), and the records they share (`entries`).

Never: llama.cpp, a context or a request. A model here is a file and its facts; loading it
is `runtime`'s, serving it `registry`'s. Next: `catalog.ModelStore`; the door the API and
the fleet use to change the store is `engine.modelops`.
"""
