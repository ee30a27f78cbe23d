"""`eaglet bench` end to end on test-sized checkpoints: the table, the JSON record, the peers' rows."""

from __future__ import annotations

import argparse
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import eaglet
from eaglet.bench.llama_cpp_peer import DEFAULT_LLAMA_CPP_DIR, llama_cpp_tool
from eaglet.bench.spec_shapes import spec_shapes
from eaglet.bench.vllm_peer import vllm_failure
from eaglet.commands import bench

SPEC_FIELDS = ("accept_length", "per_position_acceptance", "phase_share", "ms_per_round", "over_eaglet_plain")


TINY_RUN = ("--size", "tiny", "--checkpoints", "deepseek-fp32", "--new-tokens", "4", "--prompt-len", "8",
            "--repeats", "1", "--min-seconds", "0", "--bandwidth-gib", "0.02", "--prefill-len", "0",
            "--llama-cpp-batch-sizes", "")


def run_bench(tmp_path: Path, *extra: str) -> tuple[int, dict]:
    results = tmp_path / "results"
    argv = [*TINY_RUN, "--workdir", str(tmp_path / "ckpt"), "--results-dir", str(results), *extra]
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    code = bench.run(parser.parse_args(argv))
    (record_file,) = results.glob("bench-*.json")
    return code, json.loads(record_file.read_text())


