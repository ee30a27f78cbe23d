"""Sampling parameters, logits processing (penalties, bias, min_tokens), min-p and the sampler.

Every processor is checked against a plain scalar reference written here, one token at a time, in
float64; batched processing must equal each row processed alone.
"""

from __future__ import annotations

import math

import pytest
import torch

from eaglet.backends import torch_backend
from eaglet.backends.pytorch.sampling_ops import BLOCKED_MIN_VOCAB, VOCAB_BLOCK
from eaglet.errors import InvalidRequestError
from eaglet.layers.logits_processor import LogitsRow, logprobs_of, process_logits
from eaglet.layers.sampler import sample, shaped_probs
from eaglet.sampling_params import SamplingParams

OPS = torch_backend().sampling
V = 32
EOS = {2, 40}  # 40 is outside the vocabulary: ignored


# --------------------------------------------------------------------------- scalar references


def ref_process(
    logits: list[float], p: SamplingParams, prompt: list[int], output: list[int], eos: set[int]
) -> list[float]:
    """vLLM v1 order: min_tokens, logit_bias, repetition, frequency, presence."""
    x = [float(v) for v in logits]
    vocab = len(x)
    if len(output) < p.min_tokens:
        for t in set(eos) | set(p.stop_token_ids):
            if t < vocab:
                x[t] = -math.inf
    for t, b in p.logit_bias.items():
        x[t] += b
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t)
        x[t] -= p.presence_penalty
    return x


def ref_shaped(logits: list[float], p: SamplingParams) -> list[float]:
    """temperature, min-p, top-k, top-p, one token at a time."""
    x = [v / p.temperature for v in logits]
    vocab = len(x)

    def softmax(v):
        m = max(v)
        e = [math.exp(a - m) if a != -math.inf else 0.0 for a in v]
        s = sum(e)
        return [a / s for a in e]

    if p.min_p > 0:
        probs = softmax(x)
        top = max(probs)
        x = [a if probs[i] >= p.min_p * top else -math.inf for i, a in enumerate(x)]
    if p.top_k > 0:
        kth = sorted(x, reverse=True)[min(p.top_k, vocab) - 1]
        x = [a if a >= kth else -math.inf for a in x]
    probs = softmax(x)
    if p.top_p < 1:
        order = sorted(range(vocab), key=lambda i: -probs[i])
        keep, mass = set(), 0.0
        for i in order:
            if mass >= p.top_p:
                break
            keep.add(i)
            mass += probs[i]
        probs = [q if i in keep else 0.0 for i, q in enumerate(probs)]
        s = sum(probs)
        probs = [q / s for q in probs]
    return probs


def _logits(rows: int, seed: int = 0, vocab: int = V) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3.0


def _history(seed: int, n: int, vocab: int = V) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def _check_row(out_row: torch.Tensor, ref: list[float]) -> None:
    expected = torch.tensor(ref, dtype=torch.float64)
    torch.testing.assert_close(out_row.double(), expected, rtol=1e-6, atol=1e-5)


# --------------------------------------------------------------------------- each processor alone

PROCESSOR_CASES = {
    "min_tokens": SamplingParams(max_new_tokens=20, min_tokens=10, stop_token_ids=[5, 7]),
    "logit_bias": SamplingParams(logit_bias={0: 5.0, 3: -100.0, 31: 0.25}),
    "repetition": SamplingParams(repetition_penalty=1.7),
    "repetition_below_1": SamplingParams(repetition_penalty=0.6),
    "frequency": SamplingParams(frequency_penalty=1.3),
    "frequency_negative": SamplingParams(frequency_penalty=-0.7),
    "presence": SamplingParams(presence_penalty=1.9),
    "presence_negative": SamplingParams(presence_penalty=-2.0),
    "all": SamplingParams(
        max_new_tokens=30,
        min_tokens=25,
        stop_token_ids=[9],
        logit_bias={1: 2.5, 4: -3.0, 9: 10.0},
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=-0.5,
    ),
}


