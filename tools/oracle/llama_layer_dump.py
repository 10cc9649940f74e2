"""Capture named intermediate tensors of a llama.cpp forward pass (llama-eval-callback style).

llama-cpp-python's `Llama` has no `cb_eval` argument, so this module temporarily wraps
`llama_context_default_params` so that the context it creates carries a ggml scheduler
eval callback. The callback asks for every graph node whose name matches `pattern`
(llama.cpp names them `<name>-<layer>`, e.g. `l_out-3`) and copies f32 data on the CPU.
"""
from __future__ import annotations

import ctypes
import re
from pathlib import Path

import numpy as np

GGML_MAX_DIMS, GGML_MAX_SRC, GGML_MAX_OP_PARAMS, GGML_MAX_NAME = 4, 10, 64, 64
GGML_TYPE_F32 = 0


class GgmlTensor(ctypes.Structure):  # ggml/include/ggml.h `struct ggml_tensor` (vendored 0.3.36)
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p),
                ("ne", ctypes.c_int64 * GGML_MAX_DIMS), ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
                ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * GGML_MAX_SRC),
                ("view_src", ctypes.c_void_p), ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p),
                ("name", ctypes.c_char * GGML_MAX_NAME), ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]


def capture(gguf_path: Path, ids: list[int], pattern: str, n_threads: int = 2) -> dict[str, np.ndarray]:
    """Run `ids` as one batch and return {node name: array shaped like ggml ne reversed}."""
    import llama_cpp
    from llama_cpp import Llama

    rx = re.compile(pattern)
    got: dict[str, np.ndarray] = {}

    def cb(t_ptr, ask, _ud):
        t = ctypes.cast(t_ptr, ctypes.POINTER(GgmlTensor)).contents
        name = t.name.decode(errors="replace")
        if ask:
            return bool(rx.fullmatch(name))
        if t.type == GGML_TYPE_F32 and rx.fullmatch(name) and t.data:
            ne = [int(t.ne[i]) for i in range(GGML_MAX_DIMS)]
            nb = [int(t.nb[i]) for i in range(GGML_MAX_DIMS)]
            n_bytes = max((ne[i] - 1) * nb[i] for i in range(GGML_MAX_DIMS)) + 4
            buf = (ctypes.c_char * n_bytes).from_address(t.data)
            a = np.lib.stride_tricks.as_strided(np.frombuffer(buf, np.float32), shape=ne[::-1], strides=nb[::-1])
            got[name] = np.array(a)
        return True

    cb_c = llama_cpp.llama_cpp.ggml_backend_sched_eval_callback(cb)
    orig = llama_cpp.llama_cpp.llama_context_default_params

    def patched():
        p = orig()
        p.cb_eval = cb_c
        p.cb_eval_user_data = None
        return p

    llama_cpp.llama_cpp.llama_context_default_params = patched
    try:
        n_ctx = max(64, len(ids))
        llm = Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                    n_threads=n_threads, n_threads_batch=n_threads, type_k=0, type_v=0, flash_attn=False,
                    verbose=False)
    finally:
        llama_cpp.llama_cpp.llama_context_default_params = orig
    llm.eval(ids)
    del llm
    return got
