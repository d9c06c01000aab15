"""``finetuner merge``, ``finetuner chat`` and ``finetuner eval``: using a run once it has finished.

Thin wrappers over :mod:`finetuner.export.merge`, :mod:`finetuner.infer.chat` and :mod:`finetuner.infer.evaluate`;
nothing heavy is imported until a command runs. Progress and notes go to stderr, so
``finetuner chat --prompt`` prints only the answer on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys

from finetuner.units import duration_text, gib_text


def register(sub: argparse._SubParsersAction) -> None:
    from finetuner.export.merge import DTYPE_CHOICES  # a light module: torch and transformers load when merging

    m = sub.add_parser(
        "merge",
        help="Merge a run's LoRA adapter into its base model and write a plain transformers model folder.",
        description=(
            "Loads the base model unquantized (also for QLoRA runs), merges the LoRA weights, writes a sharded "
            "safetensors save_pretrained folder with the tokenizer, chat template and generation config, and checks "
            "that its logits match the adapter's before publishing it."
        ),
    )
    m.add_argument("source", metavar="RUN_OR_ADAPTER", help="A run folder (runs/<name>) or a peft adapter folder.")
    m.add_argument("-o", "--output", required=True, help="A new or empty folder for the merged model.")
    m.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="dtype of the merged weights (default auto: the dtype the base model was saved in).")
    m.add_argument("--shard-size", default="5GB", help="Largest safetensors file (default 5GB).")
    m.add_argument("--overwrite", action="store_true", help="Replace a non-empty output folder (only once the new one is complete).")
    m.add_argument("--base", help="The base model's folder or hub id, if not where the run or adapter says.")
    m.add_argument("--no-verify", action="store_true", help="Skip the logits check (saves reloading the merged model).")
    m.add_argument("--json", action="store_true", help="Print the result as one JSON object.")
    add_code_optins(m)
    m.set_defaults(func=_cmd_merge)

    c = sub.add_parser(
        "chat",
        help="Chat with a run's model in the terminal (streaming), or answer one --prompt.",
        description=(
            "Interactive chat with the run's chat template. Commands: /reset starts over, /quit ends (or Ctrl-D). "
            "In a terminal, lines can be edited and Up recalls earlier ones (kept in ~/.cache/finetuner/chat_history, "
            "or $FINETUNER_CACHE_DIR/chat_history)."
        ),
    )
    c.add_argument("source", metavar="RUN_OR_MODEL", help="A run folder, an adapter folder, a model folder or a hub id.")
    c.add_argument("--prompt", "-p", help="Answer this one prompt and exit (prints only the answer).")
    c.add_argument("--image", dest="images", action="append", default=[], metavar="FILE",
                   help="A picture for a model that reads pictures (an image-text-to-text model or a run trained on "
                        "pictures), placed before the prompt; give --image again for more.")
    c.add_argument("--tools", metavar="FILE",
                   help="A JSON file of tool schemas (OpenAI's list) offered with every prompt, rendered as the run "
                        "trained (through the chat template, or finetuner's fallback format); a reply that calls a tool "
                        "is printed as JSON, {\"name\": ..., \"arguments\": {...}}, one line a call.")
    c.add_argument("--compare", action="store_true", help="Show the base model's answer next to the fine-tuned one.")
    c.add_argument("--no-adapter", action="store_true", help="Chat with the base model alone.")
    c.add_argument("--system", help="System prompt (default: the run's data.system_prompt, else the one every training row carried, if any).")
    c.add_argument("--thinking", choices=["on", "off"],
                   help="A thinking chat template's form (one that takes enable_thinking: Qwen3, Qwen3.5); default: "
                        "the form the run's rows trained in (a file without reasoning: off), else the template's own.")
    c.add_argument("--max-new-tokens", type=int, default=256)
    c.add_argument("--temperature", type=float, default=0.7, help="0 for greedy decoding (default 0.7).")
    c.add_argument("--top-p", type=float, default=0.9)
    c.add_argument("--seed", type=int, help="Seed for sampling (repeatable answers).")
    c.add_argument("--base", help="The base model's folder or hub id, if not where the run says.")
    c.add_argument("--device", default="auto", help="auto, cpu or cuda.")
    add_code_optins(c)
    c.set_defaults(func=_cmd_chat)

    e = sub.add_parser(
        "eval",
        help="Held-out loss and perplexity of the base model and the fine-tune, side by side.",
        description="Uses the run's validation split (as the trainer built it) or --data; writes the result into the run's metrics.json.",
    )
    e.add_argument("source", metavar="RUN", help="A run folder (runs/<name>) or its adapter/ folder.")
    e.add_argument("--data", help="Evaluate on this data file instead of the run's validation split.")
    e.add_argument("--column", dest="columns", action="append", default=[], metavar="ROLE=COLUMN",
                   help="Which column of --data holds a role (prompt, input, response, system, messages, text), e.g. "
                        "--column prompt=question (repeatable; as data.columns in a recipe).")
    e.add_argument("--exact-match", type=int, default=0, metavar="N", help="Also answer N examples greedily and count exact matches.")
    e.add_argument("--general", nargs="?", const="", default=None, metavar="FILE",
                   help="What the fine-tune kept: the base and the fine-tune answer the general probe set (the shipped "
                        "data/general_probe.jsonl, or FILE), scored without a judge; prints 'kept N of M'.")
    e.add_argument("--tasks", metavar="TASK[,TASK]",
                   help="Benchmarks through lm-evaluation-harness (pip install lm_eval): the base and the fine-tune "
                        "scored on these tasks, e.g. arc_easy,hellaswag (the harness fetches a task's data unless its "
                        "YAML points at local files).")
    e.add_argument("--include-path", metavar="FOLDER",
                   help="With --tasks: a folder of your own task YAMLs (one that runs code, a !function, needs "
                        "--trust-remote-code).")
    e.add_argument("--replace-builtin-tasks", action="store_true",
                   help="With --include-path: let the folder's tasks replace lm-evaluation-harness's own tasks, "
                        "groups and tags of the same name (refused otherwise).")
    e.add_argument("--num-fewshot", type=int, default=None, metavar="K", help="With --tasks: K examples in each prompt.")
    e.add_argument("--chat-template", action="store_true", help="With --tasks: the prompts through the run's chat template.")
    e.add_argument("--limit", type=int, default=None, metavar="N",
                   help="With --general: N probes spread over the set (every kind of question); with --tasks: the "
                        "first N documents of each task.")
    e.add_argument("--batch-size", type=int, default=8)
    e.add_argument("--base", help="The base model's folder or hub id, if not where the run says.")
    e.add_argument("--device", default="auto", help="auto, cpu or cuda.")
    e.add_argument("--no-write", action="store_true", help="Do not write the result into metrics.json.")
    e.add_argument("--json", action="store_true", help="Print the result as one JSON object.")
    add_code_optins(e)
    e.set_defaults(func=_cmd_eval)


def add_code_optins(p: argparse.ArgumentParser) -> None:
    """``--trust-remote-code`` and ``--allow-pickle``: a run folder whose recipe turns
    ``model.trust_remote_code`` or ``model.allow_pickle`` on is loaded only with them."""
    p.add_argument("--trust-remote-code", action="store_true",
                   help="Allow the model's own code to run (needed when the run's recipe sets model.trust_remote_code); "
                        "for eval --tasks, also the code of the --include-path task folder.")
    p.add_argument("--allow-pickle", action="store_true",
                   help="Allow pickle weight files to be unpickled (needed when the run's recipe sets model.allow_pickle).")


def code_optins(args: argparse.Namespace) -> dict:
    return dict(trust_remote_code=args.trust_remote_code, allow_pickle=args.allow_pickle)


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- merge
def _cmd_merge(args: argparse.Namespace) -> int:
    from finetuner.cli.progress import command_phases
    from finetuner.export.merge import merge_adapter

    from finetuner.children import stop_signals_abort

    _err(f"Merging {args.source} → {args.output} ({args.dtype}) ...")
    with stop_signals_abort(), command_phases():  # SIGTERM as Ctrl-C: the staging folder removed, then "aborted."
        r = merge_adapter(args.source, args.output, dtype=args.dtype, shard_size=args.shard_size, overwrite=args.overwrite,
                          base_model=args.base, verify=not args.no_verify, **code_optins(args))
    if args.json:
        print(json.dumps(r.to_dict(), default=str))
        return 0
    print(f"merged model: {r.output_dir}")
    print(f"  base        {r.base_model}")
    print(f"  weights     {r.weight_bytes / 2**20:.1f} MiB {r.dtype} in {r.shards} safetensors file(s)")
    if r.max_abs_diff is not None:
        print(f"  check       max |logit difference| vs adapter on base: {r.max_abs_diff:.3g} "
              f"(tolerance {r.tolerance:.3g}; the adapter itself moves logits by up to {r.adapter_effect or 0:.3g}; "
              f"top-1 agreement {r.top1_agreement:.0%}, {r.probe_tokens} tokens)")
    print(f"  peak RAM    {gib_text(r.peak_rss_bytes)} (process peak RSS), {duration_text(r.seconds)}")
    for note in r.notes:
        print(f"  note        {note}")
    print(f"Load it with: AutoModelForCausalLM.from_pretrained({str(r.output_dir)!r})")
    return 0


# ---------------------------------------------------------------------- chat
def _gen(args: argparse.Namespace) -> dict:
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)


def _stream_to_stdout(pieces) -> str:
    """Write the pieces as they come, without the reply's leading and trailing whitespace."""
    text, pending = [], ""
    for piece in pieces:
        if not text:
            piece = piece.lstrip()
        body = piece.rstrip()
        if body:
            out = pending + body
            text.append(out)
            sys.stdout.write(out)
            sys.stdout.flush()
            pending = piece[len(body):]
        else:
            pending += piece
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(text)


