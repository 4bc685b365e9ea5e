"""``omnistage bench serve`` against a running ``omnistage serve`` (the shared tiny-chat
server): every request answers, the token counts are the server's, and the tables and the JSON
say what was measured."""

from __future__ import annotations

import json

from omnistage import cli


def test_bench_serve_loads_a_running_server(plain_server, tmp_path, capsys):
    argv = ["bench", "serve", "--base-url", plain_server.url, "--num-prompts", "4"]
    argv += ["--random-input-len", "8", "--random-output-len", "4", "--ignore-eos"]
    argv += ["--request-rate", "50", "--max-concurrency", "2", "--save-result"]
    argv += ["--result-dir", str(tmp_path), "--result-filename", "run.json"]
    assert cli.main(argv) == 0
    out = capsys.readouterr()
    result = json.loads((tmp_path / "run.json").read_text())
    assert (result["completed"], result["failed"], result["errors"]) == (4, 0, [])
    assert result["model"] == "tiny-chat" and result["output_tokens_from"] == "usage"
    assert result["total_output_tokens"] == 16 and result["total_input_tokens"] > 4 * 8
    assert (result["n_ttft"], result["n_e2el"]) == (4, 4)
    assert result["n_itl"] <= 12  # a token that decodes to no text adds no content delta
    assert 0 < result["mean_ttft_ms"] <= result["mean_e2el_ms"]
    assert result["p99_e2el_ms"] >= result["median_e2el_ms"] and result["duration"] > 0
    assert "| openai-chat | tiny-chat | 4 | 0 | 50 | 2 |" in out.out
    assert out.out.count("Legend:") == 2 and "4/4 requests" in out.err
