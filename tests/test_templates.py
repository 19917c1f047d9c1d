from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.engine.models.catalog import ModelStore
from edge_agent.engine.text.templates import ChatTemplate
from edge_agent.errors import InvalidRequest
from tests.conftest import DEFAULT_MODEL

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_gguf_chatml_template_renders(model_cache: Path) -> None:
    source = ModelStore(model_cache).get(DEFAULT_MODEL).chat_template
    assert source
    text = ChatTemplate(source, bos_token="<|im_start|>", eos_token="<|im_end|>").render(MESSAGES)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_catalog_template_for_a_base_model_renders_gemma_turns() -> None:
    entry = ModelStore(Path("/nonexistent")).catalog()["gemma3:270m"]
    assert entry.chat_template
    text = ChatTemplate(entry.chat_template, bos_token="<bos>", eos_token="<eos>").render(
        [*MESSAGES, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "2?"}])
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                    "<start_of_turn>model\nHello<end_of_turn>\n"
                    "<start_of_turn>user\n2?<end_of_turn>\n<start_of_turn>model\n")


def test_template_exceptions_become_client_errors_and_sandbox_holds() -> None:
    t = ChatTemplate("{{ raise_exception('roles must alternate') }}", bos_token="",
                     eos_token="")
    with pytest.raises(InvalidRequest, match="roles must alternate"):
        t.render(MESSAGES)
    sneaky = ChatTemplate("{{ messages.__class__.__mro__ }}", bos_token="", eos_token="")
    with pytest.raises(InvalidRequest):
        sneaky.render(MESSAGES)