def _answer(chat, messages: list[dict], **gen) -> str:
    """Stream the reply; offered tools (``--tools``), print its calls as JSON, one line each, when it makes any
    (:meth:`finetuner.infer.chat.ChatModel.tool_reply`), else its text."""
    if not chat.tools:
        return _stream_to_stdout(chat.stream(messages, **gen))
    reply = chat.tool_reply(messages, **gen)
    print(reply.shown(), flush=True)
    return reply.text


def _cmd_chat(args: argparse.Namespace) -> int:
    from finetuner.data.thinking import prompt_switches
    from finetuner.infer.chat import load_chat_model

    if args.compare and args.no_adapter:
        from finetuner.errors import UserError

        raise UserError("--compare needs the adapter; leave out --no-adapter.")
    interactive = args.prompt is None
    if interactive:
        _err(f"Loading {args.source} ...")
    chat = load_chat_model(args.source, adapter=not args.no_adapter, device=args.device, base_model=args.base,
                           **code_optins(args))
    if args.thinking:
        chat.switches = prompt_switches(chat.template, None, args.thinking)
    if args.tools:
        from finetuner.data.tools import tools_file

        chat.tools = tools_file(args.tools)
    if args.system is not None:
        chat.system = args.system or None
    elif chat.system:  # the run's own (finetuner.infer.loading.system_prompt): said, so that an answer is not a puzzle
        from finetuner.text import cut_words

        _err(f"system prompt: the run's, {cut_words(chat.system, 80)!r} (--system '' asks without it)")
    from finetuner.data.template_choice import FALLBACKS, choose

    if chat.template in FALLBACKS:  # said, as the plan said it (finetuner.data.template_choice)
        _err(f"chat template: {choose(None, chat.template).why}")
    compare = args.compare and chat.has_adapter
    if args.compare and not chat.has_adapter:
        _err("note: this model has no adapter, so there is no base model to compare with.")
    gen = _gen(args)
    if args.images:
        if interactive:
            from finetuner.errors import UserError

            raise UserError("--image goes with --prompt/-p (one question about the pictures).")
        gen["images"] = args.images
    if not interactive:
        msgs = [{"role": "user", "content": args.prompt}]
        if compare:
            print("base:")
            _answer(chat, msgs, adapter=False, **gen)
            print("\nfine-tuned:")
        _answer(chat, msgs, **gen)
        return 0

    tty = sys.stdin.isatty()
    save_history = _line_editing() if tty else None
    _err(f"{chat!r}\nType a message; /reset starts over, /quit ends (or Ctrl-D).")
    try:
        _chat_loop(chat, compare, gen, tty)
    finally:
        if save_history is not None:
            save_history()
    return 0


