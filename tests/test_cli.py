"""`eaglet generate` / `eaglet chat` / `eaglet serve` flags through ``eaglet.cli.main``, on a tiny
Kimi-K2.5 echo target (with tokenizer and chat template) and its EAGLE-3 echo draft."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from runtime_utils import wait_until_healthy

import eaglet.demo_model
from eaglet import LLM, SamplingParams
from eaglet.cli import main
from eaglet.testing.checkpoints import write_deepseek_v3_checkpoint, write_tiny_tokenizer
from eaglet.testing.echo_checkpoints import echo_draft, echo_kimi_target
from eaglet.testing.images import make_image


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, Path]:
    target = echo_kimi_target(tmp_path_factory.mktemp("target"), alpha=2.0)
    write_tiny_tokenizer(target, 256, chat_style="kimi")
    return target, echo_draft(target, tmp_path_factory.mktemp("draft"), kind="mla", seed=5)


def _model_flags(checkpoint: tuple[Path, Path], speculative: bool = True) -> list[str]:
    target, draft = checkpoint
    flags = ["--model-path", str(target), "--dtype", "float32"]
    if speculative:
        flags += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft),
                  "--speculative-num-steps", "3", "--speculative-num-draft-tokens", "4", "--disable-speculative-adaptive"]
    return flags


def test_generate_prints_text_and_statistics(checkpoint, capsys) -> None:
    assert main(["generate", "Tell me a story.", "--max-new-tokens", "24", "--ignore-eos", *_model_flags(checkpoint)]) == 0
    out, err = capsys.readouterr()
    # The same request through the offline API (plain decoding) gives the same greedy text.
    llm = LLM(str(checkpoint[0]), dtype="float32", show_progress=False)
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a story."}], tokenize=False,
                                               add_generation_prompt=True)
    expected = llm.generate(prompt, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True))[0].text
    assert out == expected + "\n"
    stats = re.search(r"24 tokens in [\d.]+ s \(([\d.]+) tokens/s\).*accept length ([\d.]+) over (\d+) verify steps "
                      r"\((\d+) accepted draft tokens\)", err)
    assert stats is not None, err
    accept_length, verify_steps, accepted = float(stats[2]), int(stats[3]), int(stats[4])
    assert float(stats[1]) > 0 and verify_steps > 0
    assert accept_length == pytest.approx((accepted + verify_steps) / verify_steps, abs=0.005)


def test_generate_with_images_and_without_speculation(checkpoint, tmp_path, capsys) -> None:
    paths = []
    for i, fmt in enumerate(("png", "jpeg")):
        paths += ["--image", str(tmp_path / f"image{i}.{fmt}")]
        make_image(24, 20, i).save(paths[-1])
    args = ["generate", "What is this?", "--max-new-tokens", "8", *paths, *_model_flags(checkpoint, speculative=False)]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "tokens/s" in err and "accept length" not in err


def test_chat_keeps_history_and_attaches_images(checkpoint, tmp_path, monkeypatch, capsys) -> None:
    image = tmp_path / "cat.png"
    make_image(16, 16, 3).save(image)
    lines = iter(["Hello!", f"/image {image}", "/image /no/such/file.png", "What is in the picture?", "/quit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "--max-new-tokens", "6", *_model_flags(checkpoint)]) == 0
    out, err = capsys.readouterr()
    assert len(out.strip().splitlines()) >= 1
    assert err.count("tokens/s") == 2  # two replies
    assert "image attached" in err and "cannot read image" in err  # a bad path is reported, the chat goes on


@pytest.mark.parametrize(
    "argv,message",
    [
        (["generate", "hi", "--speculative-num-steps", "0"], "expected a positive integer"),
        (["generate", "hi", "--dtype", "float64"], "invalid choice"),
        (["generate", "hi", "--speculative-algorithm", "MEDUSA"], "invalid choice"),
        (["serve", "--port", "http"], "invalid int value"),
        (["generate"], "the following arguments are required: prompt"),
    ],
)
def test_bad_flags_are_argparse_errors(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_inconsistent_flags_exit_with_a_message(checkpoint, tmp_path, monkeypatch) -> None:
    target, draft = checkpoint
    text_model = write_deepseek_v3_checkpoint(tmp_path / "text-model", with_tokenizer=True)
    image = tmp_path / "image.png"
    make_image(8, 8, 0).save(image)
    cases = [
        (["--model-path", str(text_model), "--image", str(image)], "no vision tower"),
        (["--model-path", str(target), "--speculative-algorithm", "EAGLE3"], "needs --speculative-draft-model-path"),
        (["--model-path", str(target), "--speculative-draft-model-path", str(draft)], "needs --speculative-algorithm"),
        (["--model-path", str(tmp_path / "missing")], "cannot load the model"),
        (["--model-path", str(target), "--image", str(tmp_path / "missing.png")], "cannot read image"),
        (["--model-path", str(text_model), "--activation-quantization", "int8"], "add --quantization int4"),
        (["--model-path", str(text_model), "--quantized-layers", "all"], "needs a quantization (int4)"),
    ]
    for flags, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(["generate", "hi", "--dtype", "float32", *flags])
        assert message in str(exit_info.value.code), flags
    monkeypatch.setattr(eaglet.demo_model, "demo_model_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "hi"])
    assert "pass --model-path" in str(exit_info.value.code)


def test_serve_command_answers_requests(checkpoint) -> None:
    """`eaglet serve` as users start it: a subprocess on a free port, its flags reaching the server."""
    import socket
    import subprocess
    import sys

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "eaglet.cli", "serve", *_model_flags(checkpoint), "--port", str(port),
               "--api-key", "k", "--served-model-name", "tiny", "--max-n", "2", "--log-level", "warning"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(process, base, 60)
        headers = {"Authorization": "Bearer k"}
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
        response = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=30)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")
        assert httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30).status_code == 401
        too_many = httpx.post(f"{base}/v1/chat/completions", json={**body, "n": 3}, headers=headers, timeout=30)
        assert too_many.status_code == 400 and "at most 2" in too_many.json()["error"]["message"]
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_serve_freezes_its_startup_heap_before_serving(checkpoint, monkeypatch) -> None:
    """The engine, the app and every module loaded by then leave the collector's generations before
    the server takes requests: a full collection no longer walks them (about 120 ms with the demo
    model loaded, a stall of every request in flight); objects made later are collected as usual."""
    import gc

    import uvicorn

    seen: dict = {}

    def fake_run(app, **kwargs) -> None:
        seen["frozen"] = gc.get_freeze_count()
        fresh: list = []
        tracked = gc.get_objects()
        seen["app_tracked"] = any(obj is app for obj in tracked)
        seen["fresh_tracked"] = any(obj is fresh for obj in tracked)

    monkeypatch.setattr(uvicorn, "run", fake_run)
    try:
        assert main(["serve", *_model_flags(checkpoint, speculative=False), "--port", "0", "--log-level", "warning"]) == 0
    finally:
        gc.unfreeze()
    assert seen["frozen"] > 10_000
    assert not seen["app_tracked"]  # frozen: outside every generation
    assert seen["fresh_tracked"]  # a list made after the freeze is collected as usual
