"""Hugging Face checkpoint directories without jax: where they are, and their config.json.

A model is named by a local directory holding ``config.json`` (what ``save_pretrained`` writes),
by a repository folder of the Hugging Face cache (``.../hub/models--org--name``, whose
``refs/main`` names the snapshot), or by a repository id (``org/name``) looked up in the local
cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``). Nothing is
ever downloaded.

`hf_model_config` turns a config.json into a `serve_jax.model_config.ModelConfig` for the
architectures the decoder implements (Llama 2/3, Mistral, Qwen2), in the classic layout
(``rope_theta`` and ``rope_scaling``) or transformers 5's (``rope_parameters``). A field value
the decoder does not implement is a ValueError naming the field, never a silently different
model. The weights are read by `serve_jax.hf_checkpoint`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from serve_jax.model_config import ModelConfig, RopeScaling

__all__ = ["SUPPORTED_ARCHITECTURES", "resolve_model_dir", "read_json", "hf_model_config"]

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
"""The ``architectures`` of a config.json that `serve_jax.model.Decoder` serves exactly."""


def _hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache", "huggingface"
    )
    return Path(home) / "hub"


def _snapshot(repo_dir: Path) -> Path:
    """The snapshot of a cache repository folder: the one ``refs/main`` names, else the only one."""
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        snap = repo_dir / "snapshots" / ref.read_text().strip()
        if snap.is_dir():
            return snap
    snaps = sorted(p for p in (repo_dir / "snapshots").glob("*") if p.is_dir())
    if len(snaps) != 1:
        raise FileNotFoundError(
            f"{str(repo_dir)!r}: no refs/main and {len(snaps)} snapshots; pass the snapshot folder"
        )
    return snaps[0]


def resolve_model_dir(name: str | os.PathLike) -> Path:
    """The local directory holding the checkpoint's config.json (see the module docstring).

    Raises:
      FileNotFoundError: no such directory, no config.json in it, or a repository id that is
        not in the local cache.
    """
    path = Path(name).expanduser()
    if not path.exists() and str(name).count("/") == 1 and not str(name).startswith((".", "/")):
        cached = _hub_cache() / ("models--" + str(name).replace("/", "--"))
        if not cached.is_dir():
            raise FileNotFoundError(
                f"model {str(name)!r} is neither a directory nor in the Hugging Face cache "
                f"{str(_hub_cache())!r} (nothing is downloaded)"
            )
        path = cached
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
    if path.name.startswith("models--") and (path / "snapshots").is_dir():
        path = _snapshot(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{str(path)!r} has no config.json (not a Hugging Face checkpoint)")
    return path


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``.

    Raises:
      ValueError: a file that is not a JSON object (its contents are not echoed).
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"{str(path)!r} is not valid JSON") from None
    if not isinstance(data, dict):
        raise ValueError(f"{str(path)!r} does not hold a JSON object")
    return data


def _rope(cfg: dict[str, Any], where: str) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling)`` from either config layout."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:  # transformers 5
        theta, scaling, field = params["rope_theta"], params, "rope_parameters"
    else:
        theta, scaling, field = (
            cfg.get("rope_theta", 10000.0),
            cfg.get("rope_scaling"),
            "rope_scaling",
        )
    if scaling is None:
        return float(theta), None
    if not isinstance(scaling, dict):
        raise ValueError(f"{where}: {field} must be an object, got {type(scaling).__name__}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise ValueError(f"{where}: {field}.rope_type {kind!r} is not supported (default, llama3)")
    try:
        rs = RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ValueError(f"{where}: {field} of type llama3 lacks {e.args[0]!r}") from None
    return float(theta), rs


def _require(cfg: dict[str, Any], field: str, where: str) -> int:
    value = cfg.get(field)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{where}: {field} must be a positive integer, got {value!r}")
    return value


def _context_limit(cfg: dict[str, Any], arch: str, max_pos: int) -> int:
    """The longest context served exactly: a sliding window never slides within it."""
    window = cfg.get("sliding_window")
    if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
        window = None
    if isinstance(window, int) and not isinstance(window, bool) and window > 0:
        return min(max_pos, window)
    return max_pos


def hf_model_config(
    model_dir: str | os.PathLike, dtype: str = "float32", max_seq_len: int | None = None
) -> ModelConfig:
    """The `ModelConfig` of the checkpoint at ``model_dir`` (see `resolve_model_dir`).

    ``max_seq_len`` shortens the context (default: ``max_position_embeddings``, or a sliding
    window when the model has one, so that attention over the whole context is exact).

    Raises:
      FileNotFoundError: no checkpoint directory or config.json.
      ValueError: an unsupported architecture or config field value, naming it.
    """
    path = resolve_model_dir(model_dir) / "config.json"
    cfg = read_json(path)
    where = str(path)
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"{where}: architectures {archs!r} not supported; serve_jax serves "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where}: hidden_act {act!r} is not supported (silu)")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag, False):
            raise ValueError(f"{where}: {flag} true is not supported for {arch}")
    if cfg.get("pretraining_tp", 1) not in (1, None):
        raise ValueError(f"{where}: pretraining_tp {cfg['pretraining_tp']!r} is not supported (1)")
    d = _require(cfg, "hidden_size", where)
    heads = _require(cfg, "num_attention_heads", where)
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or d // heads
    theta, scaling = _rope(cfg, where)
    max_pos = _require(cfg, "max_position_embeddings", where)
    limit = _context_limit(cfg, arch, max_pos)
    if max_seq_len:
        if max_seq_len > limit:
            raise ValueError(
                f"model.max_seq_len {max_seq_len} exceeds the context this checkpoint serves "
                f"exactly ({limit}: max_position_embeddings or sliding_window)"
            )
        limit = max_seq_len
    try:
        return ModelConfig(
            vocab_size=_require(cfg, "vocab_size", where),
            d_model=d,
            n_layers=_require(cfg, "num_hidden_layers", where),
            n_heads=heads,
            n_kv_heads=kv_heads,
            head_dim=head_dim,
            ffn_dim=_require(cfg, "intermediate_size", where),
            rope_theta=theta,
            rope_scaling=scaling,
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_seq_len=limit,
            dtype=dtype,
            qkv_bias=arch == "Qwen2ForCausalLM",
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None
