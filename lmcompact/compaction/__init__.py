"""Engine-free compaction of paged KV: what a serving connector does to pages, in torch.

Nothing here imports an engine. An engine connector (``connectors/vllm``) hands these
modules its KV-cache tensors, block ids and step facts:

* :mod:`~lmcompact.compaction.page_layout`: token-level reads and writes of paged K/V
  (per backend packing);
* :mod:`~lmcompact.compaction.policy_inputs`: the one builder of policy inputs
  (:class:`~lmcompact.policies.CompactionInputs`) from keys, window queries and scores;
* :mod:`~lmcompact.compaction.save_job` and :mod:`~lmcompact.compaction.chunks`: compacting
  a request's pages into stored chunks, and verifying chunks against an engine;
* :mod:`~lmcompact.compaction.holes` and :mod:`~lmcompact.compaction.hole_planner`: hole
  geometry (which blocks attention skips and the pool gets back);
* :mod:`~lmcompact.compaction.pack` (reference) and :mod:`~lmcompact.compaction.device_pack`
  (GPU): packing kept tokens in place;
* :mod:`~lmcompact.compaction.per_head` and :mod:`~lmcompact.compaction.per_head_attention`:
  per-head counts as dense cells, and their attention;
* :mod:`~lmcompact.compaction.heavy_hitters`: H2O decode scores and merges.
"""
