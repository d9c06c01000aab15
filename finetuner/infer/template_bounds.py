"""A task folder's templates rendered with bounded memory and time.

lm-evaluation-harness renders every ``doc_to_text``/``doc_to_choice``/``doc_to_target``/``gen_prefix`` template of a
task once a document. jinja2's own ``SandboxedEnvironment`` stops a template reaching Python's objects, but not its
size or its time: ``{{ 'A' * 3000000000 }}`` took 12.4 GB, and two nested ``range(100000)`` loops (10 billion turns,
each range under the sandbox's ``MAX_RANGE``) never end. :class:`BoundedSandbox` bounds what one render may build:

- a text or list built by ``*``, ``+`` or ``%`` (its *weight*: characters, and items plus the weight of each item, so
  ``[s] * n`` weighs ``n`` times ``s``), and what any call or filter returns: at most :data:`MAX_CHARS`;
  an integer argument of a call or filter (``center(3000000000)``, ``lipsum(n)``, a width in a ``%`` or
  ``str.format`` spec) at most :data:`MAX_CHARS`, a power at most :data:`MAX_POWER_BITS` bits;
- the items of all the ``range()`` calls of a render together: :data:`MAX_RANGE_ITEMS`;
- the text a render writes: :data:`MAX_CHARS`; its time: :data:`RENDER_SECONDS` (a timer in the main thread, the
  clock read at every call otherwise); its memory: :data:`RENDER_MEMORY` more address space than the process had
  when the render began (``RLIMIT_AS``, lowered for the render only, on Linux; a ``MemoryError`` is the bound).

Real templates stay far below each: a prompt of a few thousand characters, a ``range`` over a handful of choices.
Over a bound, rendering raises :class:`TemplateBound` with the template's text, which the caller names by its task
file and key (:func:`finetuner.infer.task_folder.template_keys`).
"""

from __future__ import annotations

import math
import re
import signal
import threading
import time
from typing import Any

from jinja2.environment import Template
from jinja2.sandbox import SandboxedEnvironment

#: the most characters (or weight, module doc) of a value a template builds, of a call's result, of a render's text;
#: long-context tasks' documents (tens of thousands of words) render well within it
MAX_CHARS = 10_000_000
#: the most items all the ``range()`` calls of one render may give together (jinja2's own sandbox allows 100,000
#: for each call, without limit on how many)
MAX_RANGE_ITEMS = 1_000_000
#: the most bits of a power an expression computes (``9 ** 9 ** 9`` has 1.2 billion)
MAX_POWER_BITS = 100_000
#: the most seconds one render may take (a real one takes microseconds)
RENDER_SECONDS = 10.0
#: the most memory (address space) one render may add: 2 GiB
RENDER_MEMORY = 2 * 2**30

_SEQUENCES = (str, bytes, list, tuple)
_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(\d+|\*)?(?:\.(\d+|\*))?")
_FORMAT_NUMBER = re.compile(r"\d+")


class TemplateBound(Exception):
    """A render passed a bound: ``what`` says which, ``source`` is the template's text."""

    def __init__(self, what: str, source: str | None = None):
        super().__init__(what)
        self.what, self.source = what, source


def weight(value: Any, limit: int = MAX_CHARS) -> int:
    """The characters of a text, or the items and the weight of each item of a list (walked without recursion,
    stopping once past ``limit``); 1 for anything else."""
    total, stack = 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, (str, bytes)):
            total += len(v)
        elif isinstance(v, (list, tuple, set, frozenset, dict)):
            total += len(v)
            stack.extend(v.values() if isinstance(v, dict) else v)
        else:
            total += 1
    return total


class _Render:
    """The bounds' state of the render running in this thread."""

    def __init__(self, source: str | None):
        self.source, self.range_items = source, 0
        self.deadline = time.monotonic() + RENDER_SECONDS


_state = threading.local()


def _current() -> _Render | None:
    return getattr(_state, "render", None)


def _over(what: str) -> TemplateBound:
    render = _current()
    return TemplateBound(what, render.source if render else None)


def _tick() -> None:
    render = _current()
    if render is not None and time.monotonic() > render.deadline:
        raise _over(f"a render took over {RENDER_SECONDS:g} s")


