"""The Flax Linen Gemma (Gemma 1 and 2), vendored for planning tests.

Source: https://github.com/google-deepmind/gemma at commit
e8075843f093f93f9099ac9ddd04f4362c0fc049 (2025-02-14), files ``gemma/transformer.py``,
``gemma/modules.py``, ``gemma/layers.py`` and ``gemma/positional_embeddings.py``, Apache License
2.0 (each file keeps its header). Edits, each marked ``tapas_jax vendoring edit``: package-relative
imports instead of ``from gemma import ...``, and ``gemma.params`` (which needs orbax) dropped, so
one annotation of ``Transformer.from_params`` is quoted.
"""
