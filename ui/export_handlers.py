"""What the Export tab does: merge a run into its base model, write a GGUF or Ollama model, zip the
adapter. Each export runs in a process of its own. A mixin of :class:`ui.handlers.Handlers`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
from pathlib import Path

import gradio as gr

from finetuner.data import scope
from finetuner.errors import UserError
from ui import paths
from ui.errors import error_md, shows_errors



def _waiting(head: str, job):
    """``head`` while a worker's :class:`~finetuner.export.worker.Job` runs, with its latest phase's line below it
    (:func:`finetuner.phases.line`: loading, merging, writing, checking, with a count and an ETA)."""
    from finetuner import phases

    yield head
    for rec in job:
        yield f"{head}\n\n{phases.line(rec)}"



class ExportHandlers:
    """The Export tab's handlers (a part of :class:`ui.handlers.Handlers`)."""

    def output_path(self, out: str | None, default: Path, what: str) -> Path:
        """Where an export writes: ``default`` for an empty box, else the path typed (relative to the checkout); in a
        served UI only inside its runs folder (:attr:`write_scope`), one refusal elsewhere whatever is there
        (:func:`finetuner.data.scope.local`), decided before anything is looked at or made."""
        if not (out and out.strip()):
            return default
        if self.write_scope is not None:
            return Path(scope.local(out.strip(), what, [paths.ROOT], scope=self.write_scope, verb="writes", kind="exports",
                                    cwd=False, hint="Leave the box empty to write into the run's folder, or name a folder "
                                                    f"in {paths.display(self.runs)}."))
        target = Path(out.strip()).expanduser()
        return target if target.is_absolute() else paths.ROOT / target

    @shows_errors(0, 1)
    def on_merge(self, run: str, out: str, dtype: str, overwrite: bool, allow_code: bool = False):
        """Merge the run's adapter into its base model in another process (the UI never holds a
        model): :func:`finetuner.export.worker.merge_in_subprocess`. Its refusals (a file, a
        non-empty folder, a run folder) are shown as the merge words them."""
        from finetuner.export.merge import MergeResult
        from finetuner.export.worker import merge_job

        self.confirm_code(run, bool(allow_code), rewards=False)
        rp = self.run_path(run)
        target = self.output_path(out, rp / "merged", "Output folder")
        job = merge_job(rp, target, dtype=dtype or "auto", overwrite=bool(overwrite),
                        trust_remote_code=bool(allow_code), allow_pickle=bool(allow_code))
        yield from _waiting(f"Merging {run} into its base model → `{paths.display(target)}` …", job)
        result = MergeResult.from_dict(job.result)
        files = result.files
        yield (f"✓ Merged model saved to `{paths.display(target)}` ({len(files)} files: {', '.join(files[:8])}"
               f"{'…' if len(files) > 8 else ''}) in {result.dtype}.\n\n"
               f"Load it with `AutoModelForCausalLM.from_pretrained(\"{target}\")`."
               + "".join(f"\n\n- {note}" for note in getattr(result, "notes", None) or []))  # what it forgot, too

    @shows_errors(0, 1)
    def on_gguf(self, run: str, fmt: str, quant: str, out: str, overwrite: bool, allow_code: bool = False):
        """Export the run to GGUF (or GGUF + an Ollama Modelfile) in another process:
        :func:`finetuner.export.worker.export_in_subprocess`; the file is checked against the merged
        model before it is put in place, and the page says how closely it matches."""
        from finetuner.export.worker import export_job

        self.confirm_code(run, bool(allow_code), rewards=False)
        rp = self.run_path(run)
        fmt, quant = fmt or "gguf", quant or "f16"
        default = rp / ("ollama" if fmt == "ollama" else f"{rp.name}-{quant}.gguf")
        target = self.output_path(out, default, "Output file or folder")
        job = export_job(rp, target, format=fmt, quant=quant, overwrite=bool(overwrite),
                         trust_remote_code=bool(allow_code), allow_pickle=bool(allow_code),
                         **({"ollama_name": rp.name} if fmt == "ollama" else {}))  # named after the run
        yield from _waiting(f"Exporting {run} to {fmt.upper() if fmt == 'gguf' else 'Ollama'} ({quant}) → "
                            f"`{paths.display(target)}` …", job)
        r = job.result
        lines = [f"✓ {r['quant']} GGUF saved to `{paths.display(Path(r['gguf_file']))}` "
                 f"({r['file_bytes'] / 2**20:.1f} MiB, {r['tensors']} tensors, {r['architecture']})."]
        if r.get("mmproj_file"):
            lines.append(f"Projector file for pictures (llama.cpp's `--mmproj`): `{paths.display(Path(r['mmproj_file']))}` "
                         f"({r['mmproj_bytes'] / 2**20:.1f} MiB, {r['mmproj_tensors']} tensors).")
        if r.get("max_abs_logit_diff") is not None:
            lines.append(f"Checked against the merged model with transformers' GGUF loader: largest logit difference "
                         f"{r['max_abs_logit_diff']:.2g}, top-1 agreement {r['top1_agreement']:.0%} "
                         f"on {r['probe_tokens']} tokens; the tokenizer gives the same ids on {r['tokenizer_texts']} texts.")
        if r.get("modelfile"):
            lines.append(f"Ollama Modelfile: `{paths.display(Path(r['modelfile']))}`. Create the model and chat with it:\n\n"
                         f"```\n{r['ollama_command']}\n{r.get('ollama_run') or ''}\n```")
        lines += [f"- {note}" for note in r.get("notes") or []]
        yield "\n\n".join(lines)

    def adapter_zip(self, run: str) -> Path:
        """The run's adapter folder as ``<run>-adapter.zip`` (rebuilt when the adapter is newer)."""
        rp = self.run_path(run)
        adapter = rp / "adapter"
        if not adapter.is_dir():
            raise UserError(f"{run} has no adapter yet.", hint="Finish training first (a stopped run has checkpoints only).")
        folder = self.temp_dir / "adapters" / hashlib.sha1(str(rp).encode()).hexdigest()[:12]
        archive = folder / f"{run}-adapter.zip"
        newest = max((p.stat().st_mtime for p in adapter.rglob("*")), default=adapter.stat().st_mtime)
        try:
            built_at = os.lstat(archive)  # the zip itself: a link put in its place is not one we built
            fresh = stat.S_ISREG(built_at.st_mode) and built_at.st_mtime >= newest
        except OSError:
            fresh = False
        if not fresh:
            folder.mkdir(parents=True, exist_ok=True)
            building = Path(tempfile.mkdtemp(dir=folder))
            try:
                built = shutil.make_archive(str(building / archive.stem), "zip", root_dir=adapter)
                os.replace(built, archive)  # whole or not at all, if two pages ask at once
            finally:
                shutil.rmtree(building, ignore_errors=True)
        return archive

    def on_zip(self, run: str | None):
        """The download button holds the chosen run's adapter zip (one click downloads it); a run
        without an adapter empties it and says why."""
        try:
            if not run:
                return gr.update(value=None, interactive=False), ""
            return gr.update(value=str(self.adapter_zip(run)), interactive=True), ""
        except Exception as e:  # noqa: BLE001
            return gr.update(value=None, interactive=False), error_md(e)
