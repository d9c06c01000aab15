"""llama.cpp itself loads finetuner's GGUF export and answers the demo prompt as transformers does.

Installs llama-cpp-python (it compiles llama.cpp: minutes, not part of the test run) into a
folder of its own (``--target``, default ``.cache/llama_cpp_python``; the project's environment
is left as it is), exports the demo (``runs/demo_cpu`` if it exists, else ``data/demo_model``)
to GGUF with ``finetuner.export_model``, and then, in a process that imports llama_cpp from that
folder:

- tokenizes the chat-formatted demo prompt with llama.cpp (special tokens parsed) and compares
  the ids with transformers' tokenizer;
- answers greedily (argmax of llama.cpp's logits, up to ``--max-new-tokens``) and compares the
  tokens with transformers' greedy answer from the merged model.

With ``--k-quant`` it also exports ``q4_k_m`` through llama.cpp's quantizer. The result is
written to ``docs/validation/llama_cpp_check.json`` and summarised in ``docs/validation/llama_cpp_check.md``.

``--tiny qwen3`` (also ``phi3``, ``gemma2``, ``gemma3_text``, ``qwen3_moe``, ``mamba``, ``lfm2``, ``gemma4_text``,
``qwen3_5_text``, ``falcon_mamba``, ``mamba2``, ``qwen3_5_moe_text``, ``lfm2_moe``, ``granitemoehybrid``) checks another architecture the export writes: a tiny random model of that
``model_type`` (:data:`TINY`: 2 layers, a head wider than hidden / heads, as Qwen3-4B's) with the demo
model's tokenizer and chat template, built in a temporary folder; the result goes to
``docs/validation/llama_cpp_check_qwen3.json`` (and ``.md``).

    python -m scripts.validate.llama_cpp_check
    python -m scripts.validate.llama_cpp_check --tiny qwen3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROMPT = "What should I pack for a day hike?"

CHILD = r"""
import json, sys
import numpy as np
from llama_cpp import Llama
path, ids, max_new, eos = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
text = sys.argv[5]
llm = Llama(model_path=path, n_ctx=512, n_threads=2, logits_all=True, verbose=False)
llama_ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
llm.reset()
llm.eval(ids)
prompt_next = [int(np.asarray(llm.scores[i]).argmax()) for i in range(len(ids))]  # teacher-forced, every position
out = []
for _ in range(max_new):
    logits = np.asarray(llm.scores[llm.n_tokens - 1])
    tok = int(logits.argmax())
    if tok in eos:
        break
    out.append(tok)
    llm.eval([tok])
print(json.dumps({"llama_cpp_prompt_ids": llama_ids, "llama_cpp_answer_ids": out, "llama_cpp_prompt_next": prompt_next,
                  "llama_cpp_answer": llm.detokenize(out).decode("utf-8", "replace")}))
