"""The OpenAI protocol in one import: request Structs and their decoding/validation
(openai_requests.py), response bodies and SSE chunks (openai_responses.py) and their
logprobs (openai_logprobs.py)."""

from splitserve.protocol.openai_requests import (
    MAX_N, MAX_STOP, ChatCompletionRequest,
    ChatMessage, CompletionRequest, ContentPart, StreamOptions, decode_chat_request,
    decode_completion_request)
from splitserve.protocol.openai_logprobs import TokenText, chat_logprobs, completion_logprobs
from splitserve.protocol.openai_responses import (
    DONE, FINISH_REASONS, EchoPrompt, ResponseAccumulator, StreamEncoder, engine_error,
    error_body, response_id, sse_error, status_error_body)

__all__ = [
    "MAX_N", "MAX_STOP", "ChatCompletionRequest",
    "ChatMessage", "CompletionRequest", "ContentPart", "StreamOptions", "decode_chat_request",
    "decode_completion_request",
    "DONE", "FINISH_REASONS", "EchoPrompt", "ResponseAccumulator", "StreamEncoder", "TokenText",
    "chat_logprobs", "completion_logprobs", "engine_error", "error_body", "response_id",
    "sse_error", "status_error_body",
]