def test_the_bench_command_comes_from_the_package(tmp_path):
    """`eaglet bench --help` in a directory outside any source tree: the command and the suite are
    imported from the eaglet package, not loaded from a benchmarks/ file."""
    # The eaglet under test; wide help, so that argparse never wraps the default at its hyphens.
    env = {**os.environ, "PYTHONPATH": str(Path(eaglet.__file__).parents[1]), "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-m", "eaglet.cli", "bench", "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "--results-dir" in proc.stdout and "eaglet-bench-results" in proc.stdout
    from eaglet.bench import suite

    assert Path(suite.__file__).parent == Path(eaglet.__file__).parent / "bench"


def test_results_go_to_the_current_directory_by_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args([*TINY_RUN, "--batch-sizes", "1", "--modes", "plain", "--hf-batch-sizes", "",
                              "--vllm-batch-sizes", "", "--no-roofline", "--workdir", str(tmp_path / "ckpt")])
    assert bench.run(args) == 0
    (record_file,) = (tmp_path / "eaglet-bench-results").glob("bench-*.json")
    assert json.loads(record_file.read_text())["checkpoints"][0]["checkpoint"] == "deepseek-fp32"


def test_bench_runs_every_engine_and_records_the_fields(tmp_path, capsys):
    code, record = run_bench(tmp_path, "--batch-sizes", "1,2", "--modes", "plain,chain", "--hf-batch-sizes", "1",
                             "--vllm-batch-sizes", "1", "--vllm-venv", str(tmp_path / "no-venv"),
                             "--llama-cpp-batch-sizes", "1", "--llama-cpp-dir", str(tmp_path / "no-llama.cpp"),
                             "--prefill-len", "16", "--json", str(tmp_path / "copy.json"))
    assert code == 0
    out = capsys.readouterr().out
    assert "vLLM-CPU skipped: no vLLM venv at" in out and "tools/bench_setup_vllm.sh" in out
    assert "llama.cpp skipped: not built under" in out and "tools/bench_setup_llama_cpp.sh" in out
    assert json.loads((tmp_path / "copy.json").read_text()) == record
    (ck,) = record["checkpoints"]
    assert ck["checkpoint"] == "deepseek-fp32" and ck["dtype"] == "float32" and ck["params"] > 0
    rows = {(r["engine"], r["mode"], r["batch"]): r for r in ck["rows"]}
    assert set(rows) == {("eaglet", "plain", 1), ("eaglet", "chain", 1), ("eaglet", "plain", 2),
                         ("eaglet", "chain", 2), ("transformers", "plain", 1), ("eaglet", "prefill", 1)}
    prefill = rows.pop(("eaglet", "prefill", 1))
    assert prefill["prompt_len"] == 16 and prefill["tokens_per_s"] > 0 and prefill["itl_ms"] is None
    assert not [key for key in prefill if key.startswith("over_")]  # prompt tokens/s: no decode ratios
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and row["ttft_ms"] > 0 and row["itl_ms"] > 0
    for batch in (1, 2):
        chain = rows["eaglet", "chain", batch]
        for field in SPEC_FIELDS:
            assert field in chain, field
        assert 1.0 <= chain["accept_length"] <= 4.0
        assert len(chain["per_position_acceptance"]) == 3
        assert abs(sum(chain["phase_share"].values()) - 1.0) < 1e-6
        # greedy speculation is lossless: the same tokens as plain decoding
        assert chain["same_tokens_as_eaglet_plain"]
        roof = rows["eaglet", "plain", batch]["roofline"]
        assert roof["bytes_per_step"] > 0 and roof["achieved_gbps"] > 0 and roof["read_gbps"] > 0
    assert rows["eaglet", "plain", 1]["over_transformers"] > 0
    assert "over_transformers" not in rows["eaglet", "plain", 2]  # transformers ran at batch 1 only
    assert any("vLLM-CPU skipped" in note for note in ck["notes"])
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.run(parser.parse_args(["--history", "--results-dir", str(tmp_path / "results")])) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith("| 2/2 |")  # both chain rows lossless


def test_short_runs_repeat_until_the_minimum_time(tmp_path):
    """Engines whose runs are short run again, up to --max-repeats; --repeats is the least."""
    code, record = run_bench(tmp_path, "--batch-sizes", "1", "--modes", "plain,chain", "--hf-batch-sizes", "1",
                             "--vllm-batch-sizes", "", "--no-roofline", "--min-seconds", "1e9", "--max-repeats", "3")
    assert code == 0
    (ck,) = record["checkpoints"]
    assert sorted((r["engine"], r["mode"], r["repeats"], len(r["tokens_per_s_runs"])) for r in ck["rows"]) == [
        ("eaglet", "chain", 3, 3), ("eaglet", "plain", 3, 3), ("transformers", "plain", 3, 3)]
    code, record = run_bench(tmp_path / "again", "--batch-sizes", "1", "--modes", "plain", "--hf-batch-sizes", "",
                             "--vllm-batch-sizes", "", "--no-roofline", "--repeats", "2", "--max-repeats", "5")
    (ck,) = record["checkpoints"]
    assert [r["repeats"] for r in ck["rows"]] == [2]  # --min-seconds 0: the --repeats runs only


def test_failing_vllm_venv_is_reported_not_fatal(tmp_path):
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\necho 'vllm exploded' >&2\nexit 3\n")
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    code, record = run_bench(tmp_path, "--batch-sizes", "1", "--modes", "plain", "--hf-batch-sizes", "",
                             "--vllm-batch-sizes", "1", "--vllm-venv", str(tmp_path / "venv"), "--no-roofline")
    assert code == 0
    (ck,) = record["checkpoints"]
    assert [r["engine"] for r in ck["rows"]] == ["eaglet"]
    assert any("vLLM run failed (exit 3): vllm exploded" in note for note in ck["notes"])


def test_a_failed_vllm_run_reports_its_root_cause():
    """vLLM's engine says only that its core failed to start; the note names the worker's exception."""
    stderr = "\n".join([
        "INFO 12-06 starting",
        "(Worker pid=1) ERROR 12-06 [multiproc_executor.py:953] Traceback (most recent call last):",
        "(Worker pid=1) ERROR 12-06 [multiproc_executor.py:953] RuntimeError: expect weight to be bfloat16",
        "    raise RuntimeError(",
        "RuntimeError: Engine core initialization failed. See root cause above.",
    ])
    assert vllm_failure(stderr) == "RuntimeError: expect weight to be bfloat16"
    # vllm-cpu 0.32 on an int4 MoE checkpoint: the worker process's own pointer comes first.
    stderr = "\n".join([
        "Exception: WorkerProc initialization failed due to an exception in a background process. See stack trace",
        "(Worker pid=5198) ERROR 12-07 [multiproc_executor.py:953] NotImplementedError: No WNA16 MoE backend "
        "supports the deployment configuration.",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
    ])
    assert vllm_failure(stderr) == "NotImplementedError: No WNA16 MoE backend supports the deployment configuration."
    assert vllm_failure("one\ntwo") == "one | two"


def test_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "bench.png"
    code, record = run_bench(tmp_path, "--batch-sizes", "1", "--modes", "plain,tree,adaptive-tree", "--hf-batch-sizes", "",
                             "--vllm-batch-sizes", "", "--no-roofline", "--plot", str(out))
    assert code == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (ck,) = record["checkpoints"]
    (tree,) = [r for r in ck["rows"] if r["mode"] == "tree"]
    assert len(tree["per_position_acceptance"]) == 4
    assert set(tree["decode_steps_per_level"]) == {"off"} | {f"{kind} {d}" for kind in ("tree", "chain") for d in range(1, 5)}
    assert tree["decode_steps_per_level"]["tree 4"] == sum(tree["decode_steps_per_level"].values())  # a fixed shape
    (adaptive,) = [r for r in ck["rows"] if r["mode"] == "adaptive-tree"]
    assert adaptive["same_tokens_as_eaglet_plain"] and sum(adaptive["decode_steps_per_level"].values()) > 0


def test_spec_shapes_are_configurable_and_recorded(tmp_path):
    code, record = run_bench(tmp_path, "--batch-sizes", "1", "--modes", "plain,chain", "--hf-batch-sizes", "",
                             "--vllm-batch-sizes", "", "--no-roofline", "--chain-shape", "2,1,3")
    assert code == 0
    assert record["spec_shapes"]["chain"] == {"num_steps": 2, "eagle_topk": 1, "num_draft_tokens": 3}
    assert record["checkpoints"][0]["spec_shapes"] == {"chain": {"num_steps": 2, "eagle_topk": 1, "num_draft_tokens": 3}}
    (chain,) = [r for r in record["checkpoints"][0]["rows"] if r["mode"] == "chain"]
    assert len(chain["per_position_acceptance"]) == 2 and 1.0 <= chain["accept_length"] <= 3.0
    for bad in ("3,2,4", "3,1", "0,1,4"):
        with pytest.raises(SystemExit, match="chain-shape"):
            run_bench(tmp_path / bad, "--modes", "plain,chain", "--chain-shape", bad)
    with pytest.raises(SystemExit, match="adaptive-tree-shape 2,2,9: .*exceeds the 6 candidates"):
        run_bench(tmp_path / "tree", "--modes", "plain,adaptive-tree", "--adaptive-tree-shape", "2,2,9")


def test_the_demo_drafts_deeper_unless_told_otherwise():
    """The demo's adaptive mode may draft to depth 15 (its trained draft accepts all of a depth-7
    chain); the other checkpoints' to 7; --adaptive-shape sets both."""
    defaults = argparse.Namespace(chain_shape=None, tree_shape=None, adaptive_shape=None, adaptive_tree_shape=None)
    assert spec_shapes(defaults, "demo")["adaptive"] == (15, 1, 16)
    assert spec_shapes(defaults, "deepseek-bf16")["adaptive"] == (7, 1, 8)
    told = argparse.Namespace(**{**vars(defaults), "adaptive_shape": "5,1,6"})
    assert spec_shapes(told, "demo")["adaptive"] == (5, 1, 6)


def _row(mode: str, batch: int, **fields) -> dict:
    return {"engine": "eaglet", "mode": mode, "batch": batch, "tokens_per_s": 1.0, **fields}


def test_history_prints_each_kept_run_oldest_first(tmp_path, capsys):
    results = tmp_path / "results"
    results.mkdir()
    full = {"machine": {"eaglet_git": "abc1234", "cpu_model": "AMD EPYC", "tile_backend": "avx512_bf16"}, "checkpoints": [
        {"checkpoint": "deepseek-bf16", "rows": [
            _row("plain", 1, over_vllm=2.5, over_transformers=5.25, roofline={"step_over_floor": 0.95}),
            _row("plain", 16, over_vllm=1.8, over_transformers=4.4),
            _row("chain", 1, over_vllm=2.3, over_vllm_mode="chain", same_tokens_as_eaglet_plain=True),
            _row("chain", 16, over_vllm=1.9, over_vllm_mode="plain", phase_share={"bookkeeping": 0.05},
                 same_tokens_as_eaglet_plain=True),
            {"engine": "vllm", "mode": "chain", "batch": 1, "tokens_per_s": 1.0, "same_tokens_as_vllm_plain": False},
        ]},
        {"checkpoint": "demo", "rows": [
            _row("plain", 64),
            _row("adaptive", 1, over_eaglet_plain=2.44, same_tokens_as_eaglet_plain=True),
            _row("adaptive", 16, over_eaglet_plain=1.84, phase_share={"bookkeeping": 0.084}, same_tokens_as_eaglet_plain=True),
            _row("tree", 16, over_eaglet_plain=1.26, phase_share={"bookkeeping": 0.104}, same_tokens_as_eaglet_plain=False),
            _row("adaptive", 64, over_eaglet_plain=1.2),
            _row("tree", 64, over_eaglet_plain=0.93),
        ]},
    ]}
    demo_only = {"machine": {"cpu_model": "Intel(R) Xeon(R) Processor"},
                 "checkpoints": [{"checkpoint": "demo", "rows": [_row("chain", 64, over_eaglet_plain=1.1)]}]}
    (results / "bench-20261201-000000.json").write_text(json.dumps(demo_only))
    (results / "bench-20261202-000000.json").write_text(json.dumps(full))
    (results / "bench-20261203-000000.json").write_text("{not json")
    (results / "bench-20261204-000000.json").write_text("[1, 2]")
    (results / "notes.json").write_text("{}")  # not a bench record: not listed
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.run(parser.parse_args(["--history", "--results-dir", str(results)])) == 0
    header, rule, *lines = capsys.readouterr().out.strip().splitlines()
    assert header.startswith("| run | git | machine | plain/vLLM B1 | plain/vLLM B16 | chain/vLLM B1 | chain/vLLM B16 |")
    assert [line.split(" | ")[0] for line in lines] == ["| 20261201-000000", "| 20261202-000000", "| 20261203-000000",
                                                         "| 20261204-000000"]
    old, new, broken, not_a_record = (line.strip("| ").split(" | ") for line in lines)
    # every figure of the demo-only run but the slowest batch-64 mode (and the lossless count: no field) is missing
    assert old == ["20261201-000000", "-", "Xeon"] + ["-"] * 10 + ["1.10"] + ["-"] * 3
    # chain/vLLM B16 compared against vLLM's plain decoding, not its chain: not a chain figure
    assert new == ["20261202-000000", "abc1234", "EPYC/avx512_bf16", "2.50", "1.80", "2.30", "-", "5.25", "4.40", "0.95", "2.44", "1.84",
                   "1.20", "0.93", "10.4%", "5.0%", "4/5"]
    assert broken[1].startswith("unreadable")
    assert not_a_record[1] == "unreadable: not a bench record (a JSON list)"


@pytest.mark.parametrize("flags", [["--repeats", "0"], ["--max-repeats", "0"], ["--min-seconds", "-1"]])
def test_bad_repeat_counts_are_refused_before_anything_runs(tmp_path, flags):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--results-dir", str(tmp_path / "results"), "--workdir", str(tmp_path / "ckpt"), *flags])
    with pytest.raises(SystemExit, match="--repeats and --max-repeats must be >= 1"):
        bench.run(args)
    assert not (tmp_path / "results").exists() and not (tmp_path / "ckpt").exists()


def test_history_without_runs_says_where_it_looked(tmp_path):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with pytest.raises(SystemExit, match="no bench-\\*.json in"):
        bench.run(parser.parse_args(["--history", "--results-dir", str(tmp_path)]))


def test_tensor_parallel_bench_compares_layouts_on_one_checkpoint(tmp_path, capsys):
    code, record = run_bench(tmp_path, "--tp-size", "2", "--batch-sizes", "1,4")
    assert code == 0 and record["benchmark"] == "eaglet-bench-tp"
    (result,) = record["checkpoints"]
    assert set(result["layouts"]) == {"tp1", "tp2", "tp2-ep"}
    for label, rows in result["layouts"].items():
        assert set(rows) == {"1", "4"}  # JSON keys
        for row in rows.values():
            assert row["decode_tok_s"] > 0 and row["same_tokens_as_tp1"]  # float32: the same tokens
            assert (row["collectives_per_step"] > 0) == (label != "tp1")
            assert 0 <= row["collective_share"] < 1
    assert "tp2-ep" in capsys.readouterr().out


@pytest.mark.skipif(llama_cpp_tool(DEFAULT_LLAMA_CPP_DIR, "llama-greedy-ids") is None,
                    reason="llama.cpp not built here (bash tools/bench_setup_llama_cpp.sh)")
def test_llama_cpp_runs_beside_eaglet_on_the_same_weights(tmp_path):
    """llama.cpp's f32 conversion decodes transformers' float32 tokens; its decode and prefill rows
    sit beside eaglet's, with eaglet's ratio over the GGUF type of eaglet's weight format."""
    # The bench's own 72M checkpoint: on the test-sized one (hidden 64) llama.cpp's greedy tokens part
    # from transformers' after a few steps.
    code, record = run_bench(tmp_path, "--size", "full", "--batch-sizes", "1,2", "--modes", "plain",
                             "--hf-batch-sizes", "", "--vllm-batch-sizes", "", "--no-roofline", "--llama-cpp-batch-sizes", "1,2",
                             "--llama-cpp-types", "f32,q8_0", "--prefill-len", "16")
    assert code == 0
    (ck,) = record["checkpoints"]
    assert ck["llama_cpp_token_check"]["same_tokens"], ck["llama_cpp_token_check"]
    rows = {(r["engine"], r["mode"], r["batch"]): r for r in ck["rows"]}
    for gguf_type in ("f32", "q8_0"):
        for batch in (1, 2):
            assert rows["llama.cpp", gguf_type, batch]["tokens_per_s"] > 0
        assert rows["llama.cpp", f"prefill-{gguf_type}", 1]["prompt_len"] == 16
    plain = rows["eaglet", "plain", 1]
    assert plain["over_llama_cpp"] == plain["over_llama_cpp_by_type"]["f32"]
    assert set(plain["over_llama_cpp_by_type"]) == {"f32", "q8_0"}
    prefill = rows["eaglet", "prefill", 1]
    assert prefill["over_llama_cpp"] == pytest.approx(
        prefill["tokens_per_s"] / rows["llama.cpp", "prefill-f32", 1]["tokens_per_s"])
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*.gguf")) == [
        "deepseek-full-alpha1.0.f32.gguf", "deepseek-full-alpha1.0.q8_0.gguf"]


