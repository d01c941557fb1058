"""The Flax NNX Gemma of the Flax examples, vendored for planning tests.

Source: https://github.com/google/flax at commit 18f8f311c275d57f46d95e41b15aa97b454754c0
(2026-07-02), files ``examples/gemma/{transformer,transformer_cfg,modules,layers,
positional_embeddings,sow_lib,helpers}.py``, Apache License 2.0 (each file keeps its header).
Edits, each marked ``tapas_jax vendoring edit``: package-relative imports instead of top-level
``import layers`` etc.; ``Array = jax.Array`` instead of ``from jaxtyping import Array``
(jaxtyping is not installed); ``params`` (which needs orbax) dropped, so two annotations of
``from_params`` are quoted.
"""
