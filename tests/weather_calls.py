"""Tool-calling chats for the tests: one function, ``get_weather(city)``, asked, called (OpenAI's form: arguments
as a JSON string), answered by the tool and then by the assistant."""

from __future__ import annotations

import json

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CITIES = ["Paris", "Lyon", "Oslo", "Rome", "Porto", "Turin", "Ghent", "Bergen", "Cork", "Graz", "Basel", "Split"]


def weather_row(i: int, city: str) -> dict:
    """One chat: a request, the call, its result, the answer."""
    call = {"id": f"call{i:05d}", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
    return {"tools": [WEATHER], "messages": [
        {"role": "user", "content": f"What is the weather in {city}?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny"},
        {"role": "assistant", "content": f"It is sunny in {city}."}]}
