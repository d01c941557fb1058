"""Hugging Face checkpoints into a `serve_jax.model.Decoder`, streamed tensor by tensor.

::

    cfg = hf_model_config(model_dir, dtype="float32")          # serve_jax.hf_config
    model = load_hf_model(model_dir, cfg, mesh=None)            # weights placed on device

The shards (``model.safetensors``, or ``model-0000x-of-0000y.safetensors`` listed by
``model.safetensors.index.json``) are read one after the other and, within a shard, one tensor
at a time: each is read from the file (the safetensors header says where) into one host buffer,
transposed on the way from torch's ``[out, in]`` to the ``[in, out]`` kernels of
`flax.nnx.Linear` and cast to the serving dtype (slice by slice, `SafetensorsFile.read`), then put
straight into its target sharding. That sharding
is the tapas_jax plan of `serve_jax.executor.plan_decoder` when the mesh has a ``model`` axis
(the executor later finds the weights already where its plan wants them), else the first device
or the mesh, replicated. The model is built abstractly (`flax.nnx.eval_shape`), so at no point
does the host hold the whole model twice: peak host memory is the placed weights plus a couple
of tensors (see BENCHMARKS.md for the figure).

Errors name the file and the tensor: a missing shard or tensor, an unexpected tensor, a shape
the config.json does not imply, a file that is not safetensors.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from serve_jax.executor import plan_decoder
from serve_jax.hf_config import read_json, resolve_model_dir
from serve_jax.model import Decoder
from serve_jax.model_config import ModelConfig

__all__ = ["SafetensorsFile", "checkpoint_files", "hf_tensor_layout", "load_hf_model"]

_DTYPES = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(jnp.bfloat16),
    "F64": np.dtype(np.float64),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old Llama checkpoints saved
CHUNK_BYTES = 16 * 2**20
"""Bytes of the row slices a cast or transposed read goes through."""


def _valid_entry(entry) -> bool:
    """A header entry: ``{"dtype": str, "shape": [int, ...], "data_offsets": [begin, end]}``."""
    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
        return False
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    ints = lambda xs: isinstance(xs, list) and all(type(x) is int and x >= 0 for x in xs)
    return ints(shape) and ints(offsets) and len(offsets) == 2 and offsets[0] <= offsets[1]


class SafetensorsFile:
    """One ``.safetensors`` file: its header, and tensors read one at a time into host buffers.

    Raises:
      FileNotFoundError: no such file.
      ValueError: a file that is not safetensors (its contents are not echoed).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"checkpoint shard {str(self.path)!r} does not exist")
        self._f = open(self.path, "rb")  # closed by close() / the with block
        size = os.fstat(self._f.fileno()).st_size
        head = self._f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 2 <= n <= size - 8:
            self.close()
            raise ValueError(f"{str(self.path)!r} is not a safetensors file")
        try:
            header = json.loads(self._f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            self.close()
            raise ValueError(f"{str(self.path)!r} is not a safetensors file") from None
        if isinstance(header, dict):
            header.pop("__metadata__", None)
        if not isinstance(header, dict) or not all(map(_valid_entry, header.values())):
            self.close()
            raise ValueError(f"{str(self.path)!r} is not a safetensors file")
        self._header = header
        self._data_start = 8 + n
        self._size = size

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._f.close()

    def names(self) -> list[str]:
        """Tensor names in file order."""
        return sorted(self._header, key=lambda k: self._header[k]["data_offsets"][0])

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._header[name]["shape"])

    def read(self, name: str, dtype=None, transpose: bool = False) -> np.ndarray:
        """The tensor ``name`` in a fresh host array, cast to ``dtype`` (None: as stored) and,
        for a matrix, transposed when asked.

        A cast or a transpose goes through the file in slices of rows (`CHUNK_BYTES`), so the
        host holds the result plus one slice, never the tensor twice.

        Raises:
          ValueError: an unsupported dtype or offsets that do not fit the file.
        """
        entry = self._header[name]
        stored = _DTYPES.get(entry.get("dtype"))
        if stored is None:
            raise ValueError(
                f"{self.path}: tensor {name!r} has dtype {entry.get('dtype')!r}; supported: "
                f"{', '.join(_DTYPES)}"
            )
        shape = tuple(entry["shape"])
        begin, end = entry["data_offsets"]
        nbytes = int(np.prod(shape, dtype=np.int64)) * stored.itemsize
        if end - begin != nbytes or self._data_start + end > self._size:
            raise ValueError(f"{self.path}: tensor {name!r} has offsets that do not fit its shape")
        dtype = stored if dtype is None else np.dtype(dtype)
        transpose = transpose and len(shape) == 2
        self._f.seek(self._data_start + begin)
        if not transpose and dtype == stored:
            return self._read_rows(name, shape, stored)
        out = np.empty(shape[::-1] if transpose else shape, dtype)
        row_bytes = max(1, nbytes // max(1, shape[0]))
        step = max(1, CHUNK_BYTES // row_bytes)
        for r in range(0, shape[0], step):
            rows = self._read_rows(name, (min(step, shape[0] - r), *shape[1:]), stored)
            if transpose:
                out[:, r : r + len(rows)] = rows.T
            else:
                out[r : r + len(rows)] = rows
        return out

    def _read_rows(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        buf = np.empty(shape, dtype)
        if self._f.readinto(memoryview(buf.reshape(-1).view(np.uint8))) != buf.nbytes:
            raise ValueError(f"{self.path}: tensor {name!r} is truncated")
        return buf


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors shards of a checkpoint directory, in order.

    Raises:
      FileNotFoundError: no safetensors weights, or a shard the index lists is missing.
    """
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{str(index)!r} has no weight_map")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(
                    f"checkpoint shard {str(f)!r} (listed in {index.name}) is missing"
                )
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"{str(model_dir)!r} has no model.safetensors or model.safetensors.index.json "
        "(only safetensors weights are read)"
    )


def hf_tensor_layout(cfg: ModelConfig) -> dict[str, tuple[tuple, bool]]:
    """Hugging Face tensor name -> (path in the `Decoder`'s state, transposed?) for ``cfg``."""
    layout: dict[str, tuple[tuple, bool]] = {
        "model.embed_tokens.weight": (("embed", "embedding"), False),
        "model.norm.weight": (("final_norm", "scale"), False),
    }
    if not cfg.tie_embeddings:
        layout["lm_head.weight"] = (("lm_head", "kernel"), True)
    linears = {
        "self_attn.q_proj": ("attn", "q_proj"),
        "self_attn.k_proj": ("attn", "k_proj"),
        "self_attn.v_proj": ("attn", "v_proj"),
        "self_attn.o_proj": ("attn", "o_proj"),
        "mlp.gate_proj": ("mlp", "gate"),
        "mlp.up_proj": ("mlp", "up"),
        "mlp.down_proj": ("mlp", "down"),
    }
    for i in range(cfg.n_layers):
        pre = f"model.layers.{i}."
        layout[pre + "input_layernorm.weight"] = (("blocks", i, "attn_norm", "scale"), False)
        layout[pre + "post_attention_layernorm.weight"] = (
            ("blocks", i, "mlp_norm", "scale"),
            False,
        )
        for hf, ours in linears.items():
            layout[pre + hf + ".weight"] = (("blocks", i, *ours, "kernel"), True)
        if cfg.qkv_bias:
            for p in ("q_proj", "k_proj", "v_proj"):
                layout[pre + f"self_attn.{p}.bias"] = (("blocks", i, "attn", p, "bias"), False)
    return layout


def _key(path) -> tuple:
    return tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))


def _target_shardings(model: Decoder, mesh, plan_memory_limit_bytes: float | None) -> dict:
    """State path -> the sharding the executor will want for that weight."""
    _, state = nnx.split(model)
    paths = [_key(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    if mesh is None:
        return dict.fromkeys(paths, SingleDeviceSharding(jax.devices()[0]))
    if dict(mesh.shape).get("model", 1) > 1:
        plan = plan_decoder(model, mesh, memory_limit_bytes=plan_memory_limit_bytes)
        leaves = jax.tree.leaves(plan.in_shardings_on(mesh)[0])
        if len(leaves) != len(paths):
            raise RuntimeError("the plan's shardings do not match the model's parameters")
        return dict(zip(paths, leaves))
    return dict.fromkeys(paths, NamedSharding(mesh, PartitionSpec()))


def load_hf_model(
    model_dir: str | os.PathLike,
    cfg: ModelConfig,
    mesh=None,
    plan_memory_limit_bytes: float | None = None,
) -> Decoder:
    """The `Decoder` of ``cfg`` with the checkpoint's weights, placed for the executor.

    ``cfg`` is `serve_jax.hf_config.hf_model_config` of the same directory (its dtype is the
    serving dtype the weights are cast to).

    Raises:
      FileNotFoundError: no checkpoint directory, no safetensors weights, a missing shard.
      ValueError: a file that is not safetensors, a missing, unexpected or duplicate tensor, or
        a tensor whose shape the config.json does not imply, naming the file and the tensor.
    """
    model_dir = resolve_model_dir(model_dir)
    files = checkpoint_files(model_dir)
    abstract = nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    shardings = _target_shardings(abstract, mesh, plan_memory_limit_bytes)
    abstract_leaves = {_key(p): x for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}
    layout = hf_tensor_layout(cfg)
    placed: dict[tuple, jax.Array] = {}
    for file in files:
        with SafetensorsFile(file) as f:
            for name in f.names():
                if name not in layout:
                    if name.endswith(_IGNORED_SUFFIXES) or (
                        cfg.tie_embeddings and name == "lm_head.weight"
                    ):
                        continue
                    raise ValueError(f"{file}: unexpected tensor {name!r} for this config.json")
                path, transpose = layout[name]
                if path in placed:
                    raise ValueError(f"{file}: tensor {name!r} appears in more than one shard")
                want = abstract_leaves[path].shape
                want = tuple(reversed(want)) if transpose else tuple(want)
                if f.shape(name) != want:
                    raise ValueError(
                        f"{file}: tensor {name!r} has shape {list(f.shape(name))}, "
                        f"config.json implies {list(want)}"
                    )
                host = f.read(name, abstract_leaves[path].dtype, transpose)
                placed[path] = jax.device_put(host, shardings[path])
                del host  # before the next tensor is read
    missing = [name for name, (path, _) in layout.items() if path not in placed]
    if missing:
        raise ValueError(
            f"{model_dir}: tensor {missing[0]!r} is missing from the checkpoint"
            + (f" ({len(missing)} missing)" if len(missing) > 1 else "")
        )
    state = jax.tree_util.tree_map_with_path(lambda p, _: placed[_key(p)], state)
    return nnx.merge(graphdef, state)