def _chat_loop(chat, compare: bool, gen: dict, tty: bool) -> None:
    """Read a line, stream the answer, until /quit, Ctrl-D or Ctrl-C at the prompt."""
    history: list[dict[str, str]] = []
    while True:
        try:
            line = input("you> " if tty else "")
        except EOFError:
            if tty:  # leave the shell's prompt on a line of its own
                sys.stdout.write("\n")
                sys.stdout.flush()
            break
        except KeyboardInterrupt:
            _err("")
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/quit", "/exit", "/q"):
            break
        if text == "/reset":
            history = []
            _err("(new conversation)")
            continue
        history.append({"role": "user", "content": text})
        try:
            if compare:
                sys.stdout.write("base> ")
                _answer(chat, history, adapter=False, **gen)
                sys.stdout.write("fine-tuned> ")
            else:
                sys.stdout.write("model> ")
            answer = _answer(chat, history, **gen)
        except KeyboardInterrupt:
            _err("\n(stopped)")
            history.pop()
            continue
        history.append({"role": "assistant", "content": answer})


#: Lines typed in `finetuner chat`, kept between sessions (Up recalls them).
HISTORY_FILE = "chat_history"
HISTORY_LINES = 1000


def _line_editing():
    """Turn on line editing and history for ``input()`` (the readline module), with the lines of
    earlier sessions from the cache folder; returns the function that saves them, or None where
    Python has no readline (Windows)."""
    try:
        import readline
    except ImportError:
        return None
    import os
    import stat
    import tempfile

    from finetuner.cachedir import FILE_MODE, cache_folder

    try:
        folder = cache_folder()  # private to this user, or refused before anything is read (finetuner.cachedir)
    except OSError as e:
        _err(f"note: no chat history this time: the cache folder cannot be made ({e.strerror or e}).")
        return None
    path = folder / HISTORY_FILE
    try:
        st = os.lstat(path)
    except OSError:  # no history yet: start without
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        _err(f"note: {path} is a link or not a file: it is not read, and is replaced by the history of this session.")
    elif st is not None:
        try:  # a regular file in a folder only this user can write: nothing can put a link there in between
            readline.read_history_file(path)
        except OSError:  # unreadable: start without
            pass
    readline.set_history_length(HISTORY_LINES)

    def save() -> None:
        """Written to a new file in the folder, then renamed over the name: a link there is replaced, never followed."""
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{HISTORY_FILE}.", suffix=".tmp")  # mode 0600
            os.close(fd)
            readline.write_history_file(tmp)
            os.chmod(tmp, FILE_MODE)
            os.replace(tmp, path)
        except OSError as e:
            if tmp is not None and os.path.lexists(tmp):
                os.unlink(tmp)
            _err(f"note: could not save the chat history to {path} ({e}).")

    return save


