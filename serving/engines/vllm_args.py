"""vLLM's own command-line arguments: one ``Namespace`` from vLLM's parser builds the serving layer
(and, for ``--engine vllm``, the engine), so kvmeter's serving settings are the words of
``vllm serve``.

kvmeter names a few serving flags itself (:class:`ServingFlags`, set from the serve config's
``openai:`` section) and passes any other vLLM argument through unchanged (``vllm_args``, a list
of command-line words, applied last, so they win). The defaults suit the bundled SmolLM2-135M:
auto tool choice with the ``hermes`` tool-call parser, cached-token details in ``usage``, and
``X-Request-Id`` echoed as vLLM's ``--enable-request-id-headers`` does.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NoReturn, Sequence

__all__ = ["ServingFlags", "serving_argv", "parse_vllm_argv", "VllmArgsError"]


class VllmArgsError(ValueError):
    """vLLM's parser refused the arguments (an unknown flag, a bad value, an inconsistent set)."""


@dataclass(frozen=True, slots=True)
class ServingFlags:
    """The serving flags kvmeter names (each is the ``vllm serve`` flag of the same name).

    Attributes:
        tool_call_parser: ``--tool-call-parser`` (``hermes``, ``llama3_json``, ``mistral``, ...;
            None: tool calls are not parsed).
        enable_auto_tool_choice: ``--enable-auto-tool-choice`` (``tool_choice: "auto"``; needs a
            tool-call parser).
        reasoning_parser: ``--reasoning-parser`` (``deepseek_r1``, ``qwen3``, ...; None: none).
            With one, ``usage.completion_tokens_details.reasoning_tokens`` counts the reasoning.
        chat_template: ``--chat-template`` (a file or an inline Jinja template; None: the
            model's own).
        enable_prompt_tokens_details: ``--enable-prompt-tokens-details`` (``cached_tokens`` in
            ``usage.prompt_tokens_details``).
        enable_request_id_headers: ``--enable-request-id-headers`` (every answer carries
            ``X-Request-Id``: the client's, else a generated one).
        vllm_args: any other ``vllm serve`` arguments, as command-line words
            (``["--max-logprobs", "50"]``), applied after the named ones.
    """

    tool_call_parser: str | None = "hermes"
    enable_auto_tool_choice: bool = True
    reasoning_parser: str | None = None
    chat_template: str | None = None
    enable_prompt_tokens_details: bool = True
    enable_request_id_headers: bool = True
    vllm_args: tuple[str, ...] = field(default_factory=tuple)


def serving_argv(flags: ServingFlags) -> list[str]:
    """``flags`` as ``vllm serve`` command-line words."""
    argv: list[str] = []
    if flags.tool_call_parser:
        argv += ["--tool-call-parser", flags.tool_call_parser]
    if flags.enable_auto_tool_choice:
        argv.append("--enable-auto-tool-choice")
    if flags.reasoning_parser:
        argv += ["--reasoning-parser", flags.reasoning_parser]
    if flags.chat_template:
        argv += ["--chat-template", flags.chat_template]
    if flags.enable_prompt_tokens_details:
        argv.append("--enable-prompt-tokens-details")
    if flags.enable_request_id_headers:
        argv.append("--enable-request-id-headers")
    return argv + list(flags.vllm_args)


@lru_cache(maxsize=1)
def _parser() -> argparse.ArgumentParser:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve", add_help=False))
    parser.exit_on_error = False

    def refuse(message: str) -> NoReturn:  # argparse prints the whole usage and exits otherwise
        raise VllmArgsError(message)

    parser.error = refuse  # type: ignore[method-assign]
    return parser


def parse_vllm_argv(argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``argv`` with vLLM's own ``vllm serve`` parser and check it as ``vllm serve`` does
    (``validate_parsed_serve_args``: the chat template, auto tool choice without a parser, ...).

    Raises:
        VllmArgsError: an unknown argument, a bad value, or a set vLLM refuses (its message).
    """
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    parser = _parser()
    try:
        args, unknown = parser.parse_known_args(list(argv))
    except VllmArgsError as exc:
        raise VllmArgsError(f"vLLM refused the arguments {list(argv)}: {exc}") from None
    except (argparse.ArgumentError, ValueError, TypeError) as exc:
        raise VllmArgsError(f"vLLM refused the arguments {list(argv)}: {exc}") from None
    if unknown:
        raise VllmArgsError(f"vLLM does not know the arguments {unknown}")
    try:
        validate_parsed_serve_args(args)
    except (ValueError, TypeError) as exc:
        raise VllmArgsError(str(exc)) from None
    return args
