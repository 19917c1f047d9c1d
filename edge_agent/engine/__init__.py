"""The engine: the model store and catalog (`catalog`, `versions`, `manifests`,
`staging`), llama.cpp's runtime (`runtime`, `native`), the scheduler that owns its
contexts and batches every request's steps (`scheduler`, `steppolicy`, `admission`,
`lookup`, `draftmodel`), prompts and templates (`prompt`, `templates`), constrained output
(`json_grammar` with `schema_limits`, `schema_merge`, `string_language`,
`numeric_range` and `schema_width`; `grammar_check`, `grammar_cache`, `structured`), and
the registry of loaded models (`registry`); `modelops` is the one door for model management.

Never: tenants, the ledger, metrics or the request path (import-linter holds it: it
imports only `config` and the bottom layer). Next: `registry.ModelRegistry.acquire`.
"""