# ---------------------------------------------------------------------- eval
def _stored(args: argparse.Namespace, result, key: str):
    """``result`` written under ``key`` in the run's ``metrics.json`` (unless ``--no-write``): the run folder it was
    written in, or None (``--no-write``, or a source that is not a run folder)."""
    from finetuner.infer.evaluate import record_in_metrics
    from finetuner.infer.loading import resolve_source

    if args.no_write:
        return None
    run_dir = resolve_source(args.source, args.base, **code_optins(args)).run_dir
    if run_dir is not None:
        record_in_metrics(run_dir, result, key=key)
    return run_dir


def _cmd_general(args: argparse.Namespace) -> int:
    """``eval RUN --general``: the probe set answered by the base and the fine-tune (finetuner.infer.probe)."""
    from finetuner.cli.progress import command_phases
    from finetuner.infer.probe import probe_run

    _err(f"Answering the general probe set with {args.source}'s base model and its fine-tune ...")
    with command_phases():
        r = probe_run(args.source, probes=args.general or None, limit=args.limit, device=args.device, base_model=args.base,
                      **code_optins(args))
    run_dir = _stored(args, r, "general_probe")
    if args.json:
        print(json.dumps(r.to_dict(), default=str))
        return 0
    print(r.describe())
    for kind, k in r.by_kind.items():
        print(f"  {kind:<12} base {k['base_right']:>3} / {k['questions']:<3}  fine-tuned {k['fine_tuned_right']:>3} / {k['questions']}")
    for a in [a for a in r.answers if a["id"] in r.lost][:3]:
        print(f"\n{a['question']}\nbase:       {a['base'].strip()}\nfine-tuned: {a['fine_tuned'].strip()}")
    if run_dir is not None:
        print(f"\nwritten to {run_dir / 'metrics.json'} (key 'general_probe')")
    return 0