@pytest.mark.parametrize("name", list(PROCESSOR_CASES))
def test_processor_matches_scalar_reference(name):
    params = PROCESSOR_CASES[name]
    logits = _logits(3, seed=1)
    prompt = _history(10, 12)
    outputs = [[], _history(11, 6), _history(12, 30)]  # lengths below and above min_tokens
    rows = [LogitsRow(params, prompt, out) for out in outputs]
    before = logits.clone()
    processed = process_logits(logits, rows, EOS)
    assert torch.equal(logits, before), "the input logits must not be modified"
    for i, out in enumerate(outputs):
        _check_row(processed[i], ref_process(logits[i].tolist(), params, prompt, out, EOS))


def test_min_tokens_masks_eos_and_stop_ids_until_reached_even_with_ignore_eos():
    params = SamplingParams(max_new_tokens=8, min_tokens=3, stop_token_ids=[6], ignore_eos=True)
    logits = torch.zeros(4, V)
    logits[:, 2] = 50.0  # EOS would win greedy
    rows = [LogitsRow(params, [1], [0] * n) for n in range(4)]
    out = process_logits(logits, rows, EOS)
    assert torch.isneginf(out[:3, 2]).all() and torch.isneginf(out[:3, 6]).all()
    assert out[3, 2] == 50.0 and out[3, 6] == 0.0  # 3 tokens generated: no mask
    tokens = sample(out, [SamplingParams(temperature=0.0)] * 4, [None] * 4, OPS)
    assert tokens[:3].ne(2).all() and tokens[3] == 2


def test_repetition_penalty_counts_each_token_once_over_prompt_and_output():
    params = SamplingParams(repetition_penalty=2.0)
    logits = torch.tensor([[4.0, -4.0, 4.0, 0.0, 1.0]])
    out = process_logits(logits, [LogitsRow(params, [0, 0, 0, 4], [1, 1, 3, 4, 0])], set())
    # token 0: three times in the prompt and once in the output, divided once; token 1: multiplied
    # once; token 4 in both: divided once; token 3 (logit 0) stays 0; token 2 not seen
    assert out.tolist() == [[2.0, -8.0, 4.0, 0.0, 0.5]]


def test_greedy_rows_use_processed_logits():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    greedy = SamplingParams(temperature=0.0, logit_bias={2: 5.0})
    out = process_logits(logits, [LogitsRow(greedy, [], [])], set())
    assert sample(out, [greedy], [None], OPS).item() == 2
    penalised = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    out = process_logits(logits, [LogitsRow(penalised, [], [0])], set())
    assert sample(out, [penalised], [None], OPS).item() == 1


def test_rows_without_processing_are_untouched():
    logits = _logits(3, seed=2)
    plain = SamplingParams(temperature=0.5, top_k=3, min_p=0.1)  # shaping only: not processing
    done = SamplingParams(max_new_tokens=4, min_tokens=2)
    rows = [LogitsRow(plain, [1, 2], [3]), LogitsRow(done, [1], [4, 5]), LogitsRow(plain, [], [])]
    assert process_logits(logits, rows, EOS) is logits  # nothing to do: no copy at all
    rows[1] = LogitsRow(SamplingParams(presence_penalty=1.0), [1], [4, 5])
    out = process_logits(logits, rows, EOS)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert not torch.equal(out[1], logits[1])
    inplace = logits.clone()
    assert process_logits(inplace, rows, EOS, inplace=True) is inplace
    assert torch.equal(inplace, out)


# --------------------------------------------------------------------------- order of operations


def test_order_logit_bias_before_repetition_before_frequency():
    # x = -1, bias +2, repetition 2, frequency 1 (token generated once), vLLM v1 order:
    # bias -> 1, repetition -> 0.5, frequency -> -0.5.
    # Repetition before bias would give -2 + 2 - 1 = -1; frequency before repetition (-1 + 2 - 1) = 0.
    params = SamplingParams(logit_bias={0: 2.0}, repetition_penalty=2.0, frequency_penalty=1.0)
    out = process_logits(torch.tensor([[-1.0, 0.0]]), [LogitsRow(params, [], [0])], set())
    assert out[0, 0].item() == pytest.approx(-0.5)
    # min_tokens before bias: a positive bias cannot lift a masked EOS
    params = SamplingParams(max_new_tokens=4, min_tokens=2, logit_bias={1: 100.0})
    out = process_logits(torch.zeros(1, 3), [LogitsRow(params, [], [])], {1})
    assert torch.isneginf(out[0, 1])


