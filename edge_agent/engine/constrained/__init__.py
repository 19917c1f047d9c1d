"""Constrained decoding: a JSON schema or a tool list as a llama.cpp grammar, and each token
chosen within it.

Owns the converter (`json_grammar`, with the schema's checks in `schema_limits`, `allOf`
merged in `schema_merge`, strings as automata in `string_language`, numbers in
`numeric_range`, bounded counts in `repetition`, a union's live parses bounded in
`schema_width`), the grammar text's audit and parse in a bounded child (`grammar_check`),
compiled grammars kept for the next request (`grammar_cache`), tool calls built on schemas
(`tool_calls`), and the per-token path: the sampler chain with its grammar checked after it
(`sampler`), helped by the vocabulary's prefix forest (`token_prefixes`).

Never: the scheduler or the model store. It runs inside a scheduler step, but knows only a
context's logits and the tokens. Next: `json_grammar.convert` ("where is the grammar for a
JSON schema built?"), `sampler.Sampler` for a token.
"""
