"""The bench's table on stdout: one line per engine, mode and batch size."""

from __future__ import annotations


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


HEADER = (f"{'checkpoint':<14} {'engine':<12} {'mode':<13} {'B':>3} | {'tok/s':>8} {'TTFT ms':>8} {'ITL ms':>7} | "
          f"{'accept':>6} {'bookkeep':>8} | {'/plain':>6} {'/HF':>6} {'/vLLM':>6} {'/llama':>6} | {'GB/s':>6} {'/floor':>6}")


def row_line(name: str, r: dict) -> str:
    roof = r.get("roofline", {})
    share = r.get("phase_share", {})
    own_plain = r.get(f"over_{r['engine']}_plain")
    return (f"{name:<14} {r['engine']:<12} {r['mode']:<13} {r['batch']:>3} | {r['tokens_per_s']:>8.1f} "
            f"{r['ttft_ms']:>8.1f} {_fmt(r.get('itl_ms'), '7.2f'):>7} | {_fmt(r.get('accept_length'), '6.2f'):>6} "
            f"{_fmt(share.get('bookkeeping'), '8.1%'):>8} | {_fmt(own_plain, '6.2f'):>6} "
            f"{_fmt(r.get('over_transformers'), '6.2f'):>6} {_fmt(r.get('over_vllm'), '6.2f'):>6} "
            f"{_fmt(r.get('over_llama_cpp'), '6.2f'):>6} | "
            f"{_fmt(roof.get('achieved_gbps'), '6.1f'):>6} {_fmt(roof.get('step_over_floor'), '6.2f'):>6}")


def print_table(record: dict) -> None:
    print(f"\n=== eaglet bench: {record['args']['new_tokens']} new tokens, prompt {record['args']['prompt_len']}, "
          f"median of {record['args']['repeats']}+ runs (until {record['args']['min_seconds']:g} s, "
          f"at most {record['args']['max_repeats']}) ===")
    machine = record.get("machine", {})
    print(f"cpu {machine.get('cpu_model')}, bfloat16 tile kernels on {machine.get('tile_backend') or 'none'}")
    if machine.get("kernels_unavailable"):
        print(f"eaglet ran PyTorch ops, its CPU kernels unavailable: {machine['kernels_unavailable']}")
    if record.get("bandwidth"):
        print(f"memory read bandwidth {record['bandwidth']['read_gbps']:.1f} GB/s")
    print(HEADER)
    print("-" * len(HEADER))
    for ck in record["checkpoints"]:
        for r in sorted(ck["rows"], key=lambda r: (r["batch"], r["engine"] != "eaglet", r["engine"], r["mode"])):
            print(row_line(ck["checkpoint"], r))
        for note in ck["notes"]:
            print(f"  note ({ck['checkpoint']}): {note}")
    print("\ncolumns: tok/s = decode tokens/s (tokens after each request's first / decode time); TTFT = start to "
          "every request holding a token; ITL = decode time / (new_tokens - 1); accept = accept length (bonus "
          "included); bookkeep = share of a speculative round outside the draft and verify forwards; /plain = tok/s "
          "over the same engine's plain decoding; /HF, /vLLM = eaglet tok/s over transformers, vLLM at that batch "
          "size (vLLM's EAGLE-3 chain for eaglet's chain and adaptive rows, its plain decoding otherwise); /llama = "
          "eaglet over llama.cpp's decoding of the GGUF type with eaglet's weight format (f32, bf16, q4_0-experts for int4 "
          "experts, q4_0 under --quantized-layers all); "
          "prefill rows: tok/s = prompt tokens/s of one --prefill-len prompt; GB/s = bytes a plain decode step "
          "must read / step time; /floor = step time / (those bytes / read bandwidth)")
