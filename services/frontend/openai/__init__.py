"""The OpenAI-compatible API, as vLLM's `entrypoints/openai`: request bodies (protocol.py),
one handler per endpoint (serving_chat.py, serving_completion.py, responses_api/) over the
shared generation handler (serving.py), and what turns a body into engine work (sampling.py,
grammar_request.py, lora_registry.py) and engine output into OpenAI's shapes (choice_state.py,
logprobs.py, chat_tools.py, reasoning.py, tool_parsers/).
"""