@pytest.mark.parametrize("flags, message", [
    (("--prefill-len", "-1"), "--prefill-len must be >= 0"),
    (("--llama-cpp-batch-sizes", "1,x"), "--llama-cpp-batch-sizes: a comma list of positive integers"),
    (("--llama-cpp-batch-sizes", "0"), "--llama-cpp-batch-sizes: a comma list of positive integers"),
    (("--llama-cpp-types", "q3_x"), "--llama-cpp-types: unknown q3_x"),
])
def test_malformed_llama_cpp_and_prefill_flags_stop_the_run_before_anything_is_built(tmp_path, flags, message):
    with pytest.raises(SystemExit, match=message):
        run_bench(tmp_path, "--modes", "plain", *flags)
    assert not (tmp_path / "ckpt").exists()


def test_quantization_flags_apply_to_int4_checkpoints_only(tmp_path):
    """``--activation-quantization int8`` and ``--quantized-layers all`` on a float32 checkpoint:
    eaglet runs as stored, and the record says the flags were not applied (the int4 case runs in
    tests/test_moonlight_checkpoint.py)."""
    code, record = run_bench(tmp_path, "--batch-sizes", "1", "--modes", "plain", "--hf-batch-sizes", "",
                             "--vllm-batch-sizes", "", "--activation-quantization", "int8", "--quantized-layers", "all")
    assert code == 0
    (ck,) = record["checkpoints"]
    assert ck["activation_quantization"] is None and ck["quantized_layers"] == "experts"
    assert "--activation-quantization int8: not applied (no int4 weights)" in ck["notes"]
    assert "--quantized-layers all: not applied (no int4 weights)" in ck["notes"]


def test_the_read_floor_counts_the_experts_a_decoder_stack_routes(tmp_path):
    """The stack routes in C++, past RoutedExperts.forward: while the counter counts, the layers
    run one by one, so every MoE layer's distinct experts are seen; the stack is back afterwards."""
    import torch

    from eaglet import LLM, SamplingParams
    from eaglet.bench.roofline import ExpertCounter
    from eaglet.testing.checkpoints import write_deepseek_v3_checkpoint

    path = write_deepseek_v3_checkpoint(tmp_path / "ckpt", seed=4, dtype=torch.bfloat16)
    llm = LLM(str(path), dtype="bfloat16", show_progress=False)
    stack = llm.engine.model.model.decoder_stack
    counter = ExpertCounter(llm.engine.model)
    with counter:
        counter.decode = True
        llm.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(max_new_tokens=4, temperature=0.0))
    distinct = counter.mean_distinct()
    assert distinct and all(count >= 2 for count in distinct.values())  # top-2 routing: 2 experts a token
    assert llm.engine.model.model.decoder_stack is stack
