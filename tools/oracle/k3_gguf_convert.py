#!/usr/bin/env python3
"""Kimi K3 checkpoint -> GGUF, following llama.cpp's own conversion rules (numpy port).

llama.cpp's converter (`convert_hf_to_gguf.py` + `conversion/base.py` + `conversion/kimi_k3.py`,
vendored in llama-cpp-python 0.3.36 under `vendor/llama.cpp`) needs torch and transformers,
which the oracle venv deliberately does not have. This file is a line-by-line numpy port of
the code paths that run for a K3 checkpoint. Each function names the vendored function it
mirrors. All GGUF names, keys and quant types come from the *vendored* gguf-py (PyPI gguf
0.19.0 has no KIMI_K3 architecture), imported from `--llama-src`.

Ported paths (vendored names):
  ModelBase.index_tensors / filter_tensors / TextModel.filter_tensors   -> index_tensors()
  KimiK3Model.get_tensors (strip `language_model.`, skip vision)         -> index_tensors()
  KimiK3Model.dequant_model (only routed experts may be MXFP4)          -> check_mxfp4_scope()
  KimiK3Model._write_mxfp4_experts + ModelBase._mxfp4_expert_tensor
    + ModelBase.repack_mxfp4_blocks                                       -> write_mxfp4_experts()
  ModelBase.prepare_tensors (dtype rules, bid, modify_tensors loop)     -> prepare_tensors()
  KimiK3Model.modify_tensors (+ _try_fuse_res) + ModelBase.modify_tensors
                                                                          -> modify_tensors()
  ModelBase.prepare_metadata / TextModel.prepare_metadata               -> prepare_metadata()
  TextModel.set_gguf_parameters + KimiK3Model.set_gguf_parameters       -> set_gguf_parameters()
  KimiLinearModel.set_vocab (kimi-k2 branch) + KimiK3Model.set_vocab    -> set_vocab()

Deviations, all opt-in and off by default:
  --experts-f32  store the routed experts as F32 (the exact values of the lossless MXFP4
                 repack, dequantized with gguf-py's MXFP4 dequantizer) instead of MXFP4, so
                 that llama.cpp's CPU matmul does not quantize the expert *activations* to
                 Q8_0 (ggml's vec_dot_type for MXFP4). Weight values are unchanged.
Checks not in llama.cpp: a config whose KDA and MLA head counts differ is refused (llama.cpp
keeps one head count for both).
Torch vs numpy: `-exp(A_log)` is computed in float64 and rounded to f32 (torch's f32 exp
may differ by 1 ulp); every other step is exact (reshapes, bit moves, bf16->f32 widening,
one f32 multiply for the fused AttnRes score).
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import logging
import re
import struct
import sys
from pathlib import Path
from typing import Any, Iterator

import numpy as np

DEFAULT_LLAMA_SRC = Path("/work/oracle/sdist/llama-cpp-python-0.3.36/vendor/llama.cpp")
logger = logging.getLogger("k3-gguf")
gguf: Any = None  # the vendored gguf-py module, bound by load_gguf()


def load_gguf(llama_src: Path) -> Any:
    """Import the gguf-py that ships with the vendored llama.cpp (has MODEL_ARCH.KIMI_K3)."""
    global gguf
    sys.path.insert(0, str(llama_src / "gguf-py"))
    import gguf as g  # noqa: E402
    if not hasattr(g.MODEL_ARCH, "KIMI_K3"):
        raise RuntimeError(f"{g.__file__}: this gguf-py has no MODEL_ARCH.KIMI_K3")
    gguf = g
    return g


# --------------------------------------------------------------------------------------
# safetensors (numpy view of one tensor; stands in for gguf.utility.SafetensorsLocal +
# LazyTorchTensor.from_local_tensor)
# --------------------------------------------------------------------------------------

_ST_DTYPES = {"F32": np.float32, "BF16": np.uint16, "U8": np.uint8, "F16": np.float16,
              "I32": np.int32, "I64": np.int64}


class StTensor:
    def __init__(self, path: Path, name: str, meta: dict, base: int):
        self.path, self.name = path, name
        self.dtype: str = meta["dtype"]
        self.shape: tuple[int, ...] = tuple(meta["shape"])
        if self.dtype not in _ST_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {self.dtype}")
        b, e = meta["data_offsets"]
        self.offset, self.nbytes = base + b, e - b

    def raw(self) -> np.ndarray:
        a = np.memmap(self.path, dtype=_ST_DTYPES[self.dtype], mode="r", offset=self.offset,
                      shape=self.shape if self.shape else (1,))
        return np.array(a)

    def load(self) -> np.ndarray:
        """Value as numpy; BF16 widened to f32 exactly (prepare_tensors' `.to(torch.float32)`)."""
        a = self.raw()
        if self.dtype == "BF16":
            return (a.astype(np.uint32) << 16).view(np.float32)
        return a


def read_safetensors_header(path: Path) -> list[StTensor]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    items = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    return [StTensor(path, k, v, 8 + n) for k, v in items]


# --------------------------------------------------------------------------------------
# the converter
# --------------------------------------------------------------------------------------

# TextModel.filter_tensors: multimodal prefixes/substrings that are skipped
_MM_PREFIXES = ("mlp", "vit.", "vpm.", "siglip2.", "conformer.", "merger.", "resampler.", "sound_encoder.",
                "sound_projection.", "speech_embeddings.")
_MM_SUBSTR = ("visual.", "vision.", "audio.", "talker.", "vision_", "audio_", "token2wav.", "code2wav.",
              "projector.", "pre_mm_projector_norm", "image_newline", "view_seperator", "patch_embed",
              "patch_embedding", "patch_merger.", "patch_merge_mlp.", "model.connector.")

_MXFP4_EXPERT_RE = re.compile(r"^(?:language_model\.)?model\.layers\.(\d+)"
                              r"\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight_packed$")


class K3Converter:
    def __init__(self, dir_model: Path, outtype: str, experts_f32: bool, llama_src: Path):
        self.dir_model = dir_model
        self.llama_src = llama_src
        self.experts_f32 = experts_f32
        # ModelBase.load_hparams: AutoConfig fails without remote code -> plain config.json;
        # TextModel.__init__: hparams = {**hparams, **hparams["text_config"]}
        hp = json.loads((dir_model / "config.json").read_text(encoding="utf-8"))
        arch = (hp.get("architectures") or [None])[0]
        if arch != "KimiK3ForConditionalGeneration":
            raise ValueError(f"{dir_model / 'config.json'}: architectures[0] is {arch!r}, "
                             "expected KimiK3ForConditionalGeneration")
        self.hparams: dict[str, Any] = {**hp, **hp["text_config"]}
        self.model_arch = gguf.MODEL_ARCH.KIMI_K3
        self.block_count = self.hparams["num_hidden_layers"]
        self.tensor_map = gguf.get_tensor_name_map(self.model_arch, self.block_count)
        self.ftype = {"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16}[outtype]
        self.gguf_writer = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[self.model_arch])
        self.model_tensors: dict[str, StTensor] = {}
        self._res_parts: dict[str, tuple[str, np.ndarray]] = {}
        self._is_mxfp4 = False
        self.log: list[str] = []
        self.index_tensors()

    # ModelBase.index_tensors + filter_tensors (base + TextModel) + KimiK3Model.get_tensors
    def index_tensors(self) -> None:
        index_file = self.dir_model / "model.safetensors.index.json"
        parts = sorted(p.name for p in self.dir_model.iterdir()
                       if p.name.startswith("model") and p.name.endswith(".safetensors"))
        names_index: set[str] = set()
        if index_file.is_file():
            wm = json.loads(index_file.read_text(encoding="utf-8")).get("weight_map")
            if not isinstance(wm, dict):
                raise ValueError(f"{index_file}: can't load 'weight_map'")
            names_index = set(wm)
            parts = sorted(dict.fromkeys(wm.values()))
        names_parts: set[str] = set()
        for part in parts:
            for t in read_safetensors_header(self.dir_model / part):
                names_parts.add(t.name)
                name = t.name
                # TextModel.filter_tensors runs on raw names (before language_model. is stripped)
                if name.startswith(_MM_PREFIXES) or any(s in name for s in _MM_SUBSTR):
                    continue
                # ModelBase.filter_tensors
                if name.endswith("e_score_correction_bias"):
                    name = name.replace("e_score_correction_bias", "e_score_correction.bias")
                if "language_model." in name:
                    name = name.replace("language_model.", "")
                self.model_tensors[name] = t
        if names_index and names_index != names_parts:
            missing = sorted(names_index - names_parts)[:5]
            extra = sorted(names_parts - names_index)[:5]
            raise ValueError(f"{index_file}: weight map and shards disagree; missing {missing}, extra {extra}")

    def _is_mxfp4_packed(self) -> bool:  # KimiK3Model._is_mxfp4_packed
        q = self.hparams.get("quantization_config") or {}
        return q.get("quant_method") == "compressed-tensors" and q.get("format") == "mxfp4-pack-quantized"

    def check_mxfp4_scope(self) -> None:  # KimiK3Model.dequant_model
        if not self._is_mxfp4_packed():
            raise NotImplementedError("only the MXFP4 (compressed-tensors) K3 release format is ported")
        stray = [n for n in self.model_tensors if n.endswith(".weight_packed") and not _MXFP4_EXPERT_RE.match(n)]
        if stray:
            raise NotImplementedError(f"{len(stray)} MXFP4 tensor(s) outside the routed experts, e.g. {stray[0]!r}")

    def format_tensor_name(self, key: Any, bid: int | None = None, suffix: str = ".weight") -> str:
        if key not in gguf.MODEL_TENSORS[self.model_arch]:
            raise ValueError(f"Missing {key!r} for MODEL_TENSORS of {self.model_arch!r}")
        name: str = gguf.TENSOR_NAMES[key]
        if "{bid}" in name:
            assert bid is not None
            name = name.format(bid=bid)
        return name + suffix

    def match_model_tensor_name(self, name: str, key: Any, bid: int | None, suffix: str = ".weight") -> bool:
        if key not in gguf.MODEL_TENSORS[self.model_arch]:
            return False
        key_name: str = gguf.TENSOR_NAMES[key]
        if "{bid}" in key_name:
            if bid is None:
                return False
            key_name = key_name.format(bid=bid)
        elif bid is not None:
            return False
        return name == key_name + suffix

    def map_tensor_name(self, name: str) -> str:
        new_name = self.tensor_map.get_name(key=name, try_suffixes=(".weight", ".bias"))
        if new_name is None:
            raise ValueError(f"Can not map tensor {name!r}")
        return new_name

    @staticmethod
    def repack_mxfp4_blocks(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
        """ModelBase.repack_mxfp4_blocks: checkpoint pairs (2j, 2j+1) per byte -> ggml
        block_mxfp4 {e, qs[16]} with qs[j] = code[j] | code[j+16] << 4. Lossless."""
        p, s = packed.astype(np.uint8), scale.astype(np.uint8)
        rows, packed_cols = p.shape
        cols = packed_cols * 2
        if cols % 32 != 0:
            raise ValueError(f"MXFP4 source row has {cols} values, expected a multiple of 32")
        n_blocks = cols // 32
        if tuple(s.shape) != (rows, n_blocks):
            raise ValueError(f"MXFP4 scale shape {tuple(s.shape)} does not match {(rows, n_blocks)}")
        src = p.reshape(rows, n_blocks, 16)
        lo, hi = src & 0x0F, (src >> 4) & 0x0F
        vals = np.stack((lo, hi), axis=-1).reshape(rows, n_blocks, 32)
        qs = vals[:, :, :16] | (vals[:, :, 16:] << 4)
        raw = np.concatenate((s[:, :, None], qs.astype(np.uint8)), axis=-1)
        return raw.reshape(rows, n_blocks * 17)

    def write_mxfp4_experts(self) -> None:  # KimiK3Model._write_mxfp4_experts
        n_experts = self.hparams["num_experts"]
        proj = {"w1": gguf.MODEL_TENSOR.FFN_GATE_EXP, "w2": gguf.MODEL_TENSOR.FFN_DOWN_EXP,
                "w3": gguf.MODEL_TENSOR.FFN_UP_EXP}
        groups: dict[tuple[int, str], dict[int, tuple[str, str]]] = {}
        for name in self.model_tensors:
            m = _MXFP4_EXPERT_RE.match(name)
            if m is None:
                continue
            bid, eid, wid = int(m.group(1)), int(m.group(2)), m.group(3)
            scale_name = name.removesuffix("_packed") + "_scale"
            if scale_name not in self.model_tensors:
                raise KeyError(f"missing {scale_name} for {name}")
            groups.setdefault((bid, wid), {})[eid] = (name, scale_name)
        consumed: list[str] = []
        for (bid, wid), experts in sorted(groups.items()):
            missing = [e for e in range(n_experts) if e not in experts]
            if missing:
                raise KeyError(f"layer {bid} {wid}: {len(missing)} of {n_experts} experts missing, first is {missing[0]}")
            if len(experts) != n_experts:
                raise KeyError(f"layer {bid} {wid}: {len(experts)} experts, expected {n_experts}")
            blocks = []
            for eid in range(n_experts):
                pn, sn = experts[eid]
                blocks.append(self.repack_mxfp4_blocks(self.model_tensors[pn].raw(), self.model_tensors[sn].raw()))
                consumed += [pn, sn]
            data = np.stack(blocks)  # ModelBase._mxfp4_expert_tensor: [n_expert, rows, n_blocks*17] u8
            new_name = self.format_tensor_name(proj[wid], bid)
            if self.experts_f32:  # deviation (see module doc): same values, F32 storage
                deq = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.MXFP4).astype(np.float32)
                self.gguf_writer.add_tensor(new_name, deq, raw_dtype=gguf.GGMLQuantizationType.F32)
                self.log.append(f"{new_name}: MXFP4 repack -> F32, shape {tuple(reversed(deq.shape))}")
            else:
                shape = gguf.quant_shape_from_byte_shape(data.shape, gguf.GGMLQuantizationType.MXFP4)
                self.gguf_writer.add_tensor(new_name, data, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
                self.log.append(f"{new_name}: repacked {n_experts} experts to MXFP4, shape {tuple(reversed(shape))}")
        for name in consumed:
            del self.model_tensors[name]

    # KimiK3Model._try_fuse_res
    def _try_fuse_res(self, data: np.ndarray, name: str, bid: int | None):
        fusions = {"self_attention_res": (gguf.MODEL_TENSOR.ATTN_RES_SCORE, True),
                   "mlp_res": (gguf.MODEL_TENSOR.FFN_RES_SCORE, True),
                   "output_attn_res": (gguf.MODEL_TENSOR.OUTPUT_RES_SCORE, False)}
        for prefix, (tensor_id, per_layer) in fusions.items():
            for kind in ("norm", "proj"):
                if not name.endswith(f"{prefix}_{kind}.weight"):
                    continue
                key = f"{prefix}.{bid}"
                other = self._res_parts.pop(key, None)
                if other is None:
                    self._res_parts[key] = (kind, data)
                    return []
                other_kind, other_data = other
                assert other_kind != kind, f"duplicate {kind} for {key}"
                norm = data if kind == "norm" else other_data
                proj = data if kind == "proj" else other_data
                fused = norm.astype(np.float32).ravel() * proj.astype(np.float32).ravel()
                new_name = (self.format_tensor_name(tensor_id, bid) if per_layer
                            else gguf.TENSOR_NAMES[tensor_id] + ".weight")
                return [(new_name, fused)]
        return None

    # KimiK3Model.modify_tensors (+ ModelBase.modify_tensors = map_tensor_name)
    def modify_tensors(self, data: np.ndarray, name: str, bid: int | None) -> Iterator[tuple[str, np.ndarray]]:
        fused = self._try_fuse_res(data, name, bid)
        if fused is not None:
            yield from fused
            return
        if name.endswith((".q_conv1d.weight", ".k_conv1d.weight", ".v_conv1d.weight")):
            if data.ndim == 3:
                d_inner, _, d_conv = data.shape
            elif data.ndim == 2:
                d_inner, d_conv = data.shape
            else:
                raise ValueError(f"unexpected conv1d rank {data.ndim} for {name}")
            data = data.reshape(1, d_inner, 1, d_conv)
        if name.endswith(".A_log"):
            n_head = self.hparams["num_attention_heads"]
            data = (-np.exp(data.astype(np.float64)[:n_head])).astype(np.float32)
        if name.endswith(".dt_bias"):
            name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
        if name.endswith(".self_attn.g_proj.weight"):
            assert bid is not None
            is_kda = (bid + 1) not in self.hparams["linear_attn_config"]["full_attn_layers"]
            tid = gguf.MODEL_TENSOR.SSM_G if is_kda else gguf.MODEL_TENSOR.ATTN_GATE
            yield self.format_tensor_name(tid, bid), data
            return
        if ".block_sparse_moe.experts." in name:
            raise NotImplementedError(f"{name}: unquantized routed experts are not part of the K3 release format")
        if name.endswith("kv_b_proj.weight"):
            n_head_kv = self.hparams["num_key_value_heads"]
            v_head_dim = self.hparams["v_head_dim"]
            qk_nope = self.hparams["qk_nope_head_dim"]
            assert data.shape[0] == n_head_kv * (v_head_dim + qk_nope), f"{name}: shape {data.shape}"
            kv_b = data.reshape(n_head_kv, v_head_dim + qk_nope, data.shape[-1])
            k_b, v_b = kv_b[:, :qk_nope], kv_b[:, qk_nope:]
            k_b = np.ascontiguousarray(k_b.transpose(0, 2, 1))
            yield self.map_tensor_name(name.replace("kv_b_proj", "k_b_proj")), k_b
            yield self.map_tensor_name(name.replace("kv_b_proj", "v_b_proj")), np.ascontiguousarray(v_b)
            return
        yield self.map_tensor_name(name), data

    # ModelBase.prepare_tensors (K3 path) + KimiK3Model.prepare_tensors
    def prepare_tensors(self) -> None:
        self.check_mxfp4_scope()
        self.write_mxfp4_experts()  # generate_extra_tensors
        f32_keys = (gguf.MODEL_TENSOR.FFN_GATE_INP, gguf.MODEL_TENSOR.FFN_GATE_INP_SHEXP, gguf.MODEL_TENSOR.POS_EMBD,
                    gguf.MODEL_TENSOR.TOKEN_TYPES, gguf.MODEL_TENSOR.SSM_CONV1D, gguf.MODEL_TENSOR.SHORTCONV_CONV,
                    gguf.MODEL_TENSOR.TIME_MIX_FIRST, gguf.MODEL_TENSOR.TIME_MIX_W1, gguf.MODEL_TENSOR.TIME_MIX_W2,
                    gguf.MODEL_TENSOR.TIME_MIX_DECAY_W1, gguf.MODEL_TENSOR.TIME_MIX_DECAY_W2,
                    gguf.MODEL_TENSOR.TIME_MIX_LERP_FUSED, gguf.MODEL_TENSOR.POSNET_NORM1,
                    gguf.MODEL_TENSOR.POSNET_NORM2, gguf.MODEL_TENSOR.V_ENC_EMBD_POS, gguf.MODEL_TENSOR.A_ENC_EMBD_POS,
                    gguf.MODEL_TENSOR.ALTUP_CORRECT_COEF, gguf.MODEL_TENSOR.ALTUP_PREDICT_COEF,
                    gguf.MODEL_TENSOR.SSM_CONV1D_Q, gguf.MODEL_TENSOR.SSM_CONV1D_K, gguf.MODEL_TENSOR.SSM_CONV1D_V,
                    gguf.MODEL_TENSOR.INDEXER_PROJ)
        for name, t in list(self.model_tensors.items()):
            if name.endswith((".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")):
                continue
            data = t.load().astype(np.float32) if t.dtype not in ("F16", "F32") else t.load()
            bid = next((int(p) for p in name.split(".") if p.isdecimal()), None)
            for new_name, d in self.modify_tensors(data, name, bid):
                n_dims = d.ndim
                qtype: Any = False
                if n_dims <= 1 or new_name.endswith("_norm.weight"):
                    qtype = gguf.GGMLQuantizationType.F32
                if qtype is False and (any(self.match_model_tensor_name(new_name, k, bid) for k in f32_keys)
                                       or new_name[-7:] not in (".weight", ".lora_a", ".lora_b")):
                    qtype = gguf.GGMLQuantizationType.F32
                if qtype is False:
                    qtype = {gguf.LlamaFileType.ALL_F32: gguf.GGMLQuantizationType.F32,
                             gguf.LlamaFileType.MOSTLY_BF16: gguf.GGMLQuantizationType.BF16}[self.ftype]
                out = gguf.quants.quantize(d, qtype)
                self.gguf_writer.add_tensor(new_name, out, raw_dtype=qtype)
                self.log.append(f"{new_name}: {t.dtype} -> {qtype.name}, shape {tuple(reversed(d.shape))}")
        if self._res_parts:
            raise ValueError(f"Unpaired attention-residual tensors: {sorted(self._res_parts)}")
        self._is_mxfp4 = True
        self.ftype = gguf.LlamaFileType.MOSTLY_MXFP4_MOE

    # TextModel.set_gguf_parameters + KimiK3Model.set_gguf_parameters
    def set_gguf_parameters(self) -> None:
        hp, w = self.hparams, self.gguf_writer
        # Not in llama.cpp: its GGUF has one head count for KDA and MLA (and narrows A_log to
        # num_attention_heads entries), which is only right while the two agree, as in the
        # release. Refuse a config where they differ instead of converting it wrongly.
        if hp["linear_attn_config"]["num_heads"] != hp["num_attention_heads"]:
            raise NotImplementedError(
                f"linear_attn_config.num_heads {hp['linear_attn_config']['num_heads']} != "
                f"num_attention_heads {hp['num_attention_heads']}: llama.cpp's kimi-k3 has one head count")
        hp["num_key_value_heads"] = 1  # KimiK3Model: MLA served as MQA
        w.add_block_count(self.block_count)
        w.add_context_length(hp["max_position_embeddings"])
        w.add_embedding_length(hp["hidden_size"])
        w.add_feed_forward_length(hp["intermediate_size"])
        w.add_head_count(hp["num_attention_heads"])
        w.add_head_count_kv(hp["num_key_value_heads"])
        for k in ("rope_parameters", "rope_scaling", "rope_theta", "head_dim", "layer_norm_eps", "n_group"):
            if hp.get(k) is not None:
                raise NotImplementedError(f"config key {k!r} is set; this port assumes the K3 release config")
        w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
        w.add_expert_count(hp["num_experts"])
        w.add_expert_used_count(hp["num_experts_per_token"])
        if (tg := hp.get("topk_group")) is not None:
            w.add_expert_group_used_count(tg)
        if hp["moe_router_activation_func"] != "sigmoid":
            raise ValueError(f"moe_router_activation_func {hp['moe_router_activation_func']!r}, expected sigmoid")
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_file_type(self.ftype)
        # --- KimiK3Model part ---
        w.add_vocab_size(hp["vocab_size"])
        la = hp["linear_attn_config"]
        full = la["full_attn_layers"]
        w.add_head_count_kv([hp["num_key_value_heads"] if (il + 1) in full else 0 for il in range(self.block_count)])
        w.add_ssm_conv_kernel(la["short_conv_kernel_size"])
        w.add_kda_head_dim(la["head_dim"])
        if (lb := la.get("gate_lower_bound")) is not None:
            w.add_kda_gate_lower_bound(lb)
        if (q_lora := hp.get("q_lora_rank")) is not None:
            w.add_q_lora_rank(q_lora)
        w.add_kv_lora_rank(hp["kv_lora_rank"])
        assert hp.get("mla_use_nope"), "K3 MLA is expected to be nope-only"
        w.add_rope_dimension_count(hp["qk_rope_head_dim"])
        w.add_key_length(hp["kv_lora_rank"] + hp["qk_rope_head_dim"])
        w.add_value_length(hp["kv_lora_rank"])
        w.add_key_length_mla(hp["qk_nope_head_dim"] + hp["qk_rope_head_dim"])
        w.add_value_length_mla(hp["v_head_dim"])
        w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
        w.add_expert_shared_count(hp["num_shared_experts"])
        w.add_leading_dense_block_count(hp["first_k_dense_replace"])
        w.add_expert_weights_scale(hp["routed_scaling_factor"])
        w.add_expert_weights_norm(hp["moe_renormalize"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        if (latent := hp.get("routed_expert_hidden_size")) is not None:
            w.add_expert_latent_length(latent)
        assert hp["hidden_act"] == "situ", f"unexpected hidden_act {hp['hidden_act']!r}"
        w.add_activation_situ_beta(hp["activation_situ_beta"])
        w.add_activation_situ_linear_beta(hp["activation_situ_linear_beta"])
        w.add_attn_res_block_size(hp["attn_res_block_size"])

    # KimiLinearModel.set_vocab (kimi-k2 branch, tokenizer = Moonshot's TikTokenTokenizer,
    # replaced by tiktoken + the rank file) + KimiK3Model.set_vocab
    def set_vocab(self) -> None:
        import tiktoken
        ranks_file = self.dir_model / "tiktoken.model"
        mergeable_ranks: dict[bytes, int] = {}
        for line in ranks_file.read_text().splitlines():
            if not line:
                continue
            tok, rank = line.split()
            mergeable_ranks[base64.b64decode(tok)] = int(rank)
        tcfg = json.loads((self.dir_model / "tokenizer_config.json").read_text(encoding="utf-8"))
        named = {int(i): v["content"] for i, v in (tcfg.get("added_tokens_decoder") or {}).items()}
        n_base = len(mergeable_ranks)
        special_tokens = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n_base, n_base + 256)}
        enc = tiktoken.Encoding(name="kimi", pat_str=kimi_pat_str(), mergeable_ranks=mergeable_ranks,
                                special_tokens=special_tokens)
        # TextModel.get_vocab_base_pre: hash of the tokenization of a fixed check text
        chktok = enc.encode(CHKTXT, allowed_special="all")
        chkhsh = hashlib.sha256(str(chktok).encode()).hexdigest()
        if chkhsh != KIMI_K2_CHKHSH:
            raise ValueError(f"pre-tokenizer check hash {chkhsh} is not kimi-k2's {KIMI_K2_CHKHSH}")
        tokpre = "kimi-k2"
        byte_encoder = bytes_to_unicode()

        def tbs(b: bytes) -> str:  # QwenModel.token_bytes_to_string
            return "".join(byte_encoder[c] for c in b)

        merges, vocab = [], {}
        for token, rank in mergeable_ranks.items():
            vocab[tbs(token)] = rank
            if len(token) == 1:
                continue
            merged = qwen_bpe(mergeable_ranks, token, max_rank=rank)
            if len(merged) == 2:
                merges.append(" ".join(map(tbs, merged)))
        vocab_size = self.hparams["vocab_size"]
        reverse_vocab = {i: t for t, i in {**vocab, **special_tokens}.items()}
        tokens, toktypes = [], []
        special_ids = set(special_tokens.values())
        for i in range(vocab_size):
            if i not in reverse_vocab:
                tokens.append(f"[PAD{i}]")
                toktypes.append(gguf.TokenType.UNUSED)
            else:
                tokens.append(reverse_vocab[i])
                toktypes.append(gguf.TokenType.CONTROL if i in special_ids else gguf.TokenType.NORMAL)
        w = self.gguf_writer
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(tokpre)
        w.add_token_list(tokens)
        w.add_token_types(toktypes)
        w.add_token_merges(merges)
        special_vocab = gguf.SpecialVocab(self.dir_model, load_merges=False)
        special_vocab.add_to_gguf(w)
        w.add_eos_token_id(special_tokens[str(tcfg.get("eos_token", "[EOS]"))])  # tokenizer.eos_id
        if (eos := self.hparams.get("eos_token_id")) is not None:  # KimiK3Model: restore config eos
            w.add_eos_token_id(eos)
        if gguf.SpecialVocab(self.dir_model, load_merges=False).chat_template is None:
            w.add_chat_template((self.llama_src / "models" / "templates" / "Kimi-K3.jinja").read_text(encoding="utf-8"))

    # ModelBase.prepare_metadata + TextModel.prepare_metadata (vocab part)
    def prepare_metadata(self) -> None:
        total_params, shared_params, expert_params, expert_count = self.gguf_writer.get_total_parameter_count()
        md = gguf.Metadata.load(None, self.dir_model, None, total_params)
        if md.name is None:
            md.name = self.dir_model.name
        if md.size_label is None and total_params > 0:
            md.size_label = gguf.size_label(total_params, shared_params, expert_params, expert_count)
        self.gguf_writer.add_type(gguf.GGUFType.MODEL)
        md.set_gguf_meta_model(self.gguf_writer)
        self.set_gguf_parameters()
        self.gguf_writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        self.set_vocab()

    def write(self, out: Path) -> None:  # ModelBase.write
        self.prepare_tensors()
        self.prepare_metadata()
        self.gguf_writer.write_header_to_file(path=out)
        self.gguf_writer.write_kv_data_to_file()
        self.gguf_writer.write_tensors_to_file(progress=False)
        self.gguf_writer.close()


CHKTXT = ('\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ '
          '🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ '
          '------======= нещо на Български \'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\'s there, '
          '\'RE you sure? \'M not sure I\'ll make it, \'D you like some tea? We\'Ve a\'lL')
# TextModel.get_vocab_base_pre: "ref: https://huggingface.co/moonshotai/Kimi-K2-Base" -> "kimi-k2"
KIMI_K2_CHKHSH = "81212dc7cdb7e0c1074ca62c5aeab0d43c9f52b8a737be7b12a777c953027890"


def kimi_pat_str() -> str:
    """The K3 pre-tokenizer regex (docs/K3.md §7.3; NeMo `_build_kimi_k3_pat_str`)."""
    amp = chr(38) * 2
    up = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}" + amp + r"[^\p{Han}]]"
    lo = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}" + amp + r"[^\p{Han}]]"
    return "|".join([r"[\p{Han}]+",
                     r"[^\r\n\p{L}\p{N}]?" + up + "*" + lo + r"+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
                     r"[^\r\n\p{L}\p{N}]?" + up + "+" + lo + r"*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
                     r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-unicode map (transformers.convert_slow_tokenizer.bytes_to_unicode)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def qwen_bpe(mergeable_ranks: dict[bytes, int], token: bytes, max_rank: int | None = None) -> list[bytes]:
    """QwenModel.bpe (verbatim logic)."""
    parts = [bytes([b]) for b in token]
    while True:
        min_idx = None
        min_rank = None
        for i, pair in enumerate(zip(parts[:-1], parts[1:])):
            rank = mergeable_ranks.get(pair[0] + pair[1])
            if rank is not None and (min_rank is None or rank < min_rank):
                min_idx = i
                min_rank = rank
        if min_rank is None or (max_rank is not None and min_rank >= max_rank):
            break
        assert min_idx is not None
        parts = parts[:min_idx] + [parts[min_idx] + parts[min_idx + 1]] + parts[min_idx + 2:]
    return parts


def convert(dir_model: Path, out: Path, outtype: str = "f32", experts_f32: bool = False,
            llama_src: Path = DEFAULT_LLAMA_SRC) -> list[str]:
    """Convert `dir_model` to `out`; returns the per-tensor log lines."""
    if gguf is None:
        load_gguf(llama_src)
    c = K3Converter(dir_model, outtype, experts_f32, llama_src)
    c.write(out)
    return c.log


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--outfile", type=Path, required=True)
    ap.add_argument("--outtype", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--experts-f32", action="store_true")
    ap.add_argument("--llama-src", type=Path, default=DEFAULT_LLAMA_SRC)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    for line in convert(args.model_dir, args.outfile, args.outtype, args.experts_f32, args.llama_src):
        print(line)


if __name__ == "__main__":
    main()
