"""IncrementalDetokenizer and StopStringChecker (eaglet/engine/detokenizer.py).

Tokenizers used, all built offline:
- ``bbpe512``: the repo's tiny byte-level BPE (``checkpoints.write_tiny_tokenizer``, vocab 512), loaded
  with ``AutoTokenizer``; trained on ASCII, so every non-ASCII character is split into its bytes;
- ``bbpe_merged``: a byte-level BPE trained on CJK / accented / emoji text, so tokens merge partial
  characters (a token that completes one character and starts the next);
- ``metaspace``: a SentencePiece-style BPE with byte fallback (``<0xNN>`` tokens) and the Llama-2 decoder
  (``▁`` -> space, leading space stripped), where the decode of a suffix is not the suffix of the decode;
- ``metaspace_dec``: the same model with the ``Metaspace`` decoder (strips the first token's space).
"""

from __future__ import annotations

import json
import os
import re
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eaglet.testing.checkpoints import write_tiny_tokenizer
from eaglet.engine.detokenizer import IncrementalDetokenizer, StopMatch, StopStringChecker
from eaglet.errors import InvalidRequestError

FFFD = "\ufffd"
_EXAMPLES = os.environ.get("EAGLET_HYPOTHESIS_EXAMPLES")  # set it (e.g. 2000) for a long random run
SETTINGS = settings(
    max_examples=int(_EXAMPLES or 75), deadline=None, derandomize=_EXAMPLES is None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
_TOKENIZERS: dict = {}


# ---- tokenizers -------------------------------------------------------------------------------
def _bbpe512(tmp_dir):
    from transformers import AutoTokenizer

    write_tiny_tokenizer(tmp_dir, 512)
    return AutoTokenizer.from_pretrained(str(tmp_dir))


def _wrap(tok, **special):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False, **special)


def _bbpe_merged():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = ["中文中文 中文字 éé café naïve 😀😀 👍🏽 the cat sat on the mat, hello world"] * 50
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=256 + 40, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        special_tokens=["<s>", "</s>", "<pad>"],
    )
    tok.train_from_iterator(text, trainer=trainer)
    return tok


def _metaspace(decoder: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = ["the quick brown fox jumps over the lazy dog", "hello world, this is a test of the stop"] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=120, show_progress=False, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(text, trainer=trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    n = len(vocab)
    for b in range(256):  # SentencePiece byte fallback
        vocab[f"<0x{b:02X}>"] = n + b
    data["model"]["byte_fallback"] = True
    data["model"]["unk_token"] = "<unk>"
    tok = Tokenizer.from_str(json.dumps(data))
    if decoder == "llama2":
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    else:
        tok.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)]
        )
    return tok


