"""The engine side both pools share: loading a checkpoint (models), what a served pair must
agree on (checkpoint) and per-request KV caches with rollback (kv). The drafter and verifier
engines own a model and its caches through these; speculative/ stays the algorithm."""
