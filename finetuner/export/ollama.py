"""An Ollama ``Modelfile`` for an exported GGUF: FROM, the chat template in Ollama's Go-template
syntax, the stop tokens, and the recipe's system prompt.

Ollama does not run Jinja chat templates, so the template is recognised by its family from the
markers it writes (ChatML's ``<|im_start|>``, Llama 3's ``<|start_header_id|>``, Mistral's
``[INST]``) and the family's Go template is written; a template of another family is refused with
a clear message (``--format gguf`` still works: llama.cpp reads the Jinja template in the file).

A run whose rows with tools trained in finetuner's fallback format (``metrics.json``'s ``data.tools.renders`` is
``"hermes"``: the chat template renders no tools, SmolLM2's) gets, on a ChatML template, :data:`CHATML_HERMES_TOOLS`:
Ollama's ``.Tools`` and each message's ``.ToolCalls`` written as :func:`finetuner.data.tools.fallback_messages`
writes them (the tools block in the system message, ``<tool_call>`` blocks in the reply, the results in one user
turn of ``<tool_response>`` blocks), as Ollama's own Qwen2.5 template does, so that Ollama's tool calling (its API's
``tools``, its hermes-style parsing of ``<tool_call>``) works with the fine-tune. Ollama writes the schemas and the
arguments as Go's JSON encoder does (no spaces after ``,`` and ``:``), where training wrote Python's (with them):
the same difference Ollama's Qwen2.5 template has from Qwen's Jinja one.
"""

from __future__ import annotations

import re

from finetuner.data.tools import FALLBACK_FORMAT, FALLBACK_SYSTEM
from finetuner.errors import UserError

CHATML = """{{- range .Messages }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}<|im_start|>assistant
"""

#: the tools block of :data:`finetuner.data.tools.FALLBACK_SYSTEM` with Ollama's tools, one JSON object a line
_GO_TOOLS_BLOCK = FALLBACK_SYSTEM.format(
    tools='{{ range $i, $t := $.Tools }}{{ if $i }}\n{{ end }}{"type": "function", "function": {{ $t.Function }}}{{ end }}')

CHATML_HERMES_TOOLS = ("""{{- $system := false }}
{{- range .Messages }}{{ if eq .Role "system" }}{{ $system = true }}{{ end }}{{ end }}
{{- if and .Tools (not $system) }}<|im_start|>system
""" + _GO_TOOLS_BLOCK + """<|im_end|>
{{ end }}
{{- $prev := "" }}
{{- range .Messages }}
{{- if and (eq $prev "tool") (ne .Role "tool") }}<|im_end|>
{{ end }}
{{- if eq .Role "system" }}<|im_start|>system
{{ .Content }}{{ if $.Tools }}

""" + _GO_TOOLS_BLOCK + """{{ end }}<|im_end|>
{{ else if eq .Role "tool" }}{{ if eq $prev "tool" }}
{{ else }}<|im_start|>user
{{ end }}<tool_response>
{{ .Content }}
</tool_response>
{{- else if eq .Role "assistant" }}<|im_start|>assistant
{{ if .Content }}{{ .Content }}{{ if .ToolCalls }}
{{ end }}{{ end }}{{ range $i, $c := .ToolCalls }}{{ if $i }}
{{ end }}<tool_call>
{"name": "{{ $c.Function.Name }}", "arguments": {{ $c.Function.Arguments }}}
</tool_call>{{ end }}<|im_end|>
{{ else }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}
{{- $prev = .Role }}
{{- end }}
{{- if eq $prev "tool" }}<|im_end|>
{{ end }}<|im_start|>assistant
""")

LLAMA3 = """{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>

{{ .Content }}<|eot_id|>
{{- end }}<|start_header_id|>assistant<|end_header_id|>

"""

MISTRAL = """{{- range $i, $m := .Messages }}
{{- if eq $m.Role "user" }}[INST] {{ if and (eq $i 0) $.System }}{{ $.System }}

{{ end }}{{ $m.Content }} [/INST]
{{- else if eq $m.Role "assistant" }} {{ $m.Content }}</s>
{{- end }}
{{- end }}"""

#: finetuner's fallback template (:data:`finetuner.data.template_choice.FALLBACK_CHAT_TEMPLATE`, a base model's run
#: without a chat template of its own) in Ollama's words; the end-of-sequence token is written in for :data:`EOS`
EOS = "\x00eos\x00"
PLAIN = """{{- range .Messages }}<|{{ .Role }}|>
{{ .Content }}{{ if eq .Role "assistant" }}""" + EOS + """{{ end }}
{{ end }}<|assistant|>
"""

