"""The engine: model catalog, llama.cpp runtime and the scheduler that owns its contexts."""
