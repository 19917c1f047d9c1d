"""llama.cpp on this box: its library, models and contexts, and how wide they may run.

Owns the C API through llama-cpp-python's low-level bindings (`llama`: models, batch and
embedding contexts, the backend and its log), whether the native libraries run here at all,
asked of a child process (`native`), and how many sequences a model decodes together when
`parallel = "auto"` (`parallel_plan`).

Never: a request, a queue or a grammar. What runs in a step is `scheduling`'s, how a token
is chosen `constrained.sampler`'s. Next: `llama.LlamaModel` and `llama.BatchContext`.
"""
