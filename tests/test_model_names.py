"""Model names: one rule (`ModelName.parse`) for every name a client or operator gives.

A name the rule refuses is a 400 (`param: model`) on every endpoint that takes one, in the
dialect's shape, never a 500; a well-formed name that is not installed stays a 404.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from click.testing import CliRunner

from edge_agent.cli import main
from edge_agent.engine.models.catalog import MAX_NAME_CHARS, ModelStore
from edge_agent.errors import InvalidRequest
from edge_agent.names import ModelName
from tests.conftest import DEFAULT_MODEL, LiveServer
from tests.ggufgen import write_tiny_gguf

VALID = ["smollm2:135m", "gemma3:270m", "smollm2", "library/smollm2:135m",
         "hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M", "my_model-v1.2:q4_0",
         "_x", "a" * MAX_NAME_CHARS]
INVALID = {
    "long": "a" * (MAX_NAME_CHARS + 1),
    "very long": "m" * 5000,
    "over 255 bytes": "é" * 130,
    "NUL": "a\x00b",
    "control": "a\x1bb",
    "newline": "a\nb:1",
    "surrogate": "a\ud800b",
    "space": "my model",
    "two tags": "a:b:c",
    "empty tag": "a:",
    "empty name": ":tag",
    "dot part": "../../etc/passwd",
    "hidden": ".hidden",
    "four parts": "a/b/c/d",
    "empty part": "a//b",
    "empty": "   ",
}


@pytest.mark.parametrize("name", VALID)
def test_names_that_were_valid_stay_valid(name: str) -> None:
    key = ModelName.parse(name)
    assert key == (name if ":" in name else f"{name}:latest")


@pytest.mark.parametrize("name", INVALID.values(), ids=INVALID.keys())
def test_invalid_names_are_refused_with_a_short_ascii_message(name: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        ModelName.parse(name)
    assert err.value.param == "model"
    assert err.value.message.isascii() and len(err.value.message) < 200


def test_the_longest_names_fit_a_manifest_file_name(tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "state")
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
    part = "p" * ((MAX_NAME_CHARS - 3) // 4)
    longest = f"{part}/{part}/{part}:{'t' * (MAX_NAME_CHARS - 3 * len(part) - 3)}"
    assert len(longest) == MAX_NAME_CHARS
    for name in (longest, "n" * MAX_NAME_CHARS):
        key = ModelName.parse(name)
        store.import_file(tiny, key)
        assert store.get(key).name == ModelName.parse(name)
        manifest = next(p for p in (tmp_path / "state" / "manifests").iterdir()
                        if p.name.startswith(name[:20]))
        assert len(manifest.name.encode()) <= 255
        store.remove(key)


def test_cli_refuses_a_long_name_in_one_line(tmp_path: Path) -> None:
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
    state = str(tmp_path / "s")
    for args in (["models", "import", str(tiny), "--name", "m" * 5000],
                 ["models", "show", "m" * 5000], ["models", "rm", "a\x01b"],
                 ["models", "pull", "x" * 300]):
        result = CliRunner().invoke(main, [*args, "--state-dir", state])
        assert result.exit_code == 1, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit)
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("edge-agent: model name '"), lines


# -- every endpoint that takes a model name -------------------------------------------------
def _requests(name: str) -> list[tuple[str, str, dict[str, Any] | None]]:
    msgs = [{"role": "user", "content": "hi"}]
    return [
        ("POST", "/api/generate", {"model": name, "prompt": "hi", "stream": False}),
        ("POST", "/api/generate", {"model": name}),  # the load path
        ("POST", "/api/generate", {"model": name, "keep_alive": 0}),  # the unload path
        ("POST", "/api/generate", {"model": name, "prompt": "hi", "think": True}),
        ("POST", "/api/chat", {"model": name, "messages": msgs, "stream": False}),
        ("POST", "/api/chat", {"model": name, "messages": [], "keep_alive": "5m"}),
        ("POST", "/api/embed", {"model": name, "input": "hi"}),
        ("POST", "/api/embeddings", {"model": name, "prompt": "hi"}),
        ("POST", "/api/show", {"model": name}),
        ("POST", "/api/show", {"name": name}),
        ("DELETE", "/api/delete", {"model": name}),
        ("POST", "/v1/chat/completions", {"model": name, "messages": msgs}),
        ("POST", "/v1/completions", {"model": name, "prompt": "hi"}),
        ("POST", "/v1/embeddings", {"model": name, "input": "hi"}),
    ]


def _check_shape(response: httpx.Response, path: str, status: int) -> None:
    assert response.status_code == status, (path, response.text)
    body = response.json()
    if path.startswith("/v1/"):
        error = body["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "model"
        assert error["code"] == ("model_not_found" if status == 404 else None)
    else:
        assert isinstance(body["error"], str) and body["error"]


@pytest.mark.parametrize("name", ["a" * 300, "é" * 130, "a\ud800b", "a\x00b", "../../x"],
                         ids=["300 chars", "260 bytes", "surrogate", "NUL", "traversal"])
def test_every_endpoint_answers_an_invalid_name_with_400(live_server: LiveServer,
                                                         name: str) -> None:
    with httpx.Client(base_url=live_server.base_url, timeout=30) as client:
        for method, path, body in _requests(name):
            # json.dumps escapes a lone surrogate as the JSON text "\ud800", as a client may
            response = client.request(method, path, content=json.dumps(body),
                                      headers={"content-type": "application/json"})
            _check_shape(response, path, 400)
        if "\ud800" not in name:  # a URL cannot carry a lone surrogate
            response = client.get(f"/v1/models/{quote(name, safe='')}")
            _check_shape(response, "/v1/models/", 400)
        assert client.get(f"/v1/models/{DEFAULT_MODEL}").status_code == 200


def test_a_well_formed_unknown_name_is_still_404(live_server: LiveServer) -> None:
    with httpx.Client(base_url=live_server.base_url, timeout=30) as client:
        for method, path, body in _requests("nope:1"):
            if body and body.get("think"):
                continue  # refused as unsupported (400) before the model is looked up
            _check_shape(client.request(method, path, json=body), path, 404)
        _check_shape(client.get("/v1/models/nope:1"), "/v1/models/", 404)


def test_a_default_model_that_breaks_the_rule_is_a_config_error(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('default_model = "my model"\n')
    result = CliRunner().invoke(main, ["models", "list", "--config", str(cfg)])
    assert result.exit_code == 2
    assert result.output.startswith("edge-agent: invalid setting default_model")
    assert len(result.output.strip().splitlines()) == 1
