"""Kimi-K2.5 (vision tower + projector + DeepSeek-V3) against transformers 5.24, and batch invariance."""

import pytest
import torch
from eaglet.testing.checkpoints import load_reference_kimi_k25, write_kimi_k25_checkpoint
from runtime_utils import greedy, prompt_logits
from eaglet.testing.images import make_image

from eaglet import LLM
from eaglet.errors import ImageError, InvalidRequestError
from eaglet.multimodal.image_processor import ImageProcessorConfig, KimiImageProcessor

IMAGE_TOKEN = 250


@pytest.fixture(scope="module", params=["published", "transformers"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"kimi-{request.param}")
    text = {"q_lora_rank": None} if request.param == "transformers" else {}
    write_kimi_k25_checkpoint(path, text, seed=7, config_style=request.param, image_token_id=IMAGE_TOKEN)
    return path


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(str(checkpoint), dtype="float32", show_progress=False)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return load_reference_kimi_k25(checkpoint)


def requests():
    """Ragged requests: text-only, one image, two images of different sizes, images mid-prompt."""
    return [
        {"prompt_token_ids": [3, 4, IMAGE_TOKEN, 9, 10, 11], "images": [make_image(40, 28, 0)]},
        {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13]},
        {
            "prompt_token_ids": [20, IMAGE_TOKEN, 21, 22, IMAGE_TOKEN, 23],
            "images": [make_image(24, 56, 1), make_image(33, 17, 2)],
        },
        {"prompt_token_ids": [IMAGE_TOKEN, 30], "images": [make_image(64, 64, 3)]},
        {"prompt_token_ids": list(range(40, 75))},
        {"prompt_token_ids": [99, 98, IMAGE_TOKEN], "images": [make_image(16, 16, 4)]},
    ]


def reference_inputs(llm: LLM, request: dict) -> dict:
    """The same request as transformers' model takes it: expanded ids, pixel values, grids."""
    token_ids, mm = llm.engine._prepare_prompt(request)
    inputs = {"input_ids": torch.tensor([token_ids])}
    if mm is not None:
        inputs["pixel_values"] = mm.pixel_values
        inputs["image_grid_thw"] = mm.grid_thws
    return inputs


def test_prompt_logits_match_transformers(llm, reference):
    reqs = requests()
    ours = prompt_logits(llm, reqs)
    for request, logits in zip(reqs, ours):
        with torch.no_grad():
            expected = reference(**reference_inputs(llm, request)).logits[0].float()
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_greedy_tokens_match_transformers(llm, reference):
    reqs = requests()[:4]
    outputs = llm.generate(reqs, greedy(32))
    for request, out in zip(reqs, outputs):
        inputs = reference_inputs(llm, request)
        with torch.no_grad():
            generated = reference.generate(
                **inputs, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        assert out.token_ids == generated[0, inputs["input_ids"].shape[1] :].tolist()


def test_batch_invariance(llm):
    """Each request of a ragged batch (some with images) equals itself alone: logits and tokens."""
    reqs = requests()
    batched_logits = prompt_logits(llm, reqs)
    batched_tokens = [o.token_ids for o in llm.generate(reqs, greedy(16))]
    for i, request in enumerate(reqs):
        alone = prompt_logits(llm, [request])[0]
        torch.testing.assert_close(batched_logits[i], alone, atol=1e-5, rtol=0)
        assert llm.generate([request], greedy(16))[0].token_ids == batched_tokens[i]
    # Reversed order: a request's position in the batch does not matter either.
    reversed_logits = prompt_logits(llm, reqs[::-1])[::-1]
    for a, b in zip(batched_logits, reversed_logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert llm.engine.num_free_blocks() == llm.engine.cache.allocator.num_usable


def test_chunked_prefill_with_images_equals_one_shot(llm):
    """Chunks cut through the middle of an image's placeholders; features land on the right rows."""
    reqs = requests()
    whole = prompt_logits(llm, reqs)
    chunked = prompt_logits(llm, reqs, chunk=3)
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "request_, error, message",
    [
        ({"prompt_token_ids": [1, IMAGE_TOKEN, IMAGE_TOKEN], "images": [make_image(16, 16, 0)]}, InvalidRequestError,
         "holds 2 image placeholder token"),
        ({"prompt_token_ids": [1, 2], "images": [make_image(16, 16, 0)]}, InvalidRequestError,
         "holds 0 image placeholder token"),
        ({"prompt_token_ids": [1, IMAGE_TOKEN]}, InvalidRequestError, "no images were given"),
        ({"prompt_token_ids": [1, IMAGE_TOKEN], "images": [b"\x89PNG\r\n\x1a\nnot really"]}, ImageError, "image"),
        ({"prompt_token_ids": [1, IMAGE_TOKEN], "images": [12345]}, ImageError, "image"),
    ],
)
def test_bad_multimodal_requests(llm, request_, error, message):
    with pytest.raises(error, match=message):
        llm.generate([requests()[0], request_], greedy(2))
    assert not llm.engine.has_unfinished()
    assert llm.engine.num_free_blocks() == llm.engine.cache.allocator.num_usable


def test_processor_reads_checkpoint_config(checkpoint):
    processor = KimiImageProcessor(ImageProcessorConfig.from_pretrained(checkpoint))
    out = processor([make_image(40, 28, 0)])
    assert out.grid_thws.shape == (1, 3) and out.pixel_values.shape[0] == int(out.grid_thws[0].prod())
