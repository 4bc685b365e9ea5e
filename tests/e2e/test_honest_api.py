"""An honest API: a field or input part omnistage does not implement is a 400 naming it,
never a 200 that silently ignored it; what it does implement is accepted."""

from __future__ import annotations

import httpx
import pytest

MSG = [{"role": "user", "content": "Hello"}]
CHAT = {"messages": MSG, "max_tokens": 2}
IMAGE = {"prompt": "x", "size": "64x64", "num_inference_steps": 2}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}


@pytest.mark.parametrize(
    ("route", "extra", "field"),
    [
        ("chat", {"tools": [TOOL]}, "tools"),
        ("chat", {"tool_choice": "auto"}, "tool_choice"),
        ("chat", {"functions": [TOOL["function"]]}, "functions"),
        ("chat", {"function_call": "auto"}, "function_call"),
        ("chat", {"parallel_tool_calls": True}, "parallel_tool_calls"),
        ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
        ("chat", {"logit_bias": {"1": 5}}, "logit_bias"),
        ("chat", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ("chat", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ("chat", {"reasoning_effort": "low"}, "reasoning_effort"),
        ("chat", {"store": True}, "store"),
        ("chat", {"metadata": {"a": "b"}}, "metadata"),
        ("chat", {"service_tier": "flex"}, "service_tier"),
        ("chat", {"web_search_options": {}}, "web_search_options"),
        ("chat", {"include_stop_str_in_output": True}, "include_stop_str_in_output"),
        (
            "chat",
            {"stream": True, "stream_options": {"continuous_usage_stats": True}},
            "continuous_usage_stats",
        ),
        ("chat", {"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "name"),
        (
            "chat",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "data:,"}}],
                    }
                ]
            },
            "image_url",
        ),
        (
            "chat",
            {
                "messages": [
                    {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}
                ]
            },
            "input_audio",
        ),
        ("chat", {"extra_body": {"guided_json": {}}}, "guided_json"),
        ("completions", {"suffix": "x"}, "suffix"),
        ("completions", {"best_of": 2}, "best_of"),
        ("completions", {"logit_bias": {"1": 5}}, "logit_bias"),
        ("images", {"quality": "hd"}, "quality"),
        ("images", {"style": "vivid"}, "style"),
        ("images", {"response_format": "url"}, "response_format"),
    ],
)
def test_unimplemented_fields_are_400_naming_them(omni_server, route, extra, field):
    body = {"chat": CHAT, "completions": {"prompt": "Hi", "max_tokens": 2}, "images": IMAGE}[route]
    path = {
        "chat": "/v1/chat/completions",
        "completions": "/v1/completions",
        "images": "/v1/images/generations",
    }[route]
    r = httpx.post(omni_server.url + path, json={**body, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "extra",
    [
        {"user": "end-user-7"},
        {"tools": None, "response_format": None, "logit_bias": None},
        {"frequency_penalty": 0.5, "presence_penalty": -0.5, "repetition_penalty": 1.2},
        {"min_p": 0.05, "min_tokens": 1},
        {"extra_body": {"top_k": 5}},
        {
            "messages": [
                *MSG,
                {"role": "assistant", "content": "Hi", "tool_calls": None, "refusal": None},
                {"role": "user", "content": [{"type": "text", "text": "again"}]},
            ]
        },
    ],
)
def test_implemented_fields_and_nulls_are_accepted(omni_server, extra):
    r = httpx.post(omni_server.url + "/v1/chat/completions", json={**CHAT, **extra}, timeout=60)
    assert r.status_code == 200, r.text


def test_penalties_change_a_greedy_answer(omni_server):
    def tokens(**extra):
        body = {
            **CHAT,
            "max_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": True,
            **extra,
        }
        r = httpx.post(omni_server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return [e["token"] for e in r.json()["choices"][0]["logprobs"]["content"]]

    plain = tokens()
    assert len(set(plain)) < len(plain)  # the tiny model repeats itself
    penalised = tokens(repetition_penalty=100.0, presence_penalty=2.0)
    assert penalised != plain and len(set(penalised)) > len(set(plain))
