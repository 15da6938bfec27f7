"""The ``openai-agents`` SDK's default model (the Responses API) runs a
function-tool loop to completion against the server, on the scripted model.

The user's message selects the script that calls ``get_weather``; the tool's
output carries the selector of the script that answers (it outranks the
first), so the run finishes only if the tool's output reached the model.
"""

from __future__ import annotations

import pytest
from agents import Agent, ModelSettings, RunConfig, Runner, function_tool
from agents.items import ToolCallItem, ToolCallOutputItem
from agents.models.openai_provider import OpenAIProvider
from openai import AsyncOpenAI

from tests.e2e.harness import RunningServer
from tests.fixtures.scripted_model import ScriptedModel

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]

#: What the answering script says after its reasoning.
ANSWER = "Oslo is sunny."


@pytest.fixture
def anyio_backend() -> str:
    """The agents SDK runs on asyncio only (the server runs under both)."""
    return "asyncio"


@pytest.mark.parametrize("script", ["agent_call", "agent_call_tight"])
async def test_agents_sdk_runs_a_function_tool_loop(
    scripted_server: RunningServer, scripted: ScriptedModel, script: str
) -> None:
    """With its default strict tools (a grammar over the hermes markup), with
    or without the newline after ``<tool_call>``."""
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"Sunny in {city}. {scripted.selector('agent_done')}"

    async with AsyncOpenAI(base_url=scripted_server.api_url, api_key="unused") as client:
        agent = Agent(
            name="weather",
            instructions="Answer briefly.",
            tools=[get_weather],
            model=scripted_server.model,
            model_settings=ModelSettings(temperature=0),
        )
        result = await Runner.run(
            agent,
            f"What is the weather in Oslo? {scripted.selector(script)}",
            max_turns=4,
            run_config=RunConfig(
                model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True
            ),
        )
    assert asked == ["Oslo"]
    assert result.final_output == ANSWER
    calls = [item for item in result.new_items if isinstance(item, ToolCallItem)]
    outputs = [item for item in result.new_items if isinstance(item, ToolCallOutputItem)]
    assert len(calls) == len(outputs) == 1
    assert len(result.raw_responses) == 2
    assert all(response.usage.output_tokens > 0 for response in result.raw_responses)
