"""The benchmark's scenarios on a tiny budget: their numbers' shape, not their speed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jsonschema
import pytest

from llmsession import GenerationOptions, Model
from llmsession.commands.bench import arrivals as bench_arrivals
from llmsession.commands.bench import concurrent as bench_concurrent
from llmsession.commands.bench import drafting as bench_drafting
from llmsession.commands.bench import rpc as bench_rpc
from llmsession.commands.bench import serve_bench as bench_serve
from llmsession.commands.bench import structured as bench_structured
from llmsession.commands.bench import tokenize as bench_tokenize
from llmsession.commands.bench import tools as bench_tools
from llmsession.commands.bench.main import QUESTIONS, multi_turn
from llmsession.commands.bench.report import MeasuredTurn as Turn


def test_multi_turn_reports_every_turn_and_reuses_the_cache(smollm2: Model) -> None:
    options = GenerationOptions(max_tokens=4, temperature=0)
    result = multi_turn(smollm2, list(QUESTIONS[:3]), options, think=1.0, samples=2)  # (room on a busy CPU)
    json.dumps(result)  # everything lands in --json as is
    assert len(result["cache"]) == len(result["fresh"]) == len(result["new_tokens"]) == 3
    assert len(result["ttft_median_s"]) == 3 and min(result["ttft_median_s"]) > 0  # with a fork's
    cached = [Turn(**row) for row in result["cache"]]
    fresh = [Turn(**row) for row in result["fresh"]]
    assert cached[0].reused_tokens == 0
    assert cached[1].reused_tokens > cached[1].anticipated_tokens > 0  # decoded while "thinking"
    assert all(t.reused_tokens == 0 and t.decoded_prompt_tokens == t.prompt_tokens for t in fresh)
    assert [t.prompt_tokens for t in cached] == [t.prompt_tokens for t in fresh]
    summary = result["summary"]
    assert {"cache", "fresh", "cache_decoded_over_new", "cache_over_fresh_ttft_last"} <= set(summary)
    assert summary["new_tokens"] == sum(result["new_tokens"]) > 0


def test_structured_scenario_reports_both_contenders_rates(smollm2_path: Path) -> None:
    args = argparse.Namespace(model=smollm2_path, threads=2, repeats=1, max_tokens=24, peer=None)
    results = bench_structured.run(args)
    json.dumps(results)
    for name, runs in results["ours"].items():
        assert len(runs["plain"]) == len(runs["schema"]) == 1
        assert all(run["tokens"] > 1 and run["tokens_per_s"] > 0 for run in runs["plain"] + runs["schema"])
        schema_run = runs["schema"][0]
        if schema_run["finish"] == "complete":
            jsonschema.validate(json.loads(schema_run["text"]), bench_structured.CASES[name]["schema"])
        else:
            assert schema_run["finish"] == "length" and schema_run["tokens"] == 24


def test_tools_scenario_measures_every_format_and_a_conversation_that_decodes_once(
    smollm2_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = argparse.Namespace(model=smollm2_path, threads=2, repeats=1, max_tokens=8, turns=2)
    results = bench_tools.run(args)
    json.dumps(results)
    assert list(results["formats"]) == ["generic", "hermes", "gemma4"]  # (the fixtures are built)
    for result in results["formats"].values():
        assert len(result["speed"]["none"]) == len(result["speed"]["auto"]) == 1
        assert result["speed"]["mask_ms"] > 0
        talk = result["conversation"]
        assert talk["cut"] == 0 and 0 < talk["decoded"] <= 1.05 * talk["new"], talk
    bench_tools.report(results)
    assert "decoded/new" in capsys.readouterr().out


def test_rpc_scenario_runs_every_contender_and_prints_its_table(
    smollm2_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = argparse.Namespace(
        model=smollm2_path, threads=2, repeats=1, max_tokens=4, turns=2, rpc=None, server_threads=1
    )
    results = bench_rpc.run(args)
    json.dumps(results)
    assert list(results["contenders"]) == [name for name, _, _ in bench_rpc.CONTENDERS]
    for runs in results["contenders"].values():
        (run,) = runs
        assert len(run["ttft_s"]) == 2 and min(run["tokens_per_s"]) > 0
    assert results["contenders"]["local, worker"][0]["call_s"] > 0
    bench_rpc.report(results)
    assert "rpc, worker" in capsys.readouterr().out


def test_concurrent_scenario_reports_each_count_and_a_missing_reference(
    smollm2: Model, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    options = GenerationOptions(max_tokens=4, temperature=0)
    results = bench_concurrent.scenario(smollm2, [1, 2], options, tmp_path / "llama-bench", repeats=1)
    json.dumps(results)
    assert list(results["streams"]) == ["1", "2"]
    for sides in results["streams"].values():
        for run in sides.values():
            assert run["tokens_per_s"] > 0 and len(run["runs_tokens_per_s"]) == 1
    assert "llama-batched-bench not found" in results["batched_bench"]["error"]
    arrived = bench_arrivals.arrivals(smollm2, tmp_path / "llama-batched-bench", 1, long_tokens=300)
    json.dumps(arrived)
    mid, together = arrived["long_prompt_mid_stream"], arrived["prompts_together"]
    assert mid["ttft_s"] > 0 and mid["alone_ttft_s"] > 0 and mid["gap_ratio"] >= 1
    assert len(together["runs"][0]["ttft_s"]) == 4 and "ratio" not in together
    bench_concurrent.report(
        results
        | {"machine": {"cpu": "x", "cores": 2, "threads": 2, "llama_cpp_commit": "c"}}
        | {"model": "m", "max_tokens": 4, "prefill_checks": {"native": 1.0, "python": 2.0}}
        | {"arrivals": arrived}
    )
    out = capsys.readouterr().out
    assert "llama-batched-bench: llama-batched-bench not found" in out and "concurrent streams" in out
    assert "300-token prompt arriving while 3 streams generate" in out and "4 prompts of" in out


def test_serve_scenario_resends_histories_our_server_serves_from_cache_and_skips_missing_peers(
    smollm2_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "serve.json"
    argv = ["--conversations", "2", "--turns", "2", "--clients", "1", "--max-tokens", "4", "--threads", "2"]
    argv += ["--model", str(smollm2_path), "--json", str(out), "--peers", "llama-server,llama-cpp-python"]
    argv += ["--llama-server", str(tmp_path / "absent"), "--peer-python", str(tmp_path / "no-python")]
    assert bench_serve.main(argv) == 0
    results = json.loads(out.read_text())
    servers = results["servers"]
    assert "not found" in servers["llama-server"]["skipped"]
    assert "not importable" in servers["llama-cpp-python"]["skipped"]
    ours = servers["llmsession"]
    assert [(t["turn"], t["requests"]) for t in ours["turns"]] == [(1, 2), (2, 2)] and ours["wall_s"] > 0
    requests = {(r["conversation"], r["turn"]): r for r in ours["requests"]}
    assert len(requests) == 4 and all(r["ttft_s"] > 0 and r["prompt_tokens"] > 500 for r in requests.values())
    assert ours["turns"][1]["cached_share"] > 0.5
    for c in (0, 1):  # the whole first turn reused, not only the system prompt every chat shares
        assert requests[c, 2]["cached_tokens"] >= requests[c, 1]["prompt_tokens"], requests[c, 2]
    assert results["ratios"]["cached_share"]["value"] == ours["later"]["cached_share"]
    printed = capsys.readouterr().out
    assert "cached share" in printed and "llama-server: skipped" in printed


def test_the_peer_script_is_found_from_the_package() -> None:
    """``bench --peer`` runs scripts/bench_peer.py from the repository; moving the bench modules
    once lost it (the peer was skipped, not failed)."""
    from llmsession.commands.bench.common import PEER_SCRIPT

    assert PEER_SCRIPT.is_file(), PEER_SCRIPT


def test_drafting_scenario_compares_drafted_and_plain_replies(
    smollm2: Model, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = bench_drafting.WORKLOADS["paragraph"][:1]
    result = bench_drafting.workload(smollm2, prompts, 24, 1)
    json.dumps(result)
    assert result["plain_tokens_per_s"] > 0 and result["drafted_tokens_per_s"] > 0
    assert result["same_replies"] in ("0/1", "1/1") and len(result["samples"]["drafted"]) == 1
    machine = {"cpu": "x", "cores": 2, "threads": 2, "llama_cpp_commit": "c"}
    bench_drafting.report({"machine": machine, "model": "m", "workloads": {"paragraph": result}})
    assert "drafted tokens from the prompt" in capsys.readouterr().out


def test_tokenize_scenario_times_each_turn_three_ways(
    smollm2: Model, smollm2_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with Model(smollm2_path, threads=2) as client:
        turns = bench_tokenize.chat(smollm2, client, 3)
    json.dumps(turns)
    assert [len(t) for t in turns] == [4] * 3 and turns[0]["prompt_tokens"] < turns[-1]["prompt_tokens"]
    assert all(t["session_ms"] > 0 and t["client_ms"] > 0 and t["whole_ms"] > 0 for t in turns)
    machine = {"cpu": "x", "cores": 2, "threads": 2, "llama_cpp_commit": "c"}
    bench_tokenize.report({"machine": machine, "model": "m", "turns": turns})
    assert "median whole_ms" in capsys.readouterr().out


def test_models_scenario_resumes_named_conversations_after_each_switch_and_skips_a_missing_router(
    smollm2_path: Path, gemma3_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from llmsession.commands.bench import models as bench_models

    out = tmp_path / "models.json"
    argv = ["--rounds", "2", "--rules", "4", "--max-tokens", "4", "--threads", "2", "--json", str(out)]
    argv += ["--smol", str(smollm2_path), "--gemma", str(gemma3_path), "--llama-server", str(tmp_path / "no")]
    assert bench_models.main(argv) == 0
    servers = json.loads(out.read_text())["servers"]
    assert "not found" in servers["llama-server router"]["skipped"]
    for name, named in (("llmsession (named)", True), ("llmsession (unnamed)", False)):
        turns = servers[name]["turns"]
        assert [(t["model"], t["turn"]) for t in turns] == [
            ("smol", 1),
            ("gemma", 1),
            ("smol", 2),
            ("gemma", 2),
        ]
        for first, second in zip(turns[:2], turns[2:], strict=True):  # (each after the other model's turn)
            resumed = second["decoded_tokens"] <= second["prompt_tokens"] - first["prompt_tokens"]
            assert resumed == named, (name, first, second)
    assert "named) / llmsession (unnamed)" in capsys.readouterr().out
