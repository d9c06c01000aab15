"""The Chat tab with a tools file: the schemas go to the chat process with the message, a reply that calls a tool
shows as JSON (finetuner.data.calls), and a tools file that is not one is said in the status line."""

from __future__ import annotations

import json

from tests.conftest import demo_run_folder
from tests.infer.test_tool_chat import ASK, WEATHER
from ui.handlers import Handlers


def test_the_chat_tab_offers_a_tools_file_and_says_what_is_wrong_with_one(tmp_path):
    from finetuner.infer.chat import load_chat_model

    runs = tmp_path / "runs"
    run = demo_run_folder(runs, "tools-ui", adapter=True)
    schemas = tmp_path / "tools.json"
    schemas.write_text(json.dumps([WEATHER]), encoding="utf-8")
    h = Handlers(runs, tmp_path / "uploads")
    settings = (False, 12, 0.0, 1.0, None, False, None)  # the fine-tune alone, 12 tokens, greedy
    try:
        out = list(h.on_chat(ASK[0]["content"], [], [], "tools-ui", *settings, str(schemas)))
        plain = list(h.on_chat(ASK[0]["content"], [], [], "tools-ui", *settings, None))
        bad = tmp_path / "bad.json"
        bad.write_text("{not json", encoding="utf-8")
        refused = list(h.on_chat(ASK[0]["content"], [], [], "tools-ui", *settings, str(bad)))
    finally:
        h.chat_pool.close()
    chat = load_chat_model(run)
    chat.tools = [WEATHER]
    reply = chat.tool_reply(ASK, temperature=0, max_new_tokens=12)
    want = f"```json\n{reply.to_json()}\n```" if reply.calls else (reply.text or "(no answer)")
    assert out[-1][3].startswith("Answered in"), out[-1][3]
    assert out[-1][1][-1]["content"] == want  # what chat --tools answers: the tools reached the chat process
    chat.tools = None
    assert plain[-1][1][-1]["content"] == (chat.reply(ASK, temperature=0, max_new_tokens=12) or "(no answer)")
    assert plain[-1][1][-1]["content"] != want  # the prompt with tools is another prompt
    message, tuned, _base, status = refused[-1]
    assert message == ASK[0]["content"] and tuned == []  # put back as it was
    assert f"The tools file {bad}: 'tools' is not valid JSON" in status
