"""The engine side both pools share. Each replica owns one model runner (runner: the model,
its attention backend and KV pool, the packed forward, lean or transformers'); the scheduler
decides what a batch's forward runs (scheduler); kv keeps each request's committed tokens
and cache; cache, paged and regions are the KV pools; attention is the backends' seam;
memory sizes a pool; models and checkpoint load what a served pair must agree on.
speculative/ stays the algorithm."""
