"""Tiny GGUF files made with the `gguf` package, for tests of the header reader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFWriter


def write_tiny_gguf(path: Path, *, arch: str = "llama", context_length: int = 256,
                    template: str | None = None, name: str = "tiny-test",
                    floats: int = 24) -> Path:
    """A valid GGUF of one f32 tensor of `floats` values (a multiple of 8): bigger with
    more, and another digest for each name or context length."""
    writer = GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_context_length(context_length)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_file_type(0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "c"])
    if template:
        writer.add_chat_template(template)
    writer.add_tensor("token_embd.weight", np.zeros((floats // 8, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
