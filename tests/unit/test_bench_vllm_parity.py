"""bench.vllm_parity's pure parts: the api_server flags built from the rollout's engine arguments (read back by
vLLM's own parser), the load generator's arguments, and the figures computed from its results. No timing."""

from __future__ import annotations

import pytest

from bench.vllm_parity import OUTPUT_TOKENS, PROMPT_TOKENS, api_server_args, judge, load_args, per_request, summarise


def _engine_args() -> dict:
    """The shape of VllmEngine._engine_args on the CPU (bench.vllm_parity.rollout_engine_args)."""
    return {
        "model": "/m/policy",
        "tokenizer": "/m/policy",
        "dtype": "float32",
        "seed": 1234,
        "enforce_eager": True,
        "max_model_len": 512,
        "max_num_seqs": 256,
        "worker_extension_cls": "services.rollout.vllm_ext.WorkerExtension",
        "logprobs_mode": "processed_logprobs",
        "disable_log_stats": True,
        "weight_transfer_config": object(),
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": 8192,
        "tensor_parallel_size": 1,
        "quantization": None,
    }


def test_api_server_args_carry_every_engine_argument_vllm_reads_back():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser  # noqa: PLC0415 - vLLM is heavy; this test only
    from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: PLC0415 - as above

    flags, left = api_server_args(_engine_args())
    assert set(left) == {"worker_extension_cls", "weight_transfer_config"}
    assert "--quantization" not in flags  # None: vLLM's default
    assert "--no-enable-chunked-prefill" in flags and "--enforce-eager" in flags
    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(flags)
    for key, value in _engine_args().items():
        if key not in left and value is not None:
            assert getattr(ns, key) == value, key


def test_api_server_args_refuse_a_value_without_a_flag_form():
    with pytest.raises(TypeError, match="max_loras"):
        api_server_args({"max_loras": [1, 2]})


def test_load_args_are_the_random_streamed_workload():
    from vllm.benchmarks.serve import add_cli_args  # noqa: PLC0415 - vLLM is heavy; this test only
    from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: PLC0415 - as above

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    ns = parser.parse_args(load_args("http://127.0.0.1:9", "/m/policy", 8, 24, seed=7))
    assert (ns.dataset_name, ns.backend, ns.endpoint) == ("random", "openai", "/v1/completions")
    assert (ns.random_input_len, ns.random_output_len) == (PROMPT_TOKENS, OUTPUT_TOKENS)
    assert (ns.max_concurrency, ns.num_prompts, ns.seed) == (8, 24, 7)
    assert ns.ignore_eos and ns.save_detailed and ns.temperature == 1.0
    assert ns.metric_percentiles == "50,99"


def _result(ttfts, latencies, lens, errors, duration):
    return {
        "ttfts": ttfts,
        "latencies": latencies,
        "output_lens": lens,
        "errors": errors,
        "total_output_tokens": sum(n for n, e in zip(lens, errors, strict=True) if not e),
        "duration": duration,
        "output_throughput": sum(lens) / duration,
    }


def test_per_request_tpot_as_vllm_computes_it_and_failures_dropped():
    res = _result([0.1, 0.2, 0.0, 0.3], [0.73, 0.2, 0.0, 0.9], [64, 1, 0, 4], ["", "", "boom", ""], 1.0)
    rows = per_request(res)
    assert [r["ttft"] for r in rows] == [0.1, 0.2, 0.3]
    assert rows[0]["tpot"] == pytest.approx(0.01)  # (0.73 - 0.1) / 63
    assert rows[1]["tpot"] is None  # one token: no time per output token
    assert rows[2]["tpot"] == pytest.approx(0.2)


def test_summarise_pools_rounds():
    a = _result([0.010, 0.030], [0.640, 0.660], [64, 64], ["", ""], 2.0)
    b = _result([0.020, 0.040], [0.650, 0.670], [64, 64], ["", "x"], 1.0)
    s = summarise([a, b])
    assert s["output_tokens_per_s"] == pytest.approx(192 / 3.0, rel=1e-3)  # all tokens over all wall time
    assert (s["requests"], s["failed"]) == (3, 1)
    assert s["ttft_p50_ms"] == pytest.approx(20.0)
    assert s["ttft_p99_ms"] == pytest.approx(30.0)
    assert s["tpot_p50_ms"] == pytest.approx(10.0)


def test_judge_meets_and_misses_at_the_bounds():
    def side(tps, ttft):
        return {"output_tokens_per_s": tps, "ttft_p50_ms": ttft, "tpot_p50_ms": 10.0}

    figures = {
        "c1": {"rlhf": side(95.0, 11.0), "vllm": side(100.0, 10.0)},
        "c8": {"rlhf": side(94.0, 11.5), "vllm": side(100.0, 10.0)},
    }
    ratio, targets = judge(figures)
    assert ratio["c1"]["output_tokens_per_s"] == pytest.approx(0.95)
    assert [t["met"] for t in targets] == [True, True, False, False]
    assert "concurrency 8" in targets[2]["figure"]


def _md() -> str:
    return "\n".join(
        [
            "# Benchmarks",
            "",
            "## Targets",
            "",
            "| benchmark | figure | value | target | met |",
            "|---|---|---|---|---|",
            "| bench.queue | q | 1 | < 2 | yes |",
            "",
            "## Queue: experience records through rlhf.transport vs raw Redis",
            "",
            "queue body",
            "",
            "## Rollout engines: generated tokens/s, vllm vs hf",
            "",
            "engines body",
            "",
        ]
    )


def _parity_result(tps: float) -> dict:
    side_row = {
        "output_tokens_per_s": tps,
        "ttft_p50_ms": 10.0,
        "ttft_p99_ms": 12.0,
        "tpot_p50_ms": 5.0,
        "tpot_p99_ms": 6.0,
        "server_cpu_ms_per_request": 30.0,
        "requests": 4,
        "failed": 0,
    }
    figures = {"c1": {"rlhf": dict(side_row), "vllm": {**side_row, "output_tokens_per_s": 100.0}}}
    ratio, targets = judge(figures)
    return {
        "figures": figures,
        "ratio": ratio,
        "targets": targets,
        "notes": ["n"],
        "settings": {"rounds": 2},
        "machine": {"load_average": [1.0, 1.0, 1.0]},
        "command": "python -m bench.vllm_parity --quick",
        "seconds": 1.0,
    }


def test_report_splice_adds_then_replaces_one_section_and_its_target_rows():
    from bench.report import splice  # noqa: PLC0415 - beside the parity bench's own imports, for this test only

    once = splice(_md(), "vllm_parity", _parity_result(90.0))
    twice = splice(once, "vllm_parity", _parity_result(99.0))
    for md, ratio in ((once, "0.9"), (twice, "0.99")):
        assert md.count("## vLLM parity") == 1
        assert md.count("| bench.vllm_parity |") == 2  # two targets at one concurrency
        assert f"| 1 | rlhf serve rollout | {float(ratio) * 100:g} | {ratio} |" in md
        assert "queue body" in md and "engines body" in md and "| bench.queue | q |" in md
        # the rows follow the table they belong to, before the first section
        assert md.index("| bench.vllm_parity |") < md.index("## Queue")
    assert "`python -m bench.vllm_parity --quick`" in twice
    middle = splice(twice, "queue", None)  # a section between two others: replaced up to the next heading
    assert "queue body" not in middle and "`python -m bench.queue` produced no result." in middle
    assert "| bench.queue | did not produce a result (see its log) |" in middle
    assert middle.index("produced no result.\n\n## Rollout engines") > 0
