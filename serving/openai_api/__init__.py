"""The OpenAI API as vLLM serves it, run in-process with kvmeter around the engine client.

For the in-process engines (``--engine vllm`` and ``--engine instant``) the gateway does not write
request models or response shapes of its own: it validates, renders and answers with vLLM's
serving layer (``vllm/entrypoints/openai``: the pydantic request and response models, chat
templates, tool-call and reasoning parsers, structured outputs, logprobs, ``n``, ``echo``, prompt
lists, stream options), and meters every ``RequestOutput`` the engine client returns.

Modules: :mod:`~kvmeter.serving.openai_api.layer` (the serving objects and the request steps),
:mod:`~kvmeter.serving.openai_api.engine_client` (the metered engine client and the bound
request), :mod:`~kvmeter.serving.openai_api.instant_client` (the instant engine as an engine
client), :mod:`~kvmeter.serving.openai_api.errors` (vLLM's error answers as refusals). vLLM's
command line itself is :mod:`kvmeter.serving.engines.vllm_args` (the engine is built from it too).
"""
