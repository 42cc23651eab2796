"""The serve config's ``openai:`` section: vLLM's own serving flags, the defaults that suit the
bundled SmolLM2 (auto tool choice with ``hermes``), and any other ``vllm serve`` argument passed
through — checked by vLLM's own parser before anything loads."""

from __future__ import annotations

import pytest

from kvmeter.serving.config import ServeConfigError, load_serve_config
from kvmeter.serving.engines.vllm_args import ServingFlags, VllmArgsError, parse_vllm_argv, serving_argv
from kvmeter.serving.engines.vllm_engine import VllmEngineConfig, engine_argv


def test_the_defaults_are_auto_tool_choice_with_hermes_and_vllms_usage_and_id_headers():
    flags = load_serve_config(None, {}, env={}).openai.flags()
    assert flags == ServingFlags()
    args = parse_vllm_argv(["--model", "/m", *serving_argv(flags)])
    assert (args.tool_call_parser, args.enable_auto_tool_choice, args.reasoning_parser) == ("hermes", True, "")
    assert args.enable_prompt_tokens_details and args.enable_request_id_headers


def test_named_flags_and_passed_through_arguments_reach_vllms_namespace(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("openai:\n  tool_call_parser: llama3_json\n  reasoning_parser: qwen3\n"
                    "  enable_request_id_headers: false\n"
                    "  vllm_args: ['--max-logprobs', '7', '--response-role', 'bot']\n")
    flags = load_serve_config(path, {}, env={}).openai.flags()
    args = parse_vllm_argv(["--model", "/m", *serving_argv(flags)])
    assert (args.tool_call_parser, args.reasoning_parser, args.max_logprobs, args.response_role) == (
        "llama3_json", "qwen3", 7, "bot")
    assert args.enable_request_id_headers is False


def test_no_tool_call_parser_turns_tool_parsing_off():
    cfg = load_serve_config(None, {("openai", "tool_call_parser"): "", ("openai", "enable_auto_tool_choice"): False},
                            env={})
    args = parse_vllm_argv(["--model", "/m", *serving_argv(cfg.openai.flags())])
    assert (args.tool_call_parser, args.enable_auto_tool_choice) == (None, False)


@pytest.mark.parametrize("argv, why", [
    (["--no-such-flag"], "does not know"),
    (["--max-logprobs", "many"], "invalid int value"),
    (["--tool-call-parser", "", "--enable-auto-tool-choice"], "requires --tool-call-parser"),
])
def test_arguments_vllm_refuses_are_refused_in_one_line(argv, why):
    with pytest.raises(VllmArgsError, match=why):
        parse_vllm_argv(["--model", "/m", *argv])


def test_the_section_is_checked_like_every_other():
    with pytest.raises(ServeConfigError, match="openai.vllm_args"):
        load_serve_config(None, {("openai", "vllm_args"): "--max-logprobs 5"}, env={})


def test_the_engine_is_built_from_its_settings_as_vllm_serve_words():
    cfg = VllmEngineConfig(model_dir="/m", served_name="s", max_model_len=2048, max_num_batched_tokens=128,
                           enable_prefix_caching=False, extra={"long_prefill_token_threshold": 32},
                           vllm_argv=["--enforce-eager"])
    args = parse_vllm_argv(engine_argv(cfg))
    assert (args.model, args.served_model_name, args.max_model_len, args.max_num_batched_tokens) == (
        "/m", ["s"], 2048, 128)
    assert (args.enable_prefix_caching, args.long_prefill_token_threshold, args.scheduling_policy, args.seed) == (
        False, 32, "priority", 0)
    assert args.enforce_eager is True


def test_a_reasoning_parser_stays_with_the_layer_it_was_given_to():
    """vLLM's parser shares one default StructuredOutputsConfig between Namespaces: a layer built
    with a reasoning parser must not hand it to a later layer of the same process (it did: a
    later gateway without one moved every answer into ``reasoning``)."""
    from kvmeter.serving.openai_api.layer import layer_args

    argv = ["--model", "m"]
    with_parser = layer_args(argv, ServingFlags(reasoning_parser="deepseek_r1"))
    without = layer_args(argv, ServingFlags())
    assert with_parser.structured_outputs_config.reasoning_parser == "deepseek_r1"
    assert not without.structured_outputs_config.reasoning_parser
