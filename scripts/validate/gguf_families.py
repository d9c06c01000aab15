"""Which of the newest families (issue 56) the installed ``gguf`` package can name for llama.cpp: for each
``model_type``, llama.cpp's architecture (as its converter writes the family), whether the installed gguf package
has it, and how many of a tiny model's tensors its ``TensorNameMap`` names within the architecture's
``MODEL_TENSORS``; and what ``finetuner export`` does with it. The table goes into docs/export_families.md.

    python -m scripts.validate.gguf_families
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def row(model_type: str) -> str:
    import gguf
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetuner.errors import UserError
    from finetuner.export.gguf_arch import NOT_WRITTEN, SUPPORTED, arch_for
    from finetuner.model.tiny import tiny_config

    arch = SUPPORTED[model_type][0] if model_type in SUPPORTED else NOT_WRITTEN[model_type]
    enum = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), None)
    named = "-"
    if enum is not None:
        cfg = tiny_config(model_type, 300)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
        names = list(model.state_dict())
        nmap, allowed = gguf.get_tensor_name_map(enum, int(model.config.num_hidden_layers)), set(gguf.MODEL_TENSORS[enum])
        found = [nmap.get_type_and_name(n.replace("model.language_model.", "model."), try_suffixes=(".weight", ".bias"))
                 for n in names]
        missing = sorted({n.split(".")[-2] + "." + n.split(".")[-1] for n, f in zip(names, found) if f is None or f[0] not in allowed})
        named = f"{sum(f is not None and f[0] in allowed for f in found)} of {len(names)}" + (f" (not: {', '.join(missing[:4])})" if missing else "")
    try:
        arch_for(tiny_config(model_type, 300), "config.json")
        export = "exported (tests/export/test_gguf_new_families.py)"
    except UserError as e:
        export = "refused: " + str(e).split(": ", 2)[-1].split(";")[0]
    return f"| {model_type} | {arch or 'none'} | {'yes' if enum is not None else 'no'} | {named} | {export} |"


def main() -> None:
    from finetuner.export.gguf_arch import NOT_WRITTEN
    from finetuner.export.gguf_recurrent import RECURRENT

    try:
        llama = version("llama_cpp_python")
    except PackageNotFoundError:
        llama = "not installed"
    print(f"gguf {version('gguf')}, llama-cpp-python {llama}\n")
    print("| model_type | llama.cpp architecture | in the gguf package | tiny model's tensors gguf names | finetuner export |")
    print("|---|---|---|---|---|")
    written = ["gemma4_text", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next",  # gguf_gemma4, gguf_qwen35
               "granitemoehybrid", "bamba", "falcon_h1", "nemotron_h", "jamba"]  # gguf_granite, _falcon_h1, _nemotron_h, _jamba
    for model_type in [*RECURRENT, *written, *NOT_WRITTEN]:
        print(row(model_type))


if __name__ == "__main__":
    main()
