"""The worker process: receive descriptors, batch, run a model backend, stream replies."""
