"""Write an updated GGUF: same metadata/tokenizer, every tensor copied byte-for-byte
except the updated ones, which are written as F32 (default) or F16.

Atomic and durable: written to ``<out>.tmp-<pid>`` in the destination directory,
fsync'ed, renamed over ``out``, then the directory is fsync'ed.
"""

from __future__ import annotations

import os
from typing import Mapping, Union

import numpy as np

import gguf

PathOrReader = Union[str, "os.PathLike[str]", gguf.GGUFReader]


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_updated_gguf(src: PathOrReader, out_path: str, updated: Mapping[str, np.ndarray],
                       dtype: str = "f32") -> None:
    """Copy ``src`` to ``out_path`` replacing the tensors named in ``updated``.

    ``updated`` maps GGUF tensor names to float arrays in numpy (out, in) layout, i.e.
    the shape ``GGUFReader`` gives after dequantization.  1-D tensors (norms) are always
    written as F32.
    """
    if dtype not in ("f32", "f16"):
        raise ValueError("dtype must be 'f32' or 'f16'")
    reader = src if isinstance(src, gguf.GGUFReader) else gguf.GGUFReader(os.fspath(src))
    names = {t.name for t in reader.tensors}
    unknown = set(updated) - names
    if unknown:
        raise KeyError(f"updated tensors not in source: {sorted(unknown)}")

    arch = reader.fields["general.architecture"].contents()
    out_path = os.path.abspath(os.fspath(out_path))
    out_dir = os.path.dirname(out_path)
    tmp = os.path.join(out_dir, f".{os.path.basename(out_path)}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(tmp, arch, endianess=reader.endianess)
    try:
        align = reader.fields.get("general.alignment")
        if align is not None:
            writer.data_alignment = int(align.contents())
        for f in reader.fields.values():
            if f.name == "general.architecture" or f.name.startswith("GGUF."):
                continue
            vtype = f.types[0]
            sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(f.name, f.contents(), vtype, sub_type=sub)

        payloads: list[tuple[np.ndarray, object]] = []  # (data, its endianness)
        for t in reader.tensors:
            if t.name in updated:
                arr = np.asarray(updated[t.name], dtype=np.float32)
                want = tuple(int(x) for x in reversed(t.shape))
                if arr.shape != want:
                    raise ValueError(f"{t.name}: shape {arr.shape} != {want}")
                if dtype == "f16" and arr.ndim > 1:
                    arr = arr.astype(np.float16)
                    qt = gguf.GGMLQuantizationType.F16
                else:
                    qt = gguf.GGMLQuantizationType.F32
                arr = np.ascontiguousarray(arr)
                writer.add_tensor_info(t.name, arr.shape, arr.dtype, arr.nbytes, raw_dtype=qt)
                payloads.append((arr, None))  # native
            else:
                writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes,
                                       raw_dtype=t.tensor_type)
                payloads.append((t.data, reader.endianess))

        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for data, endian in payloads:
            writer.write_tensor_data(data, tensor_endianess=endian)  # type: ignore[arg-type]
        writer.close()
        with open(tmp, "rb+") as fh:
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, out_path)
        _fsync_dir(out_dir)
    except BaseException:
        try:
            writer.close()
        except Exception:
            pass
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
