"""A run whose adapter file was cut short (a copy interrupted, a disk that filled) is one line naming the file, exit
2, from ``chat`` and ``merge`` alike (one loader: :func:`finetuner.infer.loading.attach_adapter`), never
safetensors' own error or a traceback. The web UI's Chat tab says the same: tests/ui/test_ui_chat_browser.py."""

from __future__ import annotations

import pytest

from tests.conftest import cli_in_process, demo_run_folder


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    run = demo_run_folder(tmp_path_factory.mktemp("runs"), "damaged", adapter=True)
    weights = run / "adapter" / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    return run


@pytest.mark.parametrize("command", [["chat", "{run}", "-p", "Hello", "--max-new-tokens", "4"],
                                     ["merge", "{run}", "-o", "{out}"]])
def test_a_truncated_adapter_file_is_one_line_naming_it(damaged, tmp_path, command):
    r = cli_in_process(*(a.format(run=damaged, out=tmp_path / "merged") for a in command))
    said = r.stdout + r.stderr
    assert r.returncode == 2, said
    assert f"{damaged / 'adapter' / 'adapter_model.safetensors'} is truncated or corrupt" in said, said
    assert "Traceback" not in said and "SafetensorError" not in said, said
    assert not (tmp_path / "merged").exists()
