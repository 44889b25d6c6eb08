"""The HTTP gateway: OpenAI-compatible routes, image intake and preprocessing into shared memory."""
