"""What a fine-tune kept: the general probe set answered by the base model and by the fine-tune, scored without a
judge model.

The probe set (``data/general_probe.jsonl``, written for this project by ``scripts/dev/make_general_probe.py``)
holds short questions with checkable answers: facts, arithmetic, instructions. An answer is right when it holds
one of the accepted strings as a whole word (``contains``; case-insensitive unless the row says ``case``) or when
its first number is the accepted one (``numeric``). Both models answer greedily, one chat turn each, with the
run's chat template. Said as a "general knowledge check" (:func:`kept_words`): of the M questions the base answers
right, the fine-tune still answers N (M - N forgotten).
``finetuner eval RUN --general`` runs it (``--general FILE`` for another set in the same format).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import finetuner.phases as phases
from finetuner.errors import UserError

#: the probe set shipped with the project
PROBE_FILE = Path(__file__).resolve().parents[2] / "data" / "general_probe.jsonl"
#: tokens an answer may take (the set's answers are a word or a number; a sentence around them fits)
MAX_NEW_TOKENS = 24
#: questions answered together in one ``generate`` call (:meth:`~finetuner.infer.chat.ChatModel.greedy_replies`)
BATCH = 16
MATCHES = ("contains", "numeric")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


#: questions a run answers at its end when ``training.general_probe`` is not set: on a GPU, and on a CPU (where
#: one answer of SmolLM2-135M takes about a second on 2 cores)
DEFAULT_RUN_PROBES = 40
DEFAULT_CPU_RUN_PROBES = 16
#: the environment variable that sets another default (0: no probe at the end of runs)
RUN_PROBES_ENV = "FINETUNER_GENERAL_PROBE"


def run_probe_count(setting: int | None, cuda: bool = True) -> int:
    """How many probes a run answers at its end: ``training.general_probe``, else :data:`RUN_PROBES_ENV`, else
    :data:`DEFAULT_RUN_PROBES` (``cuda``) or :data:`DEFAULT_CPU_RUN_PROBES`."""
    import os

    if setting is not None:
        return setting
    raw = os.environ.get(RUN_PROBES_ENV, "").strip()
    if not raw:
        return DEFAULT_RUN_PROBES if cuda else DEFAULT_CPU_RUN_PROBES
    if not raw.isdigit():
        raise UserError(f"{RUN_PROBES_ENV}={raw!r}: a number of probes (0: none) is needed.")
    return int(raw)


def spread(items: list, n: int | None) -> list:
    """``n`` of ``items`` spread evenly over them, in order (every kind of question, not the first kind alone); all
    of them when ``n`` is None or not smaller."""
    if not n or n >= len(items):
        return list(items)
    return [items[(i * len(items)) // n] for i in range(n)]


def entry_of(result: ProbeResult) -> dict[str, Any]:
    """What ``metrics.json`` keeps of a probe (under ``general_probe``): everything but the answers themselves."""
    entry = result.to_dict()
    entry.pop("answers", None)
    entry["time"] = round(time.time(), 3)
    return entry


def kept_words(kept: int, base_right: int, questions: int | None = None, lost: list[str] | None = None) -> str:
    """What a probe measured, in words a first-time user reads without knowing the probe: how many general
    questions the base model answered right, and how many of those the fine-tune still answers right."""
    asked = f"of {questions} general questions" if questions else "of the general questions it asks"
    forgot = base_right - kept
    named = f": {', '.join(lost[:5])}{' ...' if len(lost) > 5 else ''}" if lost and forgot else ""
    return (f"general knowledge check: {asked}, the base model answered {base_right} right; after training, {kept} "
            f"of those are still right ({forgot} forgotten{named})")


def kept_line(probe: dict[str, Any] | None) -> str | None:
    """The summary's line of a stored probe: of the base's right answers, how many the fine-tune kept, and which it lost."""
    if not probe or not probe.get("questions"):
        return None
    if not probe.get("base_right"):
        return (f"general knowledge check: the base model answered none of {probe['questions']} general questions "
                "right, so training had nothing general to forget (a model that knows only its own corpus)")
    return kept_words(probe["kept"], probe["base_right"], probe["questions"], probe.get("lost"))


#: a fine-tune that keeps less than this share of the base's right answers is warned about before it is shipped
KEEP_WARNING = 0.8


def kept_note(run_dir: Path | None) -> str | None:
    """What a merge or an export says about the run's forgetting: the probe's result stored in its
    ``metrics.json`` (``eval --general``), with a warning below :data:`KEEP_WARNING`, or how to measure it. No
    block: the user decides. None for a folder that is not a run."""
    if run_dir is None:
        return None
    try:
        probe = json.loads((Path(run_dir) / "metrics.json").read_text(encoding="utf-8")).get("general_probe")
    except (OSError, ValueError, AttributeError):
        probe = None
    if not probe or not probe.get("base_right"):
        return f"what the fine-tune forgot is not measured: `finetuner eval {run_dir} --general` says it"
    share = probe["kept"] / probe["base_right"]
    text = f"{kept_words(probe['kept'], probe['base_right'], probe.get('questions'), probe.get('lost'))}, {share:.0%} kept"
    if share < KEEP_WARNING:
        return (f"warning: {text}, under {KEEP_WARNING:.0%}: it forgot general answers the base knew; ship it if that "
                "is what you want, or train with fewer epochs or general chats mixed in")
    return text


@dataclass(frozen=True)
class Probe:
    id: str
    kind: str
    question: str
    answers: tuple[str, ...]
    match: str = "contains"
    case: bool = False


def load_probes(path: str | Path | None = None) -> list[Probe]:
    """The probes of a JSONL file (default :data:`PROBE_FILE`); a bad row is a UserError naming the file and row."""
    path = Path(path).expanduser() if path else PROBE_FILE
    if not path.is_file():
        raise UserError(f"{path}: no such probe file.", hint="Give a JSONL file of probes, or leave --general empty for the "
                                                             "shipped set.")
    probes = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            answers = tuple(str(a) for a in row["answers"])
            probe = Probe(str(row["id"]), str(row.get("kind", "")), str(row["question"]), answers,
                          str(row.get("match", "contains")), bool(row.get("case", False)))
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"{path}, row {n}: not a probe ({type(e).__name__}: {e}).",
                            hint='A probe is {"id": ..., "question": ..., "answers": [...], "match": "contains" or '
                                 '"numeric"}.') from None
        if probe.match not in MATCHES or not answers:
            raise UserError(f"{path}, row {n}: match must be one of {', '.join(MATCHES)} and answers must not be empty.")
        probes.append(probe)
    if not probes:
        raise UserError(f"{path}: holds no probes.")
    return probes


def is_right(answer: str, probe: Probe) -> bool:
    """Whether ``answer`` answers ``probe`` (see the module docstring)."""
    if probe.match == "numeric":
        found = _NUMBER.search(answer.replace(",", ""))
        return found is not None and any(float(found.group()) == float(a) for a in probe.answers)
    flags = 0 if probe.case else re.IGNORECASE
    return any(re.search(rf"(?<![\w]){re.escape(a)}(?![\w])", answer, flags) for a in probe.answers)


@dataclass
class ProbeResult:
    """The probe set answered by the base and the fine-tune."""

    source: str
    probes: str
    questions: int
    base_right: int
    fine_tuned_right: int
    kept: int  # of the base's right answers, the fine-tune's still right
    lost: list[str] = field(default_factory=list)  # ids the base answered and the fine-tune no longer does
    gained: list[str] = field(default_factory=list)
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)
    answers: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    def describe(self) -> str:
        return (f"{kept_words(self.kept, self.base_right, self.questions, self.lost)}; the fine-tune answers "
                f"{self.fine_tuned_right} of the {self.questions} right in all ({Path(self.probes).name})")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def probe_run(run: str | Path, probes: str | Path | None = None, limit: int | None = None, device: str = "auto",
              base_model: str | None = None, trust_remote_code: bool = False, allow_pickle: bool = False) -> ProbeResult:
    """Answer the probe set with the run's base model and its fine-tune (the adapter attached and detached in one
    loaded model) and count what the fine-tune kept (``limit``: N probes spread over the set, :func:`spread`)."""
    from finetuner.infer.chat import load_chat_model

    chat = load_chat_model(run, device=device, base_model=base_model, trust_remote_code=trust_remote_code,
                           allow_pickle=allow_pickle)
    with phases.phase("probe", unit="answers"):  # its count said by probe_chat and counted by the chat model
        return probe_chat(chat, str(run), probes, limit)


def probe_chat(chat: Any, source: str, probes: str | Path | None = None, limit: int | None = None) -> ProbeResult:
    """:func:`probe_run` on a model already loaded (a :class:`~finetuner.infer.chat.ChatModel` with its adapter:
    the trainer's own, at the end of a run)."""
    began = time.perf_counter()
    items = spread(load_probes(probes), limit)
    answers, by_kind = [], {}
    asked = [[{"role": "user", "content": p.question}] for p in items]
    phases.expect(2 * len(asked))  # the base's answers, then the fine-tune's (a phase's count, when one is open)
    base_replies = chat.greedy_replies(asked, adapter=False, max_new_tokens=MAX_NEW_TOKENS, batch=BATCH)
    tuned_replies = chat.greedy_replies(asked, adapter=True, max_new_tokens=MAX_NEW_TOKENS, batch=BATCH)
    for p, base, tuned in zip(items, base_replies, tuned_replies):
        answers.append({"id": p.id, "question": p.question, "base": base, "fine_tuned": tuned,
                        "base_right": is_right(base, p), "fine_tuned_right": is_right(tuned, p)})
        k = by_kind.setdefault(p.kind or "other", {"questions": 0, "base_right": 0, "fine_tuned_right": 0})
        k["questions"] += 1
        k["base_right"] += answers[-1]["base_right"]
        k["fine_tuned_right"] += answers[-1]["fine_tuned_right"]
    return ProbeResult(
        source=source, probes=str(probes or PROBE_FILE), questions=len(items),
        base_right=sum(a["base_right"] for a in answers), fine_tuned_right=sum(a["fine_tuned_right"] for a in answers),
        kept=sum(a["base_right"] and a["fine_tuned_right"] for a in answers),
        lost=[a["id"] for a in answers if a["base_right"] and not a["fine_tuned_right"]],
        gained=[a["id"] for a in answers if a["fine_tuned_right"] and not a["base_right"]],
        by_kind=by_kind, answers=answers, seconds=round(time.perf_counter() - began, 2))
