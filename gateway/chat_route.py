"""``POST /v1/chat/completions``: the Chat Completions codec over the request pipeline (gateway/pipeline.py);
its row in gateway/endpoints.py makes the route.

The body parses into the engine's request (gateway/intake.py) and the answer is written in the chat
format (gateway/sse.py ``ChatFormat``): a ``chat.completion``, or ``chat.completion.chunk`` events.
"""

from __future__ import annotations

from collections.abc import Mapping

from shmgate.gateway.intake import GenerationRequest, IntakeLimits, parse_chat_body
from shmgate.gateway.render import AnswerFormat
from shmgate.gateway.sse import ChatFormat

__all__ = ["CHAT", "ChatCodec"]


class ChatCodec:
    """Chat Completions: the engine's request is the chat request itself, so its fields keep their names."""

    fields: Mapping[str, str] = {}

    def parse(self, body: bytes, limits: IntakeLimits) -> tuple[GenerationRequest, AnswerFormat]:
        chat, req = parse_chat_body(body, limits)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return chat, ChatFormat(chat.model, include_usage=include_usage)


CHAT = ChatCodec()
