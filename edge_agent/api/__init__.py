"""The HTTP side: the dialects (`ollama`, `ollama_models`, and the `openai` package: its
protocol, serving and routes, and the Batch API beside them), the operator's endpoints
(`ops`: health, ready, metrics), the box's own namespace (`feedback`: an app's verdict on
an answer, under `/edge/v1`), authentication (`auth`), bodies and their limits
(`body`), the one error tree's two wire shapes (`errors`), catalog pulls (`pull`) and the
OpenAPI document (`openapi`).

Never: policy, a model lookup of its own or a call into the engine's scheduler — each
handler parses what the client sent (a model name once, `names.ModelName`) and hands it
to `gateway` (requests) or `engine.modelops` (model management). Next: `gateway.service`.
"""
