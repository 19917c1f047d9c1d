"""instructor and pydantic-ai against a live box's OpenAI dialect, as a store's developers
call them: runs in the client libraries' own environment (tests/pyclients/requirements.txt)
and prints, as one JSON line, each library's result and the exact body it sent.

    python run_clients.py OPENAI_URL MODEL MAX_TOKENS
"""

from __future__ import annotations

import json
import sys
from typing import Any

import instructor
import openai
from pydantic import BaseModel
from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

TEAM_PROMPT = "Record a team led by Ann, 30, with Bob, 25."
PEOPLE_PROMPT = "Ann is 30 and Bob is 25."


class Person(BaseModel):
    name: str
    age: int


class Team(BaseModel):
    """A team: its lead and its members."""

    lead: Person
    members: list[Person]


def recording(sent: list[dict[str, Any]], *, asynchronous: bool = False) -> Any:
    """An HTTP client for the OpenAI SDK that records each JSON body the library sends."""
    def record(request: Any) -> None:
        if request.method == "POST":
            sent.append(json.loads(request.content))

    async def record_async(request: Any) -> None:
        record(request)

    if asynchronous:
        return openai.DefaultAsyncHttpxClient(event_hooks={"request": [record_async]})
    return openai.DefaultHttpxClient(event_hooks={"request": [record]})


def main(url: str, model: str, max_tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {"versions": {"instructor": instructor.__version__,
                                        "openai": openai.__version__}}
    sent: list[dict[str, Any]] = []
    oa = openai.OpenAI(base_url=url, api_key="unused", max_retries=0,
                       http_client=recording(sent))
    client = instructor.from_openai(oa, mode=instructor.Mode.TOOLS)
    team = client.chat.completions.create(
        model=model, response_model=Team, max_retries=0, max_tokens=max_tokens,
        temperature=0, messages=[{"role": "user", "content": TEAM_PROMPT}])
    out["instructor"] = {"result": team.model_dump(), "sent": sent[-1]}
    people = list(client.chat.completions.create_iterable(
        model=model, response_model=Person, max_retries=0, max_tokens=max_tokens,
        temperature=0, messages=[{"role": "user", "content": PEOPLE_PROMPT}]))
    out["instructor-iterable"] = {"result": [p.model_dump() for p in people],
                                  "sent": sent[-1]}
    provider = OpenAIProvider(base_url=url, api_key="unused",
                              http_client=recording(sent, asynchronous=True))
    agent = Agent(OpenAIChatModel(model, provider=provider), output_type=Team, retries=0)
    result = agent.run_sync(TEAM_PROMPT, model_settings={"max_tokens": max_tokens,
                                                         "temperature": 0})
    out["pydantic-ai"] = {"result": result.output.model_dump(), "sent": sent[-1]}
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
