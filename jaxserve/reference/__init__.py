"""Pure-Python, float64, event-by-event reference simulators: the ground truth the JAX engines
are tested against, written literally from the model pages (numpy only, nothing of jaxserve).

- `jaxserve.reference.sim`: static batching (docs/contract_static.md, docs/model.md);
- `jaxserve.reference.continuous`: continuous batching with a paged KV cache
  (docs/contract_continuous.md, docs/continuous.md);
- `jaxserve.reference.prefix`: continuous batching with prefix caching (docs/prefix_caching.md).

Tests and `scripts/bench.py` (the requests/s baseline) import them; nothing in the library's
step code does.
"""