"""


def installed_version(target: Path) -> str:
    """The version of the llama-cpp-python installed in ``target``."""
    return (target / "llama_cpp" / "__init__.py").read_text(encoding="utf-8").split('__version__ = "', 1)[-1].split('"', 1)[0]


def install(target: Path) -> float:
    if (target / "llama_cpp").is_dir():
        return 0.0
    t0 = time.perf_counter()
    env = {**os.environ, "CMAKE_ARGS": os.environ.get("CMAKE_ARGS", "-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF")}
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-cache-dir", "--target", str(target), "llama-cpp-python"], check=True, env=env)
    return time.perf_counter() - t0


#: Falcon-H1's muP multipliers, none 1 (one written wrong shows in the logits)
FALCON_H1_MULTIPLIERS = dict(embedding_multiplier=2.0, lm_head_multiplier=0.5, attention_in_multiplier=0.5,
                             attention_out_multiplier=1.5, key_multiplier=0.5, ssm_in_multiplier=1.5,
                             ssm_out_multiplier=0.5, mlp_multipliers=[1.5, 0.5], ssm_multipliers=[0.5, 1.5, 0.5, 2.0, 0.5])
#: ``--tiny`` model types: the config of a tiny random model of each (with the demo's tokenizer)
TINY = {"qwen3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=True),
        "phi3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=512, original_max_position_embeddings=512,
                     rope_scaling=None, tie_word_embeddings=False),
        "gemma2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, max_position_embeddings=512, sliding_window=8,
                       query_pre_attn_scalar=32),
        "qwen3_moe": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
                          norm_topk_prob=True, max_position_embeddings=512, tie_word_embeddings=False),
        "gemma3_text": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, max_position_embeddings=512, sliding_window=8,
                            query_pre_attn_scalar=32,  # Gemma-3-4B and up: the global layers' positions scaled
                            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
        # issue 56: a pure Mamba (the scan's widths its own) and LFM2's short convolutions beside attention
        "mamba": dict(hidden_size=64, state_size=8, expand=2, conv_kernel=4, time_step_rank=8, num_hidden_layers=2),
        "lfm2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=512, layer_types=["conv", "full_attention"],
                     full_attn_idxs=[1]),
        # Gemma 4: a full-attention layer with a wider head and proportional RoPE, per-layer input embeddings; Qwen3.5:
        # a Gated DeltaNet layer (more value heads than key heads, as Qwen3.5's) and a gated full-attention layer
        "gemma4_text": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, global_head_dim=32, hidden_size_per_layer_input=16,
                            max_position_embeddings=512, sliding_window=8,
                            layer_types=["sliding_attention", "full_attention"]),
        "qwen3_5_text": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
                             linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                             layer_types=["linear_attention", "full_attention"], max_position_embeddings=512,
                             tie_word_embeddings=False),
        # Falcon-Mamba (RMS-normed dt, B and C), Mamba-2 (heads in 2 groups), Qwen3.5-MoE (the Gated DeltaNet with
        # routed and shared experts), LFM2-MoE (a dense first layer, then experts routed by a sigmoid with a bias)
        "falcon_mamba": dict(hidden_size=64, state_size=8, expand=2, conv_kernel=4, time_step_rank=8, num_hidden_layers=2),
        "mamba2": dict(hidden_size=64, state_size=8, expand=2, conv_kernel=4, num_heads=8, head_dim=16, n_groups=2,
                       num_hidden_layers=2, chunk_size=16),
        "qwen3_5_moe_text": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                                 linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                 layer_types=["linear_attention", "full_attention"], max_position_embeddings=512,
                                 tie_word_embeddings=False),
        "lfm2_moe": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                         num_dense_layers=1, max_position_embeddings=512, layer_types=["conv", "full_attention"]),
        # Granite 4.0-H: a Mamba-2 layer and an attention layer, experts and a shared MLP, its multipliers none 1
        "granitemoehybrid": dict(hidden_size=64, intermediate_size=128, shared_intermediate_size=32, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                 mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=16,
                                 layer_types=["mamba", "attention"], embedding_multiplier=4.0, residual_multiplier=0.5,
                                 attention_multiplier=0.25, logits_scaling=0.25, max_position_embeddings=512),
        # Bamba: a Mamba-2 layer and an attention layer turning the first half of each head, dense MLPs
        "bamba": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8,
                      mamba_chunk_size=16, attn_layer_indices=[1], max_position_embeddings=512),
        # Falcon-H1: Mamba-2 and attention side by side in each layer, its muP multipliers none 1, the gated norm on
        "falcon_h1": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16,
                          mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=16, mamba_rms_norm=True,
                          mamba_norm_before_gate=False, max_position_embeddings=512, **FALCON_H1_MULTIPLIERS),
        # Nemotron-H with experts (as Nemotron 3 Nano): Mamba-2, experts, attention without positions, experts
        "nemotron_h": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           layers_block_type=["mamba", "moe", "attention", "moe"], ssm_state_size=8, mamba_num_heads=8,
                           mamba_head_dim=16, n_groups=2, chunk_size=16, n_routed_experts=4, moe_intermediate_size=32,
                           moe_shared_expert_intermediate_size=32, num_experts_per_tok=2, max_position_embeddings=512),
        # Jamba: Mamba layers with and without experts, an attention layer without positions
        "jamba": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, expert_layer_period=2,
                      expert_layer_offset=1, attn_layer_period=4, attn_layer_offset=2, mamba_d_state=8, mamba_dt_rank=8,
                      max_position_embeddings=512, use_mamba_kernels=False),
        # Qwen3-Next: a Gated DeltaNet layer (4 value heads on 2 key heads) and a gated attention layer, experts with
        # a gated shared expert after each
        "qwen3_next": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
                           linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                           moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
                           num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"],
                           max_position_embeddings=512, tie_word_embeddings=False)}


def tiny_model(model_type: str, folder: Path) -> str:
    """A tiny random ``model_type`` model with the demo model's tokenizer, saved in ``folder``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(REPO / "data" / "demo_model"))
    per_layer = {"vocab_size_per_layer_input": len(tok)} if model_type == "gemma4_text" else {}  # its own vocabulary width
    cfg = AutoConfig.for_model(model_type, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id, **per_layer, **TINY[model_type])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # norms that are not all ones, so a norm written wrong shows in the answer
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "layer_scalar")):
                param.normal_(1, 0.3)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def transformers_answer(weights: str, tokenizer, ids: list[int], max_new: int, eos: list[int]) -> tuple[list[int], list[int]]:
    """The greedy answer, and the most likely next token at every position of the prompt (teacher-forced: a
    check that a random model's degenerate answer, one token repeated, cannot pass alone)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32).eval()
    with torch.no_grad():
        prompt_next = model(torch.tensor([ids])).logits[0].argmax(-1).tolist()
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                             pad_token_id=tokenizer.pad_token_id)
    answer = out[0, len(ids):].tolist()
    while answer and answer[-1] in eos:
        answer.pop()
    return answer, prompt_next


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(REPO / ".cache" / "llama_cpp_python"), help="Where llama-cpp-python is installed.")
    ap.add_argument("--source", help="Run or model folder (default runs/demo_cpu, else data/demo_model).")
    ap.add_argument("--quant", default="f16")
    ap.add_argument("--k-quant", action="store_true", help="Also export q4_k_m with llama.cpp's quantizer.")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--tiny", choices=sorted(TINY), help="Check a tiny random model of this model_type instead of the demo.")
    ap.add_argument("--out", help="The result (default docs/validation/llama_cpp_check.json, llama_cpp_check_<type>.json with --tiny).")
    args = ap.parse_args()

    target = Path(args.target)
    seconds_install = install(target)
    sys.path.insert(0, str(target))  # for q4_k_m: finetuner finds llama_cpp's quantizer

    import finetuner
    from finetuner.export.merge import merge_adapter
    from finetuner.infer.loading import chat_template, load_tokenizer, resolve_source

    args.out = args.out or str(REPO / "docs" / "validation" / f"llama_cpp_check{'_' + args.tiny if args.tiny else ''}.json")
    tiny_dir = tempfile.TemporaryDirectory() if args.tiny else None
    if args.tiny:
        # named without the family: llama.cpp's vocabulary loader looks up Phi-3's own <|end|> token in a model
        # whose name says phi, and the demo tokenizer the tiny model borrows has none
        source = tiny_model(args.tiny, Path(tiny_dir.name) / "tiny-random")
    else:
        source = args.source or (str(REPO / "runs" / "demo_cpu") if (REPO / "runs" / "demo_cpu" / "adapter").is_dir() else str(REPO / "data" / "demo_model"))
    src = resolve_source(source)
    tokenizer = load_tokenizer(src)
    template = chat_template(src, tokenizer)
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], chat_template=template, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    eos = sorted({tokenizer.eos_token_id} | ({tokenizer.convert_tokens_to_ids("<|im_end|>")} if "<|im_end|>" in tokenizer.get_vocab() else set()))
    result: dict = {"source": source, "prompt": PROMPT, "prompt_text": text, "prompt_ids": ids, "install_seconds": round(seconds_install, 1)}
    with tempfile.TemporaryDirectory() as tmp:
        weights = source
        if src.has_adapter:
            weights = str(Path(tmp) / "merged")
            merge_adapter(source, weights, dtype="fp32")
        answer, prompt_next = transformers_answer(weights, tokenizer, ids, args.max_new_tokens, eos)
        result["transformers_answer_ids"] = answer
        result["transformers_answer"] = tokenizer.decode(answer)
        quants = [args.quant] + (["q4_k_m"] if args.k_quant else [])
        result["exports"] = {}
        for quant in quants:
            r = finetuner.export_model(source, Path(tmp) / f"demo-{quant}.gguf", quant=quant)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")])}
            p = subprocess.run([sys.executable, "-c", CHILD, str(r.gguf_file), json.dumps(ids), str(args.max_new_tokens), json.dumps(eos), text],
                               capture_output=True, text=True, env=env)
            if p.returncode != 0:
                result["exports"][quant] = {"error": p.stderr[-2000:]}
                continue
            got = json.loads(p.stdout.strip().splitlines()[-1])
            got.update(file_bytes=r.file_bytes, max_abs_logit_diff=r.max_abs_logit_diff, top1_agreement=r.top1_agreement,
                       tokenizer_ids_equal=got["llama_cpp_prompt_ids"] == ids, answer_equal=got["llama_cpp_answer_ids"] == answer,
                       prompt_top1_agreement=round(sum(a == b for a, b in zip(got["llama_cpp_prompt_next"], prompt_next))
                                                   / len(prompt_next), 4))
            result["exports"][quant] = got
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    version = installed_version(target)
    result["llama_cpp_python"] = version
    out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    built = f", built from source in {seconds_install:.0f} s" if seconds_install else ""
    lines = ["# llama.cpp loads finetuner's GGUF export", "",
             f"`python -m scripts.validate.llama_cpp_check{' --k-quant' if args.k_quant else ''}"
             f"{' --tiny ' + args.tiny if args.tiny else ''}` on `{Path(source).name}`, "
             f"prompt {PROMPT!r} (chat template applied), greedy, up to {args.max_new_tokens} new tokens, with "
             f"llama-cpp-python {version}{built}. Raw result: `{out.name}`.", "",
             f"transformers (merged model, fp32): {result['transformers_answer']!r}", "",
             "| GGUF | MiB | max abs logit diff, top-1 (transformers' GGUF loader vs merged) | llama.cpp prompt ids = transformers' "
             "| llama.cpp's next token = transformers' at each prompt position | llama.cpp greedy answer = transformers' "
             "| llama.cpp's answer |",
             "|---|---|---|---|---|---|---|"]
    for quant, g in result["exports"].items():
        if "error" in g:
            lines.append(f"| {quant} | | | error | error | error | {g['error'].splitlines()[-1] if g['error'] else ''} |")
        else:
            lines.append(f"| {quant} | {g['file_bytes'] / 2**20:.1f} | {g['max_abs_logit_diff']:.4f}, {g['top1_agreement']:.0%} "
                         f"| {g['tokenizer_ids_equal']} | {g['prompt_top1_agreement']:.0%} of {len(prompt_next)} "
                         f"| {g['answer_equal']} | {g['llama_cpp_answer']!r} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    ok = all("error" not in g and g["tokenizer_ids_equal"] and g["answer_equal"] and g["prompt_top1_agreement"] >= 0.9
             for g in result["exports"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