def _cmd_tasks(args: argparse.Namespace) -> int:
    """``eval RUN --tasks A,B``: lm-evaluation-harness on the base and the fine-tune (finetuner.infer.harness)."""
    from finetuner.infer.harness import evaluate_tasks

    _err(f"Scoring {args.source}'s base model and its fine-tune on {args.tasks} (lm-evaluation-harness) ...")
    r = evaluate_tasks(args.source, args.tasks, include_path=args.include_path, limit=args.limit,
                       num_fewshot=args.num_fewshot, batch_size=args.batch_size, device=args.device, base_model=args.base,
                       apply_chat_template=args.chat_template, replace_builtin_tasks=args.replace_builtin_tasks,
                       **code_optins(args))
    run_dir = _stored(args, r, "harness")
    if args.json:
        print(json.dumps(r.to_dict(), default=str))
        return 0
    print(r.describe())
    print(r.table())
    if run_dir is not None:
        print(f"\nwritten to {run_dir / 'metrics.json'} (key 'harness')")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from finetuner.cli.plan import parse_columns
    from finetuner.cli.progress import command_phases
    from finetuner.errors import UserError
    from finetuner.infer.evaluate import evaluate_run

    if args.general is not None and args.tasks:
        raise UserError("eval: --general and --tasks are two runs; give one of them.")
    if args.general is not None:
        return _cmd_general(args)
    if args.tasks:
        return _cmd_tasks(args)
    for flag in ("include_path", "num_fewshot", "replace_builtin_tasks"):
        if getattr(args, flag) not in (None, False):
            raise UserError(f"eval: --{flag.replace('_', '-')} goes with --tasks.")
    columns = parse_columns(args.columns, args.data)
    _err(f"Evaluating {args.source} ...")
    with command_phases():
        r = evaluate_run(args.source, data=args.data, exact_match=args.exact_match, batch_size=args.batch_size,
                         device=args.device, base_model=args.base, write=not args.no_write, columns=columns or None,
                         **code_optins(args))
    if args.json:
        print(json.dumps(r.to_dict(), default=str))
        return 0
    print(f"{r.describe()} ({r.fine_tuned.tokens} scored tokens)")
    print(r.table())
    for s in r.samples[:2]:
        first = f"reference:  {s['reference'].strip()}" if "reference" in s else f"prompt:     {s['prompt'].strip()}"
        print(f"\n{first}\nbase:       {s['base'].strip()}\nfine-tuned: {s['fine_tuned'].strip()}")
    if not args.no_write:
        from finetuner.infer.loading import resolve_source

        run_dir = resolve_source(args.source, args.base, **code_optins(args)).run_dir
        if run_dir is not None:
            print(f"\nwritten to {run_dir / 'metrics.json'} (key 'evaluation')")
    return 0
