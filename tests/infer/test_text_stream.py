"""No replacement character (U+FFFD) reaches a reader: byte tokens a model samples that are not
valid UTF-8 are dropped from streamed pieces (chat, the web UI, ``finetuner chat``) and from whole
answers, and a character split over several tokens still arrives whole."""

from __future__ import annotations

import pytest

from tests.conftest import corpus
from finetuner.infer.generate import REPLACEMENT_CHAR, clean_text, text_streamer


@pytest.fixture(scope="module")
def tokenizer():
    from finetuner.model.tiny_llama import train_bpe_tokenizer

    return train_bpe_tokenizer(corpus(), vocab_size=400)  # byte-level: every byte is a token


def _stream(tokenizer, ids: list[int]) -> list[str]:
    """The pieces a streamer hands out when ``ids`` are generated one by one after a prompt."""
    import torch

    streamer = text_streamer(tokenizer, timeout=5)
    streamer.put(torch.tensor([tokenizer.encode("hi", add_special_tokens=False)]))  # the prompt: skipped
    for i in ids:
        streamer.put(torch.tensor([[i]]))
    streamer.end()
    return list(streamer)


def test_invalid_bytes_never_stream_and_split_characters_arrive_whole(tokenizer):
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    euro = enc("€")
    assert len(euro) == 3  # E2 82 AC: three byte tokens (the corpus is ASCII: no merges)
    # a lead byte cut by a space, a lone continuation byte, a whole "€" over three tokens, and an
    # unfinished character at the end
    ids = enc("Tern") + euro[:2] + enc(" here") + euro[2:] + enc("! Pack") + euro + enc(" 5 maps") + euro[:1]
    plain = tokenizer.decode(ids)
    assert plain.count(REPLACEMENT_CHAR) == 3  # what a plain decode shows
    pieces = _stream(tokenizer, ids)
    assert pieces and not any(REPLACEMENT_CHAR in p for p in pieces)
    assert "".join(pieces) == "Tern here! Pack€ 5 maps" == clean_text(plain)


def test_a_model_that_samples_invalid_bytes_streams_clean_text(tokenizer, monkeypatch):
    """ChatModel.stream end to end (the engine of `finetuner chat` and the UI's chat worker): a
    model whose every answer is byte tokens that are not UTF-8, with characters between them."""
    import torch

    from finetuner.infer import generate as generate_mod
    from finetuner.infer.chat import ChatModel
    from finetuner.infer.loading import Source

    answer = tokenizer.encode("€", add_special_tokens=False)[:2] + tokenizer.encode(" map", add_special_tokens=False)
    answer += tokenizer.encode("€", add_special_tokens=False)[2:] + tokenizer.encode(" ok", add_special_tokens=False)

    class BytesModel(torch.nn.Module):
        """Generates ``answer`` token by token into the streamer, as transformers' generate does."""

        def generate(self, input_ids, streamer=None, **kwargs):
            streamer.put(input_ids[0])
            for i in answer:
                streamer.put(torch.tensor([i]))
            streamer.end()

    chat = ChatModel(BytesModel(), tokenizer, tokenizer.chat_template, "cpu", Source(path="bytes", kind="model", base_model="bytes"))
    msgs = [{"role": "user", "content": "What should I pack?"}]
    assert chat.reply(msgs, temperature=0) == "map ok"
    monkeypatch.setattr(generate_mod, "clean_text", lambda text: text)  # without the fix: U+FFFD shows
    assert chat.reply(msgs, temperature=0).count(REPLACEMENT_CHAR) == 2


@pytest.fixture(scope="module")
def byte_soup_model(tokenizer, tmp_path_factory):
    """A tiny model that samples every token alike (its output layer is zero): bytes that are not
    UTF-8 come up in almost every answer, between ordinary ones."""
    from finetuner.model.tiny_llama import tiny_llama

    model = tiny_llama(tokenizer, tie_word_embeddings=False)
    model.lm_head.weight.data.zero_()
    out = tmp_path_factory.mktemp("byte_soup")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_finetuner_chat_prints_no_replacement_character(byte_soup_model, monkeypatch):
    from tests.conftest import run_cli
    from finetuner.infer import generate as generate_mod
    from finetuner.infer.chat import load_chat_model

    gen = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 40}
    monkeypatch.setattr(generate_mod, "clean_text", lambda text: text)
    chat = load_chat_model(byte_soup_model)
    seed, answer = next((seed, a) for seed in range(8)
                        if REPLACEMENT_CHAR in (a := chat.reply([{"role": "user", "content": "hi"}], seed=seed, **gen)))
    monkeypatch.undo()
    r = run_cli("chat", str(byte_soup_model), "--prompt", "hi", "--seed", str(seed), "--temperature", "1",
                "--top-p", "1", "--max-new-tokens", "40")
    assert r.returncode == 0, r.stderr
    assert REPLACEMENT_CHAR not in r.stdout
    assert r.stdout.split() == clean_text(answer).split()  # the same answer, less the invalid bytes
