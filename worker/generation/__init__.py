"""Generation that no model family edits: the engine, its sampling, text, KV cache and counters.

- engine.py: ``GenerationEngine``, the step scheduler (add, abort, step, room, preemption) and each
  row's pick, accept and finish; a backend subclasses it with its model's prefill and decode.
- sampling.py: a row's next token (``guarded_pick``, ``pick_token``, ``sample_token``), its bias vector,
  generator and token budget.
- text.py: the incremental detokenizer and the stop-string filter.
- kv.py: the padded KV cache's join, select and budget.
- encoder_cache.py: vision-tower outputs by image content key. stats.py: the engine's counters.
- rows.py: a request's generation state.

A model family's knowledge (its prompt layout, its inputs' checks, its positions) lives in its input
style's module (shared/families/), read by worker/backends/hf.py, never here.
"""

from shmgate.worker.generation.encoder_cache import EncoderCache
from shmgate.worker.generation.engine import GenerationEngine
from shmgate.worker.generation.sampling import guarded_pick, pick_token, sample_token
from shmgate.worker.generation.stats import EngineStats
from shmgate.worker.generation.text import IncrementalDetokenizer, StopStringFilter

__all__ = [
    "EncoderCache",
    "EngineStats",
    "GenerationEngine",
    "IncrementalDetokenizer",
    "StopStringFilter",
    "guarded_pick",
    "pick_token",
    "sample_token",
]
