"""A request's grammar (eaglet/grammar/) and its masks along speculative draft paths
(eaglet/spec/grammar_drafts.py), on the demo model's tokenizer: no model runs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from eaglet.backends import torch_backend
from eaglet.demo_model import DEMO_TARGET_DIR
from eaglet.errors import InvalidRequestError
from eaglet.executor.request import Request
from eaglet.grammar.compiler import GrammarCompiler
from eaglet.grammar.matcher import mask_logits
from eaglet.sampling_params import SamplingParams, StructuredOutput
from eaglet.spec.grammar_drafts import cut_rejected_drafts, mask_verify_logits
from eaglet.spec.tree import DraftTree
from eaglet.spec.verify import verify_greedy

EOS = (1, 2)
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(DEMO_TARGET_DIR))


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer), set(EOS))


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_the_mask_allows_what_the_schema_allows_and_eos_only_once_complete(compiler, tokenizer) -> None:
    grammar = compiler.matcher(StructuredOutput(json_schema=SCHEMA), EOS)
    allowed = grammar.allowed()
    assert allowed.shape == (len(tokenizer),)
    assert all(tokenizer.decode([t]).startswith("{") for t in allowed.nonzero()[:, 0].tolist())
    assert not allowed[list(EOS)].any()
    text = '{"n": 12}'
    for token in ids(tokenizer, text):
        assert grammar.allowed()[token]
        grammar.accept(token)
    assert grammar.finished and grammar.allowed()[list(EOS)].all()
    assert grammar.allowed().sum() == len(EOS)  # complete: nothing but the end


def test_rejected_tokens_and_bad_schemas(compiler, tokenizer) -> None:
    grammar = compiler.matcher(StructuredOutput(json_object=True), EOS)
    with pytest.raises(RuntimeError, match="rejected"):
        grammar.accept(ids(tokenizer, "x")[0])
    with pytest.raises(InvalidRequestError, match="Invalid type"):
        compiler.check(StructuredOutput(json_schema={"type": "objekt"}))
    with pytest.raises(InvalidRequestError, match="unknown name"):
        compiler.check(StructuredOutput(lark="start: missing_rule"))
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutput(json_object=True, lark="start: \"a\"")
    with pytest.raises(ValueError):
        StructuredOutput(json_schema="not a dict")  # type: ignore[arg-type]


def test_mask_logits_puts_minus_inf_on_disallowed_tokens_of_grammar_rows_only(compiler) -> None:
    grammar = compiler.matcher(StructuredOutput(json_object=True), EOS)
    logits = torch.randn(2, compiler.vocab_size)
    masked = mask_logits(logits, [None, grammar])
    assert torch.equal(masked[0], logits[0])
    allowed = grammar.allowed()
    assert torch.equal(masked[1][allowed], logits[1][allowed]) and torch.isneginf(masked[1][~allowed]).all()
    assert mask_logits(logits, [None, None]) is logits


def grammar_request(compiler, tokenizer, emitted: str) -> Request:
    params = SamplingParams(max_new_tokens=32, temperature=0.0, structured_output=StructuredOutput(json_schema=SCHEMA))
    grammar = compiler.matcher(params.structured_output, EOS)
    output = ids(tokenizer, emitted)
    for token in output:
        grammar.accept(token)
    return Request("r", [5, 6], params, output_token_ids=output, final_token_ids=EOS, grammar=grammar)


def chain(root: int, drafts: list[int]) -> DraftTree:
    n = len(drafts) + 1
    index = torch.arange(n)[None, :]
    return DraftTree(torch.tensor([[root, *drafts]]), index - 1, index.clone())


def test_a_chain_is_cut_after_its_last_token_the_grammar_takes(compiler, tokenizer) -> None:
    req = grammar_request(compiler, tokenizer, '{"n"')
    good = ids(tokenizer, ": 4")
    bad = ids(tokenizer, "x")
    tree = chain(req.output_token_ids[-1], good + bad + good)
    cut = cut_rejected_drafts(tree, [req])
    assert cut.tokens.tolist() == [[req.output_token_ids[-1], *good]]
    assert cut_rejected_drafts(chain(req.output_token_ids[-1], bad), [req]).num_nodes == 1  # the root alone


def test_verify_never_accepts_a_token_the_grammar_rejects(compiler, tokenizer) -> None:
    """A tree whose first child the target favours but the grammar rejects: masked, the sibling the
    grammar takes is accepted, and the bonus token is the best allowed one."""
    req = grammar_request(compiler, tokenizer, '{"n":')
    space, bad, digit = ids(tokenizer, " ")[0], ids(tokenizer, "x")[0], ids(tokenizer, "7")[0]
    tokens = torch.tensor([[req.output_token_ids[-1], bad, space, digit]])
    parents = torch.tensor([[-1, 0, 0, 2]])
    tree = DraftTree(tokens, parents, torch.tensor([[0, 1, 1, 2]]))
    logits = torch.zeros(1, 4, compiler.vocab_size)
    logits[0, 0, bad], logits[0, 0, space] = 10.0, 5.0
    logits[0, 2, digit] = 3.0
    logits[0, 3, bad] = 10.0  # after '{"n": 7' the best raw token breaks the grammar
    logits[0, 3, ids(tokenizer, "}")[0]] = 4.0
    masked = mask_verify_logits(logits, tree, [req])
    result = verify_greedy(tokens, parents, masked, torch_backend().spec)
    assert result.num_accepted.tolist() == [2] and result.accepted_nodes[0, :2].tolist() == [2, 3]
    assert result.bonus_tokens.tolist() == [ids(tokenizer, "}")[0]]
    unmasked = verify_greedy(tokens, parents, logits, torch_backend().spec)
    assert unmasked.accepted_nodes[0, 0].tolist() == 1  # without the mask the rejected child wins