def get_tok(name: str):
    if name not in _TOKENIZERS:
        if name == "bbpe512":
            with tempfile.TemporaryDirectory(prefix="eaglet_tok_") as tmp:
                _TOKENIZERS[name] = _bbpe512(tmp)
        elif name == "bbpe_merged":
            _TOKENIZERS[name] = _wrap(_bbpe_merged(), bos_token="<s>", eos_token="</s>", pad_token="<pad>")
        elif name == "bbpe_merged_raw":  # a bare tokenizers.Tokenizer works too
            _TOKENIZERS[name] = _bbpe_merged()
        elif name == "metaspace":
            _TOKENIZERS[name] = _wrap(_metaspace("llama2"), unk_token="<unk>", bos_token="<s>", eos_token="</s>")
        elif name == "metaspace_dec":
            _TOKENIZERS[name] = _wrap(_metaspace("metaspace"), unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    return _TOKENIZERS[name]


def vocab_size(tok) -> int:
    return tok.get_vocab_size() if hasattr(tok, "get_vocab_size") else len(tok)


def special_ids(tok) -> list[int]:
    if hasattr(tok, "all_special_ids"):
        return list(tok.all_special_ids)
    return [i for i, t in tok.get_added_tokens_decoder().items() if t.special]


def encode(tok, text: str) -> list[int]:
    if hasattr(tok, "get_vocab_size"):
        return tok.encode(text, add_special_tokens=False).ids
    return tok.encode(text, add_special_tokens=False)


def decode(tok, ids, skip=True) -> str:
    return tok.decode(list(ids), skip_special_tokens=skip)


def run(tok, ids, blocks=None, skip=True, prompt=()):
    """Appends ids in the given block sizes (default: one by one); returns (detok, deltas)."""
    detok = IncrementalDetokenizer(tok, list(prompt), skip)
    deltas, i = [], 0
    for n in blocks or [1] * len(ids):
        deltas.append(detok.append(ids[i : i + n]))
        i += n
    assert i == len(ids)
    return detok, deltas


def split_blocks(n: int, cuts: list[int]) -> list[int]:
    points = sorted({c % (n + 1) for c in cuts} | {0, n})
    return [b - a for a, b in zip(points, points[1:]) if b > a]


def final_text_after(tok, ids, i, skip=True) -> str:
    """Byte-level tokenizers: the final text after i tokens is the decode minus its incomplete tail."""
    return decode(tok, ids[:i], skip).rstrip(FFFD)


# ---- detokenization ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["bbpe512", "bbpe_merged", "bbpe_merged_raw", "metaspace"])
@pytest.mark.parametrize(
    "text", ["héllo wörld", "中文字 and 中文", "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷!", "naïve café"]
)
def test_split_multibyte_characters_come_out_whole(name, text):
    tok = get_tok(name)
    ids = encode(tok, text)
    assert decode(tok, ids) == text
    detok, deltas = run(tok, ids)
    assert "".join(deltas) == detok.text == text
    assert all(FFFD not in d for d in deltas)  # a partial character is held back, never shown as U+FFFD
    # every character appears at the token that completes it: for byte-level BPE the text after i tokens
    # is the decode of the first i tokens up to its incomplete tail (byte fallback decodes a run of byte
    # tokens all at once, so there a character shows as soon as its own bytes are complete)
    if name.startswith("bbpe"):
        for i in range(1, len(ids) + 1):
            assert detok.text_len_after(i) == len(decode(tok, ids[:i]).rstrip(FFFD)), i
    assert detok.finish() == ""


def test_tokenizers_really_split_characters():
    """Guards the fixtures: the tokens do split characters (and, for bbpe_merged, merge across them)."""
    tok = get_tok("bbpe512")
    ids = encode(tok, "中")
    assert len(ids) == 3 and all(decode(tok, [i]) == FFFD for i in ids)
    merged = get_tok("bbpe_merged")
    pieces = [decode(merged, [i]) for i in encode(merged, "👍🏽")]
    assert len(pieces) > 2 and any(FFFD in p and len(p) > 1 for p in pieces)
    ms = get_tok("metaspace")
    assert any(re.fullmatch(r"<0x[0-9A-F]{2}>", t) for t in ms.convert_ids_to_tokens(encode(ms, "中")))


def test_character_completed_inside_a_merged_token():
    tok = get_tok("bbpe_merged")
    ids = encode(tok, "👍🏽x")
    detok, deltas = run(tok, ids)
    assert "".join(deltas) == "👍🏽x"
    # the token that holds the end of 👍 and the start of 🏽 releases exactly 👍
    k = next(i for i in range(len(ids)) if deltas[i] == "👍")
    assert FFFD in decode(tok, [ids[k]]) and decode(tok, ids[: k + 1]) == "👍" + FFFD


def test_incomplete_character_is_held_then_flushed_by_finish():
    tok = get_tok("bbpe512")
    ids = encode(tok, "ab中")[:-1]  # last byte of 中 missing
    detok, deltas = run(tok, ids)
    assert detok.text == "ab"
    assert detok.finish() == decode(tok, ids)[2:] == FFFD
    assert detok.text == decode(tok, ids) and detok.finish() == ""
    with pytest.raises(RuntimeError):
        detok.append([5])


@pytest.mark.parametrize("name", ["metaspace", "metaspace_dec"])
def test_leading_space_tokens(name):
    tok = get_tok(name)
    text = "hello world the fox jumps"
    ids = encode(tok, text)
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces[0].startswith("▁") and sum(p.startswith("▁") for p in pieces) > 2
    # decoding a suffix drops its leading space: the naive concatenation of per-token decodes is wrong
    assert "".join(decode(tok, [i]) for i in ids) != text
    detok, deltas = run(tok, ids)
    assert "".join(deltas) == text and not deltas[0].startswith(" ")
    assert any(d.startswith(" ") for d in deltas[1:])
    # vLLM / SGLang style: decoding after the prompt's tail keeps the first word's leading space
    prompt = encode(tok, "the lazy dog")
    ctx = IncrementalDetokenizer(tok, prompt, use_prompt_context=True)
    assert ctx.append(ids) + ctx.finish() == " " + text
    assert decode(tok, prompt + ids)[len(decode(tok, prompt)):] == " " + text


def test_prompt_context_completes_a_character_split_from_the_prompt():
    tok = get_tok("bbpe512")
    ids = encode(tok, "ab中cd")
    prompt, gen = ids[:4], ids[4:]  # the prompt ends with 2 of the 3 bytes of 中
    ctx = IncrementalDetokenizer(tok, prompt, use_prompt_context=True)
    assert ctx.append(gen) == "中cd" and ctx.finish() == ""
    plain = IncrementalDetokenizer(tok, prompt)
    assert plain.append(gen) + plain.finish() == decode(tok, gen) == FFFD + "cd"


def test_decode_fast_path_is_only_taken_when_equivalent():
    from eaglet.engine import detokenizer as mod

    tok = get_tok("bbpe512")
    ids = encode(tok, "héllo 中 world") + [tok.eos_token_id]
    for skip in (True, False):
        fast = mod._decode_function(tok, skip)
        assert fast(ids) == tok.decode(ids, skip_special_tokens=skip)

    class Shouting(type(tok)):
        def _decode(self, *args, **kwargs):
            return super()._decode(*args, **kwargs).upper()

    loud = Shouting(tokenizer_object=tok.backend_tokenizer, clean_up_tokenization_spaces=False)
    detok = IncrementalDetokenizer(loud, [])
    assert detok.append(encode(tok, "hello")) == "HELLO"


@pytest.mark.parametrize("name", ["bbpe512", "bbpe_merged", "metaspace"])
@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(name, skip):
    tok = get_tok(name)
    specials = special_ids(tok)
    a, b = encode(tok, "hello 中"), encode(tok, " world")
    # a special token in the middle of a split character, one between words, one at the end
    ids = a[:-1] + [specials[0]] + a[-1:] + [specials[-1]] + b + [specials[1]]
    detok, deltas = run(tok, ids, skip=skip)
    full = decode(tok, ids, skip)
    assert detok.text + detok.finish() == full
    assert ("".join(deltas) == full) if not full.endswith(FFFD) else full.startswith("".join(deltas))
    if skip:
        assert full == "hello 中 world"


def _random_ids(name):
    tok = get_tok(name)
    if name.startswith("metaspace"):
        # byte-fallback runs must spell valid UTF-8 (see the class docstring's known limit): draw whole
        # model tokens, special tokens and the byte tokens of complete characters
        normal = [i for i in range(vocab_size(tok)) if not tok.convert_ids_to_tokens(i).startswith("<0x")]
        chars = st.sampled_from("éü中文😀👍🏽 a").map(lambda c: encode(tok, c))
        piece = st.one_of(st.sampled_from(normal).map(lambda i: [i]), chars)
        return st.lists(piece, min_size=1, max_size=25).map(lambda ps: [i for p in ps for i in p])
    return st.lists(st.integers(0, vocab_size(tok) - 1), min_size=1, max_size=40)


@pytest.mark.parametrize("name", ["bbpe512", "bbpe_merged", "bbpe_merged_raw", "metaspace", "metaspace_dec"])
def test_deltas_concatenate_to_decode_hypothesis(name):
    tok = get_tok(name)

    @SETTINGS
    @given(data=st.data())
    def check(data):
        ids = data.draw(_random_ids(name))
        skip = data.draw(st.booleans())
        cuts = data.draw(st.lists(st.integers(0, 64), max_size=8))
        one, deltas1 = run(tok, ids, skip=skip)
        blk, deltas = run(tok, ids, split_blocks(len(ids), cuts), skip=skip)
        full = decode(tok, ids, skip)
        # final text: a prefix of the decode that stops only before its incomplete (U+FFFD) tail
        assert "".join(deltas) == blk.text == one.text == "".join(deltas1)
        assert full.startswith(blk.text) and set(full[len(blk.text):]) <= {FFFD}
        if not full.endswith(FFFD):
            assert blk.text == full
        # blocks leave the same per-token record as single tokens
        assert [blk.text_len_after(i) for i in range(len(ids) + 1)] == [
            one.text_len_after(i) for i in range(len(ids) + 1)
        ]
        assert blk.token_ids == ids and blk.num_tokens == len(ids)
        assert blk.text + blk.finish() == full

    check()


@pytest.mark.parametrize("name", ["bbpe512", "bbpe_merged", "metaspace", "metaspace_dec"])
def test_deferred_ids_leave_what_append_leaves_hypothesis(name):
    """defer() then any read (text, offsets, append, finish) is append() of the same ids; ids
    deferred and never read until finish are decoded in one call: the same final text, and per-token
    offsets (asked for after that finish) the same as appending one at a time."""
    tok = get_tok(name)

    @SETTINGS
    @given(data=st.data())
    def check(data):
        ids = data.draw(_random_ids(name))
        skip = data.draw(st.booleans())
        prompt = data.draw(st.lists(st.integers(0, vocab_size(tok) - 1), max_size=6))
        context = data.draw(st.booleans())
        blocks = split_blocks(len(ids), data.draw(st.lists(st.integers(0, 64), max_size=8)))
        reads = data.draw(st.lists(st.booleans(), min_size=len(blocks), max_size=len(blocks)))

        def make():
            return IncrementalDetokenizer(tok, prompt, skip, use_prompt_context=context)

        eager, lazy, once = make(), make(), make()
        i = 0
        for n, read in zip(blocks, reads):
            eager.append(ids[i : i + n])
            lazy.defer(ids[i : i + n])
            once.defer(ids[i : i + n])
            i += n
            assert lazy.num_tokens == eager.num_tokens and lazy.token_ids == eager.token_ids
            if read:
                assert lazy.text == eager.text
        assert lazy.text_len_after(len(ids)) == eager.text_len_after(len(ids))
        rest = eager.finish()
        assert lazy.finish() == rest and lazy.text == eager.text
        once_rest = once.finish()
        assert once.text == once_rest == eager.text  # nothing was read before: one decode, all of it
        assert [once.text_len_after(j) for j in range(len(ids) + 1)] == [eager.text_len_after(j) for j in range(len(ids) + 1)]
        with pytest.raises(RuntimeError):
            once.defer(ids[:1])

    check()


def test_bytelevel_text_after_each_token_is_the_decode_prefix_hypothesis():
    tok = get_tok("bbpe_merged")

    @SETTINGS
    @given(st.lists(st.integers(0, vocab_size(tok) - 1), min_size=1, max_size=30), st.booleans())
    def check(ids, skip):
        detok, _ = run(tok, ids, skip=skip)
        for i in range(len(ids) + 1):
            assert detok.text[: detok.text_len_after(i)] == final_text_after(tok, ids, i, skip)

    check()


# ---- stop strings ------------------------------------------------------------------------------------
def stop_oracle(tok, ids, stops, include=False, skip=True, min_tokens=0) -> StopMatch | None:
    """What checking after every single token finds (vLLM / SGLang: no check before min_tokens tokens),
    computed from tokenizer.decode alone."""
    prev = ""
    for i in range(1, len(ids) + 1):
        text = final_text_after(tok, ids, i, skip)
        if i < min_tokens:
            prev = text
            continue
        found = []
        for s in stops:
            j = text.find(s, max(0, len(prev) - len(s) + 1))
            if j >= 0:
                found.append((j + len(s), j, s))
        if found:
            end, start, s = min(found)
            return StopMatch(i, text[: end if include else start], s)
        prev = text
    return None


def run_stop(tok, ids, stops, blocks=None, include=False, skip=True, stream=False, min_tokens=0):
    """Feeds ids in blocks, checking after each; stops feeding at a match like the engine would.
    Returns (match, detok, streamed snapshots)."""
    detok = IncrementalDetokenizer(tok, [], skip)
    checker = StopStringChecker(stops, include, min_tokens=min_tokens)
    snapshots, i = [], 0
    for n in blocks or [1] * len(ids):
        detok.append(ids[i : i + n])
        i += n
        m = checker.check(detok)
        if stream:
            snapshots.append(checker.streamable_text(detok))
        if m is not None:
            return m, detok, snapshots
    return None, detok, snapshots


def test_stop_string_spanning_token_boundaries():
    tok = get_tok("bbpe512")
    ids = encode(tok, "The quick brown fox jumps over the lazy dog")
    for stop in ["brown fox", "own f", "k b", "lazy"]:
        m, detok, _ = run_stop(tok, ids, [stop])
        text = decode(tok, ids)
        end = text.index(stop) + len(stop)
        assert m.stop == stop and m.text == text[: text.index(stop)]
        # kept tokens: through the one that completes the stop string, and not one fewer
        assert stop in decode(tok, ids[: m.num_tokens]) and stop not in decode(tok, ids[: m.num_tokens - 1])
        assert detok.text_len_after(m.num_tokens) >= end > detok.text_len_after(m.num_tokens - 1)
        assert m == stop_oracle(tok, ids, [stop])


def test_stop_string_made_of_split_characters():
    tok = get_tok("bbpe512")
    ids = encode(tok, "ab中文cd")
    m, _, _ = run_stop(tok, ids, ["中文"], blocks=[len(ids)])
    # 中文 completes at the last byte of 文 (token 8), not when its first byte arrives
    assert m == StopMatch(num_tokens=len(encode(tok, "ab中文")), text="ab", stop="中文")


def test_stop_string_starting_in_earlier_output():
    """The stop string starts in an earlier block and ends in the current one (SGLang #23802: a check of
    only the last tokens, or only the new text, misses it)."""
    tok = get_tok("bbpe512")
    ids = encode(tok, "hello world, the stop is here and more text follows")
    text = decode(tok, ids)
    stop = "the stop is here"
    k_start = next(i for i in range(len(ids)) if len(decode(tok, ids[: i + 1])) > text.index(stop))
    k_end = next(i for i in range(len(ids)) if stop in decode(tok, ids[: i + 1]))
    assert k_end - k_start >= 3
    for blocks in ([k_start + 1, len(ids) - k_start - 1], [k_start + 2, 1, len(ids) - k_start - 3], [1] * len(ids)):
        m, _, _ = run_stop(tok, ids, [stop], blocks)
        assert m == StopMatch(k_end + 1, text[: text.index(stop)], stop), blocks


def test_earliest_match_wins_with_multiple_stops():
    tok = get_tok("bbpe512")
    ids = encode(tok, "alpha beta gamma delta epsilon")
    whole = [len(ids)]
    # in text order, whatever the list order
    m, _, _ = run_stop(tok, ids, ["delta", "beta"], whole)
    assert m.stop == "beta" and m.text == "alpha "
    # the stop string that ENDS first wins (that is where one-token-at-a-time decoding stops) ...
    m, _, _ = run_stop(tok, ids, ["alpha beta gamma", "beta"], whole)
    assert m.stop == "beta" and m.text == "alpha "
    # ... and of those ending at the same place, the one that starts first
    m, _, _ = run_stop(tok, ids, ["ta", "beta", "a beta"], whole)
    assert m.stop == "a beta" and m.text == "alph"
    for stops in (["delta", "beta"], ["alpha beta gamma", "beta"], ["ta", "beta", "a beta"], ["mma", "gam"]):
        assert run_stop(tok, ids, stops, whole)[0] == run_stop(tok, ids, stops)[0] == stop_oracle(tok, ids, stops)


def test_min_tokens_ignores_stop_strings_completed_earlier():
    tok = get_tok("bbpe512")
    ids = encode(tok, "a STOP b STOP c")
    first = next(i + 1 for i in range(len(ids)) if "STOP" in decode(tok, ids[: i + 1]))
    second = next(i + 1 for i in range(len(ids)) if decode(tok, ids[: i + 1]).count("STOP") == 2)
    for blocks in (None, [len(ids)], [2, len(ids) - 2]):
        assert run_stop(tok, ids, ["STOP"], blocks, min_tokens=first)[0] == StopMatch(first, "a ", "STOP")
        m, _, _ = run_stop(tok, ids, ["STOP"], blocks, min_tokens=first + 1)
        assert m == StopMatch(second, "a STOP b ", "STOP"), blocks


def test_include_stop_str_in_output():
    tok = get_tok("bbpe512")
    ids = encode(tok, "one two three four")
    m, _, _ = run_stop(tok, ids, ["two th"], include=True)
    assert m.text == "one two th" and m.stop == "two th"
    m2, _, _ = run_stop(tok, ids, ["two th"], include=False)
    assert m2.text == "one " and m2.num_tokens == m.num_tokens
    # the completing token may carry text past the stop string: it is kept as a token but not as text
    assert decode(tok, ids[: m.num_tokens]).startswith(m.text)


def test_cut_convention_for_token_ids():
    """What the caller cuts: token ids / logprobs / KV commits at num_tokens (absolute count from the first
    generated token, even when the match is in a later block); text is StopMatch.text."""
    tok = get_tok("bbpe512")
    head, tail = encode(tok, "first block of text "), encode(tok, "then STOP and garbage after")
    ids = head + tail
    m, detok, _ = run_stop(tok, ids, ["STOP"], blocks=[len(head), len(tail)])
    assert detok.num_tokens == len(ids)  # the whole block was appended ...
    kept = ids[: m.num_tokens]  # ... the caller keeps this much
    assert len(head) < m.num_tokens < len(ids)
    assert "STOP" in decode(tok, kept)
    assert "STOP" not in decode(tok, kept[:-1])
    assert m.text == "first block of text then " and decode(tok, kept).startswith(m.text)
    # the text is not re-decoded from the kept tokens: they still spell the stop string
    assert decode(tok, kept) != m.text


@pytest.mark.parametrize("name", ["bbpe512", "bbpe_merged"])
def test_blocks_match_one_token_at_a_time_hypothesis(name):
    tok = get_tok(name)
    alphabet = "abc 中😀e"

    @SETTINGS
    @given(data=st.data())
    def check(data):
        if data.draw(st.booleans()):
            ids = data.draw(st.lists(st.integers(0, vocab_size(tok) - 1), min_size=1, max_size=30))
        else:  # text-like sequences, so stop strings drawn from an alphabet actually occur
            ids = encode(tok, data.draw(st.text(alphabet, min_size=1, max_size=30)))
        skip = data.draw(st.booleans())
        text = decode(tok, ids, skip)
        substr = st.tuples(st.integers(0, len(text)), st.integers(1, 6)).map(lambda t: text[t[0] : t[0] + t[1]])
        stops = data.draw(st.lists(st.one_of(substr, st.text(alphabet, min_size=1, max_size=4)), max_size=4))
        stops = [s for s in stops if s]
        include = data.draw(st.booleans())
        min_tokens = data.draw(st.sampled_from([0, 0, 1, 3, 8]))
        blocks = split_blocks(len(ids), data.draw(st.lists(st.integers(0, 64), max_size=8)))
        single, _, _ = run_stop(tok, ids, stops, include=include, skip=skip, min_tokens=min_tokens)
        block, _, _ = run_stop(tok, ids, stops, blocks, include=include, skip=skip, min_tokens=min_tokens)
        assert block == single == stop_oracle(tok, ids, stops, include, skip, min_tokens)
        if block is not None:
            assert max(1, min_tokens) <= block.num_tokens <= len(ids)
            # kept tokens: through the one that completes this occurrence of the stop string, not one fewer
            start = len(block.text) - (len(block.stop) if include else 0)
            end = start + len(block.stop)
            kept = final_text_after(tok, ids, block.num_tokens, skip)
            assert kept[start:end] == block.stop and kept.startswith(block.text)
            assert len(final_text_after(tok, ids, block.num_tokens - 1, skip)) < end

    check()


@pytest.mark.parametrize("name", ["bbpe512", "metaspace"])
def test_streamed_text_never_shows_a_cut_stop_prefix_hypothesis(name):
    tok = get_tok(name)

    @SETTINGS
    @given(data=st.data())
    def check(data):
        pieces = ["the", "stop", "st", "s", "to", "top", "中", "😀", " "]
        words = data.draw(st.lists(st.sampled_from(pieces), max_size=20))
        ids = encode(tok, "".join(words)) or encode(tok, "x")
        stops = data.draw(st.lists(st.sampled_from(["stop", "top s", "the s", "中😀", "s😀", "xyz"]), max_size=3))
        include = data.draw(st.booleans())
        min_tokens = data.draw(st.sampled_from([0, 0, 2, 5]))
        blocks = split_blocks(len(ids), data.draw(st.lists(st.integers(0, 64), max_size=6)))
        m, detok, snaps = run_stop(tok, ids, stops, blocks, include=include, stream=True, min_tokens=min_tokens)
        final = m.text if m is not None else detok.text + detok.finish()
        for a, b in zip(snaps, snaps[1:]):
            assert b.startswith(a)  # streaming only ever appends
        for snap in snaps:
            assert final.startswith(snap)  # nothing streamed is taken back by a stop cut
            if min_tokens == 0 and (m is None or not include):
                assert not any(s in snap for s in stops)
        # a finished request streams everything
        checker = StopStringChecker(stops, include, min_tokens=min_tokens)
        checker.check(detok)
        assert checker.streamable_text(detok, finished=True) == final

    check()


def test_stream_delta_holds_back_a_possible_stop_prefix():
    tok = get_tok("bbpe512")
    detok = IncrementalDetokenizer(tok, [])
    checker = StopStringChecker(["</answer>", "STOP"])
    out = []
    for piece in ["The result is 4", " </ans", "wer", "> tail"]:
        detok.append(encode(tok, piece))
        out.append(checker.stream_delta(detok))
    assert out[0] == "The result is 4"
    assert out[1] == " "  # "</ans" could still become "</answer>": held
    assert out[2] == "" and out[3] == ""
    assert checker.match.text == "The result is 4 " and "".join(out) == checker.match.text
    # a held prefix that does not complete is released
    detok = IncrementalDetokenizer(tok, [])
    checker = StopStringChecker(["STOP"])
    detok.append(encode(tok, "ST"))
    assert checker.stream_delta(detok) == ""
    detok.append(encode(tok, "ONE"))
    assert checker.stream_delta(detok) == "STONE"
    assert checker.stream_delta(detok, finished=True) == ""


def test_stop_checker_validation_and_edge_cases():
    tok = get_tok("bbpe512")
    for bad in ([""], [3], ["ok", ""]):
        with pytest.raises(InvalidRequestError):
            StopStringChecker(bad)
    assert StopStringChecker("abc").stops == ["abc"] and StopStringChecker(["a", "a"]).stops == ["a"]
    detok = IncrementalDetokenizer(tok, [])
    checker = StopStringChecker([])
    detok.append(encode(tok, "anything at all"))
    assert checker.check(detok) is None and checker.streamable_text(detok) == "anything at all"
    # a match is sticky: later appends (the caller should stop appending) do not change it
    checker = StopStringChecker(["at"])
    m = checker.check(detok)
    detok.append(encode(tok, " at the end"))
    assert checker.check(detok) is m and m.text == "anything "
    # a stop string in the text a special token renders only when skip_special_tokens=False
    eos = tok.eos_token_id
    ids = encode(tok, "hi") + [eos] + encode(tok, " after")
    m_keep, _, _ = run_stop(tok, ids, [tok.eos_token], skip=False)
    assert m_keep.num_tokens == len(encode(tok, "hi")) + 1 and m_keep.text == "hi"
    assert run_stop(tok, ids, [tok.eos_token], skip=True)[0] is None
