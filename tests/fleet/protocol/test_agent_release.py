"""An agent release's manifest and the rule deciding which boxes may take it."""

from __future__ import annotations

import pytest

from edge_agent.fleet.protocol.agent_release import (
    AGENT_NAME,
    AgentManifest,
    AgentManifestError,
    BoxPlatform,
    agent_target_path,
    is_agent,
    parse,
    refusal,
)

X86 = ("cp311", "cp311", "linux_x86_64")
BOX = BoxPlatform((X86, ("cp311", "abi3", "linux_x86_64"), ("py3", "none", "any")),
                  frozenset({"avx", "avx2", "fma", "sse4_2"}))


def manifest(**fields: object) -> AgentManifest:
    base = {"version": "0.2.0", "edge_agent": "0.2.0", "llama_cpp_python": "0.3.36",
            "build": "cpu", "python": "cp311", "abi": "cp311", "platform": "linux_x86_64",
            "requirement": "edge-agent-appliance[default-model]==0.2.0"}
    return parse({**base, **fields})


def test_a_release_built_for_the_box_is_taken() -> None:
    assert refusal(manifest(), BOX) is None
    assert refusal(manifest(build="cpu:avx2,fma"), BOX) is None


@pytest.mark.parametrize(("fields", "why"), [
    ({"platform": "linux_aarch64"}, "is built for cp311-cp311-linux_aarch64; this box "
                                    "installs cp311-cp311-linux_x86_64, no GPU wheels"),
    ({"python": "cp312", "abi": "cp312"}, "built for cp312-cp312-linux_x86_64"),
    ({"build": "cpu:avx512f"}, "this CPU lacks avx512f"),
    ({"build": "cuda:86,89"}, "is a CUDA build (cuda:86,89); this box has no NVIDIA GPU"),
])
def test_a_release_built_for_another_box_is_refused_with_the_reason(
        fields: dict[str, str], why: str) -> None:
    said = refusal(manifest(**fields), BOX)
    assert said is not None and why in said, said


def test_a_cuda_build_needs_one_of_its_compute_capabilities() -> None:
    gpu = BoxPlatform(BOX.tags, BOX.cpu_flags, frozenset({"87"}))
    assert refusal(manifest(build="cuda:87"), gpu) is None
    said = refusal(manifest(build="cuda:86,89"), gpu)
    assert said is not None and "this box's GPU is 87" in said


def test_the_manifest_travels_in_custom_and_is_told_from_a_models() -> None:
    m = manifest(gate={"prompts": []})
    custom = m.to_custom()
    assert is_agent(custom) and not is_agent({"name": "x", "version": "1"})
    assert AgentManifest.from_custom(custom) == m
    assert m.target_path == agent_target_path("0.2.0") == "agent/0.2.0/wheelhouse.tar"
    assert m.ref == "edge-agent@0.2.0" and AGENT_NAME.given == "edge-agent"
    with pytest.raises(AgentManifestError, match="format 9 is newer"):
        AgentManifest.from_custom({**custom, "format": 9})


@pytest.mark.parametrize(("fields", "where"), [
    ({"build": "gpu"}, "build"), ({"version": "../1"}, "version"),
    ({"version": "current"}, "version"),
    ({"platform": "linux x86"}, "platform")])
def test_a_bad_manifest_names_its_field(fields: dict[str, str], where: str) -> None:
    with pytest.raises(AgentManifestError, match=f"^{where}"):
        manifest(**fields)