def _check_weight(value: Any, what: str) -> Any:
    if isinstance(value, (str, bytes, list, tuple, set, frozenset, dict)) and weight(value) > MAX_CHARS:
        raise _over(f"{what} is over {MAX_CHARS:,} characters")
    return value


#: the calls and filters whose numbers are sizes (a width, a count): the numbers given to them are bounded; a number
#: a template formats or computes with (a population, a year) is not
SIZED = {"center", "ljust", "rjust", "zfill", "expandtabs", "indent", "wordwrap", "truncate", "batch", "slice",
         "generate_lorem_ipsum", "lipsum", "range"}


def _check_ints(args: tuple, kwargs: dict, what: str) -> None:
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_CHARS:
            raise _over(f"{what} is given the number {v:,}, over {MAX_CHARS:,}")


def _check_printf(fmt: str, right: Any) -> None:
    """A ``%`` format's widths and precisions (and ``*`` ones given as arguments)."""
    starred = False
    for m in _PRINTF_SPEC.finditer(fmt):
        for n in m.groups():
            starred = starred or n == "*"
            if n and n != "*" and int(n) > MAX_CHARS:
                raise _over(f"a % format asks for a width of {int(n):,}, over {MAX_CHARS:,}")
    if starred:  # a width given as an argument: ``'%*d' % (3000000000, 1)``
        _check_ints(tuple(v for v in (right if isinstance(right, tuple) else (right,)) if isinstance(v, int)), {},
                    "a % format's width")


def _check_format_spec(fmt: str) -> None:
    """The numbers in a ``str.format`` string's fields (``{:>3000000000}``)."""
    for field in re.findall(r"\{[^{}]*\}", fmt):
        for n in _FORMAT_NUMBER.findall(field):
            if len(n) > 8 or int(n) > MAX_CHARS:
                raise _over(f"a format field {field[:40]} asks for {n[:20]}, over {MAX_CHARS:,}")


def bounded_range(*args: int) -> range:
    """``range`` whose items, over all the calls of one render, are at most :data:`MAX_RANGE_ITEMS`."""
    _tick()
    rng = range(*args)
    render = _current()
    if render is not None:
        render.range_items += len(rng)
        if render.range_items > MAX_RANGE_ITEMS:
            raise _over(f"the range() calls of one render give over {MAX_RANGE_ITEMS:,} items")
    elif len(rng) > MAX_RANGE_ITEMS:
        raise _over(f"range() gives {len(rng):,} items, over {MAX_RANGE_ITEMS:,}")
    return rng


def _bounded_filter(name: str, fn: Any) -> Any:
    from functools import wraps

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _tick()
        if name in SIZED:
            _check_ints(args, kwargs, f"the filter {name}")
        texts = [a for a in args if isinstance(a, str)]  # jinja2 passes some filters its eval context first
        if name == "replace" and len(texts) >= 3:
            _check_replace(*texts[:3])
        if name == "format" and texts:
            _check_printf(texts[0], tuple(args[args.index(texts[0]) + 1:]))
        return _check_weight(fn(*args, **kwargs), f"what the filter {name} returns")

    return wrapper


def _check_replace(text: Any, old: Any, new: Any) -> None:
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
        count = len(text) + 1 if not old else text.count(old)
        if len(text) + count * (len(new) - len(old)) > MAX_CHARS:
            raise _over(f"a replace() would make over {MAX_CHARS:,} characters")


class BoundedTemplate(Template):
    """A template whose :meth:`render` is bounded (module doc)."""

    _bounded_source: str | None = None

    def render(self, *args: Any, **kwargs: Any) -> str:
        ctx = self.new_context(dict(*args, **kwargs))
        outer = _current()
        _state.render = render = _Render(self._bounded_source)
        try:
            with _limits(render):
                parts, size = [], 0
                for part in self.root_render_func(ctx):
                    size += len(part)
                    if size > MAX_CHARS:
                        raise _over(f"the rendered text is over {MAX_CHARS:,} characters")
                    parts.append(part)
                return "".join(parts)
        except TemplateBound:
            raise
        except MemoryError:
            raise TemplateBound(f"a render needed over {RENDER_MEMORY // 2**30} GiB of memory", render.source) from None
        except RecursionError:
            raise TemplateBound("the template recursed too deeply", render.source) from None
        except Exception:
            self.environment.handle_exception()
        finally:
            _state.render = outer


