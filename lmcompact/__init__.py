"""lmcompact: KV-cache compaction (token dropping) for LLM serving.

The core (policies, keep plans, ragged per-head KV, window scores, reference
attention, the tiered store) imports torch only. ``lmcompact.hf`` imports
transformers; ``connectors`` imports vLLM.
"""

from lmcompact.plan import KeepPlan

__version__ = "0.1.0"
__all__ = ["KeepPlan", "__version__"]