def test_order_min_p_before_top_p():
    # probs 0.5, 0.3, 0.15, 0.05 at temperature 1
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    params = SamplingParams(temperature=1.0, min_p=0.35, top_p=0.6)
    probs = shaped_probs(logits, [params])[0]
    # vLLM v1: min_p keeps {0, 1} -> (0.625, 0.375); top_p 0.6 then keeps token 0 only.
    # (top_p first would keep {0, 1} and min_p would keep both.)
    torch.testing.assert_close(probs, torch.tensor([1.0, 0.0, 0.0, 0.0]))
    ref = torch.tensor(ref_shaped(logits[0].tolist(), params), dtype=torch.float64)
    torch.testing.assert_close(probs.double(), ref)


def test_order_temperature_before_min_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    hot = shaped_probs(logits, [SamplingParams(temperature=4.0, min_p=0.5)])[0]
    cold = shaped_probs(logits, [SamplingParams(temperature=0.5, min_p=0.5)])[0]
    # at T=4 the threshold e^{-x/4} >= 0.5 keeps x in {2, 1, 0}; at T=0.5 only the top token
    assert (hot > 0).tolist() == [True, True, True, False]
    assert (cold > 0).tolist() == [True, False, False, False]


# --------------------------------------------------------------------------- min-p and shaping

SHAPE_CASES = [
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.7, min_p=0.3),
    SamplingParams(temperature=1.5, min_p=1.0),  # only the max-probability token(s)
    SamplingParams(temperature=1.2, min_p=0.05, top_k=5),
    SamplingParams(temperature=0.9, min_p=0.02, top_p=0.8),
    SamplingParams(temperature=1.1, min_p=0.2, top_k=8, top_p=0.9),
    SamplingParams(temperature=0.8, top_p=0.5),
    SamplingParams(temperature=1.0, top_k=3),
]


@pytest.mark.parametrize("params", SHAPE_CASES, ids=[f"case{i}" for i in range(len(SHAPE_CASES))])
def test_shaped_probs_match_scalar_reference(params):
    logits = _logits(4, seed=3)
    probs = shaped_probs(logits, [params] * 4)
    for i in range(4):
        ref = torch.tensor(ref_shaped(logits[i].tolist(), params), dtype=torch.float64)
        torch.testing.assert_close(probs[i].double(), ref, rtol=1e-5, atol=1e-6)
        assert ((probs[i] > 0) == (ref > 0)).all()


def test_shaped_probs_zero_temperature_row_is_one_hot():
    logits = _logits(2, seed=4)
    probs = shaped_probs(logits, [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, min_p=0.1)])
    assert probs[0].sum() == 1.0 and probs[0, logits[0].argmax()] == 1.0
    torch.testing.assert_close(probs[1], shaped_probs(logits[1:], [SamplingParams(temperature=1.0, min_p=0.1)])[0])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.3, top_k=4),
        SamplingParams(temperature=1.0, top_p=0.7),
        SamplingParams(temperature=1.0, min_p=0.15),
        SamplingParams(temperature=2.0, top_k=6, top_p=0.9, min_p=0.05),
    ],
    ids=["top_k", "top_p", "min_p", "all"],
)
def test_sample_only_returns_allowed_tokens_with_the_shaped_frequencies(params):
    logits = _logits(1, seed=5, vocab=16)
    probs = shaped_probs(logits, [params])[0].double()
    allowed = set(torch.nonzero(probs > 0).flatten().tolist())
    assert 1 < len(allowed) < 16
    draws = 3000
    gen = torch.Generator().manual_seed(123)
    batch = logits.expand(draws, -1).contiguous()
    tokens = sample(batch, [params] * draws, [gen] * draws, OPS)
    assert set(tokens.tolist()) <= allowed
    freq = torch.bincount(tokens, minlength=16).double() / draws
    # total variation distance: about 0.02 expected at this sample size; 0.06 is a wide margin
    assert 0.5 * (freq - probs).abs().sum().item() < 0.06


