"""``finetuner export``: a run (or a model folder) as one GGUF file, or as an Ollama folder.

A thin wrapper over :func:`finetuner.export.gguf.export_model`; nothing heavy is imported until
the command runs. Progress and notes go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys

from finetuner.cli.inference import add_code_optins
from finetuner.units import duration_text, gib_text

FORMATS = ("gguf", "ollama")
QUANTS = ("f16", "bf16", "f32", "q8_0", "q4_0", "q4_k_m")


def register(sub: argparse._SubParsersAction) -> None:
    x = sub.add_parser(
        "export",
        help="Export a run's model to GGUF (llama.cpp, LM Studio) or Ollama, checked by transformers' GGUF reader.",
        description=(
            "Merges the adapter into the unquantized base (as `finetuner merge` does), writes a GGUF file with the gguf "
            "package (metadata, tokenizer, chat template, tensors in the chosen type), reads it back, and checks it with "
            "transformers' GGUF loader (logits on a probe, tokenizer ids) before publishing it. --format ollama writes a "
            "folder with the GGUF and a Modelfile and prints the `ollama create` command."
        ),
    )
    x.add_argument("source", metavar="RUN_OR_MODEL", help="A run folder (runs/<name>), a peft adapter folder or a model folder.")
    x.add_argument("-o", "--output", required=True, help="--format gguf: the .gguf file; --format ollama: a new or empty folder.")
    x.add_argument("--format", choices=FORMATS, default="gguf", help="gguf (one file) or ollama (GGUF + Modelfile). Default gguf.")
    x.add_argument("--quant", choices=QUANTS, default="f16",
                   help="Tensor type: f16 (default), bf16, f32, q8_0, q4_0; q4_k_m needs llama-cpp-python.")
    x.add_argument("--overwrite", action="store_true", help="Replace an existing output (only once the new one is complete and checked).")
    x.add_argument("--base", help="The base model's folder or hub id, if not where the run or adapter says.")
    x.add_argument("--merge-dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="dtype of the merge before conversion (default fp32: the GGUF is rounded once).")
    x.add_argument("--no-verify", action="store_true", help="Skip the transformers checks (logits, tokenizer); the read-back still runs.")
    x.add_argument("--json", action="store_true", help="Print the result as one JSON object.")
    add_code_optins(x)
    x.set_defaults(func=_cmd_export)


def _cmd_export(args: argparse.Namespace) -> int:
    from finetuner.cli.progress import command_phases
    from finetuner.export.gguf import export_model

    from finetuner.children import stop_signals_abort

    print(f"Exporting {args.source} → {args.output} ({args.format}, {args.quant}) ...", file=sys.stderr, flush=True)
    with stop_signals_abort(), command_phases():  # SIGTERM as Ctrl-C: the staging files removed, then "aborted."
        r = export_model(args.source, args.output, format=args.format, quant=args.quant, overwrite=args.overwrite,
                         base_model=args.base, merge_dtype=args.merge_dtype, verify=not args.no_verify,
                         trust_remote_code=args.trust_remote_code, allow_pickle=args.allow_pickle)
    if args.json:
        print(json.dumps(r.to_dict(), default=str))
        return 0
    print(f"GGUF file: {r.gguf_file}")
    print(f"  model       {r.architecture}, {r.tensors} tensors, {r.quant}, {r.file_bytes / 2**20:.1f} MiB")
    if r.mmproj_file is not None:
        print(f"  projector   {r.mmproj_file} (mmproj: vision tower and projector), {r.mmproj_tensors} tensors, "
              f"{r.mmproj_bytes / 2**20:.1f} MiB")
    print(f"  read-back   max |dequantized - merged weight| {r.max_weight_error:.3g} (gguf.GGUFReader)")
    if r.max_abs_logit_diff is not None:
        tol = f"tolerance {r.tolerance:.3g}; " if r.tolerance is not None else ""
        print(f"  check       transformers' GGUF loader vs merged model: max |logit difference| {r.max_abs_logit_diff:.3g} "
              f"({tol}largest |logit| {r.max_abs_logit:.3g}), top-1 agreement {r.top1_agreement:.0%} on {r.probe_tokens} tokens")
        print(f"  tokenizer   rebuilt from the file: same ids on {r.tokenizer_texts} sample texts (chat template included)")
    print(f"  peak RAM    {gib_text(r.peak_rss_bytes)} (process peak RSS), {duration_text(r.seconds)}")
    for note in r.notes:
        print(f"  note        {note}")
    if r.modelfile is not None:
        print(f"Modelfile: {r.modelfile}")
        print(f"Create the Ollama model with: {r.ollama_command}")
        print(f"Then chat with it: {r.ollama_run}")
    elif r.mmproj_file is not None:
        print(f"Run it with llama.cpp: llama-mtmd-cli -m {r.gguf_file} --mmproj {r.mmproj_file} --image PICTURE -p TEXT")
    else:
        print(f"Run it with llama.cpp: llama-cli -m {r.gguf_file}")
    return 0