class _limits:
    """While a render lasts: a timer that raises :class:`TemplateBound` (the main thread only: Python runs signal
    handlers there) and the address space capped at what the process has + :data:`RENDER_MEMORY` (soft limit,
    Linux; put back after)."""

    def __init__(self, render: _Render):
        self.render, self.old_handler, self.old_limit = render, None, None
        self.old_timer, self.began = (0.0, 0.0), time.monotonic()

    def __enter__(self) -> None:
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
            def expired(_signum, _frame):
                raise TemplateBound(f"a render took over {RENDER_SECONDS:g} s", self.render.source)

            pending = signal.getitimer(signal.ITIMER_REAL)
            if not (0 < pending[0] <= RENDER_SECONDS):  # an earlier alarm someone set (a test's guard) is left be
                self.old_handler = signal.signal(signal.SIGALRM, expired)
                self.old_timer = signal.setitimer(signal.ITIMER_REAL, RENDER_SECONDS)
        try:
            import resource

            soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            with open("/proc/self/statm") as f:
                size = int(f.read().split()[0]) * resource.getpagesize()
            cap = size + RENDER_MEMORY
            if (soft == resource.RLIM_INFINITY or cap < soft) and (hard == resource.RLIM_INFINITY or cap <= hard):
                resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
                self.old_limit = (soft, hard)
        except (ImportError, OSError, ValueError):
            pass  # no RLIMIT_AS here: the other bounds still hold

    def __exit__(self, *exc: Any) -> None:
        if self.old_limit is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, self.old_limit)
        if self.old_handler is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.old_handler)
            delay, interval = self.old_timer
            if delay > 0:  # the alarm that was pending, for the time it had left
                signal.setitimer(signal.ITIMER_REAL, max(delay - (time.monotonic() - self.began), 0.001), interval)


class BoundedSandbox(SandboxedEnvironment):
    """jinja2's ``SandboxedEnvironment`` with the bounds of the module doc."""

    template_class = BoundedTemplate
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.globals["range"] = bounded_range
        self.filters = _BoundedFilters(self.filters)

    def from_string(self, source: Any, globals: Any = None, template_class: Any = None) -> Template:
        template = super().from_string(source, globals, template_class)
        if isinstance(source, str):
            template._bounded_source = source
        return template

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _tick()
        if operator == "*":
            seq, n = (left, right) if isinstance(left, _SEQUENCES) else (right, left)
            if isinstance(seq, _SEQUENCES) and isinstance(n, int) and n > 0 and weight(seq) * n > MAX_CHARS:
                raise _over(f"'*' would make over {MAX_CHARS:,} characters")
        elif operator == "+":
            if isinstance(left, _SEQUENCES) and isinstance(right, _SEQUENCES) and weight(left) + weight(right) > MAX_CHARS:
                raise _over(f"'+' would make over {MAX_CHARS:,} characters")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0 and \
                    right * math.log2(abs(left)) > MAX_POWER_BITS:
                raise _over(f"'**' would make a number of over {MAX_POWER_BITS:,} bits")
        elif operator == "%" and isinstance(left, str):
            _check_printf(left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja2's names
        _tick()
        if getattr(__obj, "__name__", None) in SIZED:
            _check_ints(args, kwargs, f"{__obj.__name__}()")
        if getattr(__obj, "__name__", None) == "replace" and isinstance(getattr(__obj, "__self__", None), str) \
                and len(args) >= 2:
            _check_replace(__obj.__self__, args[0], args[1])
        return _check_weight(super().call(__context, __obj, *args, **kwargs), "what a call returns")

    def wrap_str_format(self, value: Any) -> Any:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt = value.__self__

        def checked(*args: Any, **kwargs: Any) -> str:
            _check_format_spec(fmt)
            return wrapped(*args, **kwargs)

        return checked

    def getattr(self, obj: Any, attribute: str) -> Any:
        _tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _tick()
        return super().getitem(obj, argument)


class _BoundedFilters(dict):
    """The environment's filters, each bounded as it is looked up (the harness adds ``regex_replace`` after)."""

    def __getitem__(self, name: str) -> Any:
        return _bounded_filter(name, super().__getitem__(name))

    def get(self, name: str, default: Any = None) -> Any:
        return self[name] if name in self else default