#: family → (marker in the Jinja template, Ollama template, stop tokens)
FAMILIES = {
    "finetuner-plain": ("{{ '<|' + message['role'] + '|>\n' + message['content'] }}", PLAIN, ["<|user|>"]),
    "chatml": ("<|im_start|>", CHATML, ["<|im_start|>", "<|im_end|>"]),
    "llama3": ("<|start_header_id|>", LLAMA3, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]),
    "mistral": ("[INST]", MISTRAL, ["[INST]", "[/INST]", "</s>"]),
}


def template_family(chat_template: str) -> str:
    """``finetuner-plain`` (finetuner's fallback), ``chatml``, ``llama3`` or ``mistral``; a UserError for any other."""
    for family, (marker, _, _) in FAMILIES.items():
        if marker in chat_template:
            return family
    raise UserError(
        "The model's chat template is not ChatML, Llama 3, Mistral or finetuner's plain fallback, the templates whose "
        "Ollama template finetuner writes; no Modelfile was written.",
        hint="Export with --format gguf (llama.cpp and LM Studio read the Jinja template stored in the file), or set "
             "data.chat_template in the recipe to one of those families before training.",
    )


#: family → the system block a rendering holds (its content the group)
SYSTEM_BLOCKS = {
    "chatml": re.compile(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", re.DOTALL),
    "llama3": re.compile(r"<\|start_header_id\|>system<\|end_header_id\|>\n\n(.*?)<\|eot_id\|>", re.DOTALL),
}


def default_system(chat_template: str, rendered_without_system: str) -> str | None:
    """The system block a chat template writes by itself when the conversation has none (SmolLM2's "You are a
    helpful AI assistant named SmolLM ...", Llama 3.1's knowledge-cutoff lines): ``rendered_without_system`` is
    the template's rendering of one user message. Training saw that block on every example without a system
    prompt; Ollama's template writes a system block only from SYSTEM, so the Modelfile's SYSTEM must say it."""
    found = SYSTEM_BLOCKS.get(template_family(chat_template), None)
    match = found.search(rendered_without_system) if found else None
    return match.group(1) if match else None


def _quote(text: str) -> str:
    return '"""' + text.replace('"""', '\\"\\"\\"') + '"""'


def modelfile(gguf_name: str, chat_template: str, system: str | None = None, eos_token: str | None = None,
              projector: str | None = None, tools_format: str | None = None) -> str:
    """The Modelfile's text, with ``FROM ./<gguf_name>``; an image-text model's projector file (``projector``) is a
    second ``FROM`` line, as Ollama imports a language model and its projector (ollama/ollama#9780).
    ``tools_format``: how the run's rows with tools rendered (``"hermes"``, finetuner's fallback: the template that
    carries Ollama's tool calling in that format, module doc; ``"template"`` or None: the family's)."""
    family = template_family(chat_template)
    _, template, stops = FAMILIES[family]
    if tools_format == FALLBACK_FORMAT:
        if family != "chatml":
            raise UserError(f"The run trained tool calls in finetuner's fallback format ({FALLBACK_FORMAT}) on a {family} "
                            "chat template; finetuner writes that format's Ollama template for ChatML only.",
                            hint="Export with --format gguf (llama.cpp reads the Jinja template stored in the file).")
        template = CHATML_HERMES_TOOLS
    template = template.replace(EOS, eos_token or "")
    stops = list(stops)
    if eos_token and eos_token not in stops:
        stops.append(eos_token)
    lines = [f"# Written by finetuner export ({family} chat template).", f"FROM ./{gguf_name}"]
    if projector:
        lines.append(f"FROM ./{projector}")
    lines.append(f"TEMPLATE {_quote(template)}")
    if system:
        lines.append(f"SYSTEM {_quote(system)}")
    lines += [f'PARAMETER stop "{s}"' for s in stops]
    return "\n".join(lines) + "\n"


def model_name(folder_name: str) -> str:
    """An Ollama model name from the output folder's name (lowercase letters, digits, ``-_.``)."""
    name = re.sub(r"[^a-z0-9._-]+", "-", folder_name.lower()).strip("-._")
    return name or "finetuned"