# --------------------------------------------------------------------------- seeds and batch invariance


def test_seeded_sampling_reproducible_and_independent_of_other_rows():
    params = SamplingParams(temperature=0.9, top_p=0.95, min_p=0.02)
    mine = _logits(1, seed=6)

    def run(others: int, position: int, other_seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(42)
        other_gens = [torch.Generator().manual_seed(other_seed + j) for j in range(others)]
        drawn = []
        for step in range(20):
            batch = list(_logits(others, seed=100 + step + other_seed))
            gens = list(other_gens)
            batch.insert(position, mine[0])
            gens.insert(position, gen)
            rows_params = [SamplingParams(temperature=1.3)] * others
            rows_params.insert(position, params)
            drawn.append(sample(torch.stack(batch), rows_params, gens, OPS)[position].item())
        return drawn

    alone = run(0, 0, 0)
    assert alone == run(0, 0, 0)
    assert alone == run(3, 1, 7)
    assert alone == run(5, 5, 1000)
    assert len(set(alone)) > 1  # it does sample


def test_processed_batch_equals_each_row_alone():
    prompt = _history(20, 15)  # shared by the rows of one "tree", as the engine passes it
    committed = _history(21, 5)
    drafts = _history(22, 3)
    cases = list(PROCESSOR_CASES.values()) + [SamplingParams(), SamplingParams(temperature=0.0)]
    rows = []
    for i, params in enumerate(cases):
        # tree-like rows: committed history + the first d draft tokens on the path
        for d in range(len(drafts) + 1):
            rows.append(LogitsRow(params, prompt if i % 2 else _history(30 + i, 7), committed + drafts[:d]))
    logits = _logits(len(rows), seed=7)
    batched = process_logits(logits, rows, EOS)
    for i, row in enumerate(rows):
        alone = process_logits(logits[i : i + 1], [row], EOS)
        assert torch.equal(batched[i : i + 1], alone), f"row {i}"
    shaped_params = [SHAPE_CASES[i % len(SHAPE_CASES)] for i in range(len(rows))]
    probs = shaped_probs(batched, shaped_params)
    for i in range(len(rows)):
        alone = shaped_probs(batched[i : i + 1], [shaped_params[i]])
        assert torch.equal(probs[i : i + 1], alone), f"row {i}"


def test_processing_ignores_out_of_vocab_history_and_rejects_out_of_vocab_bias():
    out = process_logits(torch.zeros(1, 4), [LogitsRow(SamplingParams(presence_penalty=1.0), [], [1, 99])], set())
    assert out.tolist() == [[0.0, -1.0, 0.0, 0.0]]
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        process_logits(torch.zeros(1, 4), [LogitsRow(SamplingParams(logit_bias={4: 1.0}), [], [])], set())


# --------------------------------------------------------------------------- logprobs


def test_logprobs_of_raw_logits():
    logits = _logits(3, seed=8)
    chosen = torch.tensor([0, 5, 31])
    lp, ids, top = logprobs_of(logits, chosen, 4)
    ref = logits.double().log_softmax(-1)
    torch.testing.assert_close(lp.double(), ref.gather(1, chosen[:, None])[:, 0], rtol=1e-6, atol=1e-6)
    ref_top = ref.topk(4, dim=-1)
    assert torch.equal(ids, ref_top.indices)
    torch.testing.assert_close(top.double(), ref_top.values, rtol=1e-6, atol=1e-6)
    lp0, ids0, top0 = logprobs_of(logits, chosen, 0)
    assert ids0.shape == (3, 0) and top0.shape == (3, 0)
    torch.testing.assert_close(lp0, lp)


# --------------------------------------------------------------------------- validation

BAD_PARAMS = [
    ({"max_new_tokens": 0}, "max_new_tokens", "positive integer"),
    ({"max_new_tokens": 2.5}, "max_new_tokens", "positive integer"),
    ({"max_new_tokens": True}, "max_new_tokens", "positive integer"),
    ({"min_tokens": -1}, "min_tokens", r"\[0, max_new_tokens=16\]"),
    ({"max_new_tokens": 4, "min_tokens": 5}, "min_tokens", r"\[0, max_new_tokens=4\]"),
    ({"temperature": -0.1}, "temperature", ">= 0"),
    ({"temperature": float("nan")}, "temperature", ">= 0"),
    ({"temperature": float("inf")}, "temperature", "finite"),
    ({"top_p": 0.0}, "top_p", r"\(0, 1\]"),
    ({"top_p": 1.01}, "top_p", r"\(0, 1\]"),
    ({"top_k": 0}, "top_k", "-1"),
    ({"top_k": -2}, "top_k", "-1"),
    ({"top_k": 2.0}, "top_k", "-1"),
    ({"min_p": -0.01}, "min_p", r"\[0, 1\]"),
    ({"min_p": 1.5}, "min_p", r"\[0, 1\]"),
    ({"seed": 1.5}, "seed", "integer"),
    ({"seed": "7"}, "seed", "integer"),
    ({"seed": 2**64}, "seed", "integer in"),
    ({"repetition_penalty": 0.0}, "repetition_penalty", "> 0"),
    ({"repetition_penalty": -1.0}, "repetition_penalty", "> 0"),
    ({"presence_penalty": 2.5}, "presence_penalty", r"\[-2, 2\]"),
    ({"presence_penalty": -2.01}, "presence_penalty", r"\[-2, 2\]"),
    ({"frequency_penalty": 3}, "frequency_penalty", r"\[-2, 2\]"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty", r"\[-2, 2\]"),
    ({"logit_bias": {1: 101.0}}, "logit_bias", r"\[-100, 100\]"),
    ({"logit_bias": {1: -100.5}}, "logit_bias", r"\[-100, 100\]"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias", "integers >= 0"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias", "integers >= 0"),
    ({"logit_bias": [1, 2]}, "logit_bias", "dict"),
    ({"stop": [""]}, "stop", "non-empty"),
    ({"stop": ["a", 3]}, "stop", "list of strings"),
    ({"stop": 5}, "stop", "list of strings"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "integers >= 0"),
    ({"stop_token_ids": "2"}, "stop_token_ids", "list of token ids"),
    ({"ignore_eos": "yes"}, "ignore_eos", "bool"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output", "bool"),
    ({"skip_special_tokens": None}, "skip_special_tokens", "bool"),
    ({"logprobs": -1}, "logprobs", ">= 0"),
    ({"logprobs": 2.0}, "logprobs", ">= 0"),
    ({"prompt_logprobs": -3}, "prompt_logprobs", ">= 0"),
    ({"n": 0}, "n", "positive integer"),
]


@pytest.mark.parametrize("kwargs, field_name, allowed", BAD_PARAMS, ids=[f"{k}" for k, _, _ in BAD_PARAMS])
def test_bad_values_raise_naming_the_field(kwargs, field_name, allowed):
    with pytest.raises(InvalidRequestError, match=rf"^{field_name}\b.*{allowed}"):
        SamplingParams(**kwargs)


def test_good_values_and_normalisation():
    p = SamplingParams(
        8, 0.5, 0.9, 40, 3, True, (5, 6),  # the historical positional order
        min_tokens=8,
        min_p=1.0,
        repetition_penalty=0.5,
        presence_penalty=-2,
        frequency_penalty=2,
        logit_bias={"7": 1, 8: -100},
        stop="END",
        logprobs=0,
        prompt_logprobs=5,
        n=3,
    )
    assert p.max_new_tokens == 8 and p.temperature == 0.5 and p.top_k == 40 and p.ignore_eos
    assert p.stop_token_ids == [5, 6] and p.stop == ["END"]
    assert p.logit_bias == {7: 1.0, 8: -100.0}
    assert p.seed == 3 and SamplingParams(seed=None).seed is None
    assert p.skip_special_tokens and not p.include_stop_str_in_output
    assert SamplingParams(stop=None, logit_bias=None, stop_token_ids=None).logit_bias == {}
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(top_k=1).greedy
    assert not SamplingParams(min_p=0.5).greedy
    assert not SamplingParams().needs_logits_processing
    assert SamplingParams(logit_bias={1: 0.5}).needs_logits_processing


def test_validate_for_vocab():
    SamplingParams(logit_bias={99: 1.0}, stop_token_ids=[99]).validate_for_vocab(100)
    with pytest.raises(InvalidRequestError, match=r"logit_bias token ids must be in \[0, 100\)"):
        SamplingParams(logit_bias={100: 1.0}).validate_for_vocab(100)
    with pytest.raises(InvalidRequestError, match=r"stop_token_ids token ids must be in \[0, 100\)"):
        SamplingParams(stop_token_ids=[3, 250]).validate_for_vocab(100)


@pytest.mark.parametrize("vocab", [1000, BLOCKED_MIN_VOCAB, 32000])  # row-wide, and block by block
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_is_argmax_with_ties_and_nans(vocab, dtype, backend):
    argmax = backend.sampling.argmax
    g = torch.Generator().manual_seed(vocab)
    for trial in range(30):
        logits = torch.randint(0, 3, (5, 3, vocab), generator=g).to(dtype)  # many tied maxima
        if trial % 4 == 1:
            logits[0, 1, 7] = float("nan")
            logits[2, 0, 3] = logits[2, 0, vocab - 100] = float("nan")
        if trial % 4 == 2:
            logits[1] = -float("inf")
        if trial % 4 == 3:
            logits[3, 2] = 0.0
            logits[3, 2, vocab - 1] = 5.0  # the maximum in the last block only
        assert torch.equal(argmax(logits), logits.argmax(dim=-1))
        assert torch.equal(argmax(logits[0]), logits[0].argmax(dim=-1))
        assert torch.equal(argmax(logits[:, 1]), logits[:, 1].argmax(dim=-1))  # rows not adjacent


@pytest.mark.parametrize("vocab", [1000, 32000])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_topk_logprobs_matches_log_softmax_topk(vocab, k, backend):
    topk_kernel = backend.kernels
    top_k_logprobs = backend.sampling.topk_logprobs
    g = torch.Generator().manual_seed(k)
    logits = torch.randn(9, vocab, generator=g) * 3
    logits[4, :VOCAB_BLOCK] += 20.0  # all of row 4's top k in one block
    logits[5, torch.arange(k) * VOCAB_BLOCK] = 30.0 + torch.arange(k)  # one per block, ascending
    if topk_kernel:
        logits[6, 100:110] = 25.0  # ties: the lower index first (torch's topk picks any)
        logits[7, :] = -1e4  # exponentials below float32's range but the maximum's
        logits[7, 3] = 0.0
    values, ids = top_k_logprobs(logits, k)
    expected = logits.log_softmax(dim=-1).topk(k, dim=-1)
    if topk_kernel:  # its exp is a polynomial, within 2 ulp
        order = torch.sort(-logits, dim=-1, stable=True).indices[:, :k]
        assert torch.equal(ids, order)
        torch.testing.assert_close(values, logits.log_softmax(dim=-1).gather(1, order), atol=1e-5, rtol=1e-6)
        # bfloat16 logits (rounding makes ties): the stable order, lower index first.
        rounded = logits.bfloat16().float().log_softmax(-1)
        order = torch.sort(-rounded, dim=-1, stable=True).indices[:, :k]
        bf16_values, bf16_ids = top_k_logprobs(logits.bfloat16(), k)
        assert torch.equal(bf16_ids, order)
        torch.testing.assert_close(bf16_values, rounded.gather(1, order), atol=1e-5, rtol=1e-6)
    else:
        assert torch.equal(ids, expected.indices)
        assert torch.equal(values, expected.values)
    assert values.shape == ids.shape == (9, k)
