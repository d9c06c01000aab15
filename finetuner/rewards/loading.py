"""Load a reward function from a Python file a recipe names.

Loading a file runs it: its top-level code executes in this process, with the user's rights. Naming the
file in one's own recipe is the opt-in. A recipe read back from a run folder may come from someone else, so
a caller that loads one passes ``allow_code=False`` unless the user opted in on the command
(``--trust-remote-code``, as :func:`finetuner.infer.loading.check_code_optin` does for a model's code):
the file is then refused before anything in it runs. Within the web UI's scope (a job a served UI started:
:mod:`finetuner.data.scope`) the file must also be a ``.py`` file inside it and not one the page sent
(:func:`finetuner.data.scope.code_file`), decided before the file is looked at.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path

from finetuner.data import scope
from finetuner.errors import UserError, did_you_mean, first_line

#: The signature a reward function has (TRL's).
SIGNATURE = "def NAME(prompts, completions, **kwargs) -> list[float]"


def _module_name(path: Path) -> str:
    """A module name per file and version: an edited file (another modification time or size) is run again."""
    st = path.stat()
    return "finetuner_rewards_" + hashlib.sha1(f"{path}\0{st.st_mtime_ns}\0{st.st_size}".encode()).hexdigest()[:12]


def _error_line(error: BaseException, path: Path) -> str:
    """Where in ``path`` the error was raised (``line N``), if the traceback passes through it."""
    if isinstance(error, SyntaxError) and error.lineno:
        return f" (line {error.lineno})"
    tb, line = error.__traceback__, None
    while tb is not None:
        if Path(tb.tb_frame.f_code.co_filename) == path:
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" (line {line})" if line else ""


def load_module(path: str | Path, *, where: str = "grpo.rewards", allow_code: bool = True):
    """Run the Python file ``path`` as a module and return it (a file already loaded, unchanged since, is
    not run again). While it runs, its folder is first on ``sys.path``, as for ``python path``, so that it
    can import the modules next to it. ``where``: the recipe key naming it, for messages. Raises
    :class:`UserError` when the file is missing, is refused (``allow_code=False``) or fails while it runs."""
    if scope.current() is not None:  # a job the web UI started: only where its page may run code from
        path = scope.code_file(path, f"{where}: the reward file")
    p = Path(path).expanduser().resolve()
    if not p.is_file():
        raise UserError(f"{where}: the reward file {path} does not exist.",
                        hint="Give the path of a Python file that defines the function (relative paths are read "
                             "from the recipe's folder).")
    if not allow_code:
        raise UserError(f"{where}: the reward file {p} is Python code that would run on this machine; add "
                        "--trust-remote-code to allow it.", hint="Only for a file you trust (Python: trust_remote_code=True).")
    name = _module_name(p)
    if name in sys.modules:
        return sys.modules[name]
    loader = importlib.machinery.SourceFileLoader(name, str(p))
    spec = importlib.util.spec_from_loader(name, loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(p.parent))
    try:
        loader.exec_module(module)
    except Exception as e:  # the user's code: any error is theirs to fix
        del sys.modules[name]
        raise UserError(f"{where}: the reward file {p} failed while loading{_error_line(e, p)}: "
                        f"{type(e).__name__}: {first_line(str(e))}",
                        hint="Fix the file; it must run on its own (python " + str(p) + ").") from None
    finally:
        sys.path.remove(str(p.parent))
    return module


def load_reward_function(path: str | Path, name: str, *, where: str = "grpo.rewards",
                         allow_code: bool = True) -> Callable:
    """The function ``name`` defined in the Python file ``path`` (see :func:`load_module`), checked to
    be callable with TRL's keywords ``prompts`` and ``completions`` (:data:`SIGNATURE`)."""
    module = load_module(path, where=where, allow_code=allow_code)
    p = Path(module.__file__)
    if not hasattr(module, name):
        defined = [k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                   and getattr(v, "__module__", None) == module.__name__]
        suggestion = did_you_mean(name, defined) if defined else " It defines no function."
        raise UserError(f"{where}: {p} has no function '{name}'.{suggestion}",
                        hint=f"Define it there as {SIGNATURE.replace('NAME', name)}, or name one it defines.")
    fn = getattr(module, name)
    if not callable(fn):
        raise UserError(f"{where}: '{name}' in {p} is a {type(fn).__name__}, not a function.",
                        hint=f"Define it as {SIGNATURE.replace('NAME', name)}.")
    check_signature(fn, f"{where}: '{name}' in {p}")
    return fn


def check_signature(fn: Callable, what: str) -> None:
    """Refuse a function that cannot take ``prompts=`` and ``completions=`` as keywords (TRL calls
    reward functions that way), or that needs a positional argument besides them."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function: checked when called
        return
    params = sig.parameters.values()
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    missing = [k for k in ("completions",) if k not in named and not takes_any]
    positional_only = [p.name for p in params if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if missing or positional_only:
        raise UserError(f"{what} takes ({', '.join(str(p) for p in params)}): a reward function is called with the "
                        "keywords prompts, completions and the data's columns.",
                        hint=f"Define it as {SIGNATURE.replace('NAME', getattr(fn, '__name__', 'fn'))}.")
