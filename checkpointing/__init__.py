"""Checkpoints on disk, shared by training and decoding (neither owns them; nothing here imports an optimizer, a
train state or a model builder: callers pass trees of arrays, or of ShapeDtypeStructs carrying their shardings).

Modules: storage (writability, free space, OS errors in one line, guarded TensorBoard writers, orbax's log
filters), weights (parameters and model state of a run's checkpoint or a params-only one, read into given targets),
checkpointer (the whole train state: asynchronous saves, data positions, checksums, restores agreed between
processes), run_config (a run's config kept beside its checkpoints), hf_config (a Hugging Face directory's
config.json adopted into config.model). docs/checkpoints.md and docs/checkpoint_faults.md tell the behaviour.
"""
