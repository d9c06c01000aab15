"""Where the UI finds models, data, recipes and runs: anchored on the checkout, not the cwd."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from finetuner.data import scope
from finetuner.errors import UserError
from finetuner.fileio import expand_user, exists, file_digest
from finetuner.locate import locate
from finetuner.runs.jobs import default_runs_dir, repo_root
from finetuner.config.sections import DATA_EXTENSIONS

ROOT = repo_root()
DATA_DIR = ROOT / "data"
UPLOAD_DIR = DATA_DIR / "uploads"
RECIPES_DIR = ROOT / "recipes"
DEMO_MODEL = DATA_DIR / "demo_model"
#: Uploads larger than this are refused (``finetuner ui --max-upload-mb`` changes it): the browser
#: sends the whole file to the UI process, which stores it twice (gradio's copy, then ours) and
#: reads it whole to preview it. 512 MiB holds instruction sets of a million short rows (Alpaca's
#: 52k rows are 22 MB); a larger file is better given by its path, which copies nothing.
MAX_UPLOAD_BYTES = 512 * 2**20
#: the hosts that serve this machine only (any other ``--host`` limits data files to ``--data-dir`` folders)
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def runs_dir_default() -> Path:
    return default_runs_dir()


def display(path: str | Path) -> str:
    """A path relative to the checkout when it is inside it (short and readable), else absolute."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(ROOT))
    except ValueError:
        return str(p)


def resolve_local(text: str) -> Path | None:
    """An existing file or folder named by ``text``: relative to the checkout, else as given."""
    t = (text or "").strip()
    if not t:
        return None
    for cand in (ROOT / t, expand_user(t)):
        if exists(cand):
            return cand.resolve()
    return None


def resolve_model(text: str) -> str:
    """A local model folder or file as an absolute path; a preset or hub id unchanged; a local path
    that does not exist: a :class:`UserError` with near matches (:func:`finetuner.locate.locate`). Within the
    UI's scope, a local path outside it is its one refusal, whatever is there (:func:`finetuner.data.scope.local`)."""
    t = (text or "").strip()
    return str(locate(scope.local(t, "Model", [ROOT], hub=True, kind="models"), "Model", [ROOT])) if t else t


def resolve_data(text: str) -> str:
    """A data file as an absolute path, or a hub data set id; a missing file: a :class:`UserError`."""
    t = (text or "").strip()
    return str(locate(t, "Data file", [ROOT])) if t else t


def resolve_reward_file(text: str, function: str) -> str:
    """A reward function's file as an absolute path, found as a data file is (relative to the checkout,
    then the current folder); one found nowhere: a :class:`UserError` saying where it was looked for,
    with near matches. Within the UI's scope, a path outside it is its one refusal, whatever is there."""
    what = f"reward '{function}'"
    return str(locate(scope.local(text.strip(), what, [ROOT], kind="reward files"), what, [ROOT], hub=False))


def local_models() -> list[str]:
    """Model folders shipped in or added to ``data/`` (those with a config.json)."""
    if not DATA_DIR.is_dir():
        return []
    return sorted(display(p.parent) for p in DATA_DIR.glob("*/config.json"))


def data_files(upload_dir: str | Path | None = None) -> list[str]:
    """Data files under ``data/`` and in ``upload_dir`` (where the UI stores uploads, which may be
    elsewhere): paths relative to the checkout when inside it, else absolute."""
    found: list[Path] = []
    if DATA_DIR.is_dir():
        found += [
            p for p in DATA_DIR.rglob("*")
            if p.is_file() and p.suffix.lower() in DATA_EXTENSIONS
            and "demo_model" not in p.parts and not any(part.startswith(".") for part in p.relative_to(DATA_DIR).parts)
            and p.name not in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
        ]
    up = Path(upload_dir) if upload_dir else None
    if up is not None and up.is_dir():
        found += [p for p in up.iterdir() if p.is_file() and p.suffix.lower() in DATA_EXTENSIONS and not p.name.startswith(".")]
    return sorted({display(p) for p in found})


def recipe_files() -> list[str]:
    return sorted(display(p) for p in RECIPES_DIR.glob("*.yaml")) if RECIPES_DIR.is_dir() else []


def sanitize_filename(name: str) -> str:
    """The last path component of ``name`` with only ``[A-Za-z0-9._-]``; no leading dot."""
    base = re.split(r"[\\/]", name or "")[-1]
    stem, dot, ext = base.rpartition(".")
    if not dot:
        stem, ext = base, ""
    stem = re.sub(r"[^A-Za-z0-9_-]+", "_", stem).strip("._-")[:80] or "upload"
    ext = re.sub(r"[^A-Za-z0-9]+", "", ext).lower()[:10]
    return f"{stem}.{ext}" if ext else stem


def same_content(src: Path, dest_dir: Path) -> Path | None:
    """A file in ``dest_dir`` whose bytes are those of ``src`` (sizes first, then SHA-256), if any."""
    if not dest_dir.is_dir():
        return None
    size = src.stat().st_size
    candidates = sorted(p for p in dest_dir.iterdir() if p.is_file() and not p.name.startswith(".") and p.stat().st_size == size)
    if not candidates:
        return None
    digest = file_digest(src)
    return next((p for p in candidates if file_digest(p) == digest), None)


def upload_too_large(name: str, size: int, limit: int) -> UserError:
    """The refusal of an upload over ``limit`` bytes: the limit, and how to use the file anyway."""
    return UserError(
        f"'{name}' is {size / 2**20:,.1f} MiB: the UI takes uploads up to {limit / 2**20:g} MiB.",
        hint="Put the file on this machine (e.g. in data/) and type its path in the Data file box, or train from "
             "the command line (finetuner run with data.path set to it); or start the UI with a larger limit "
             "(finetuner ui --max-upload-mb N).",
    )


def save_upload(tmp_path: str | Path, original_name: str | None = None, dest_dir: Path = UPLOAD_DIR,
                max_bytes: int = MAX_UPLOAD_BYTES) -> tuple[Path, bool]:
    """Store an uploaded file in the app's upload folder under a sanitised name.

    The same content uploaded again is the file already stored (whatever its name then); another
    file with a name already taken gets ``name-2``, ``name-3``... (nothing is overwritten).
    Returns the stored path and whether it was new.
    """
    src = Path(tmp_path)
    name = sanitize_filename(original_name or src.name)
    if Path(name).suffix.lower() not in DATA_EXTENSIONS:
        raise UserError(
            f"'{original_name or src.name}' is not a data file finetuner reads.",
            hint=f"Upload one of: {', '.join(DATA_EXTENSIONS)}.",
        )
    if src.stat().st_size > max_bytes:
        raise upload_too_large(original_name or src.name, src.stat().st_size, max_bytes)
    dest_dir = Path(dest_dir)
    known = same_content(src, dest_dir)
    if known is not None:
        return known, False
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / name
    stem, suffix, i = dest.stem, dest.suffix, 1
    while dest.exists():
        i += 1
        dest = dest_dir / f"{stem}-{i}{suffix}"
    if dest.resolve().parent != dest_dir.resolve():  # cannot happen after sanitising; never write elsewhere
        raise UserError(f"Refusing to store the upload '{original_name}' outside {dest_dir}.")
    shutil.copyfile(src, dest)
    return dest, True
