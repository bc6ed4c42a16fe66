#!/usr/bin/env python3
"""A tiny random-weight Qwen3 with the real Qwen3 tokenizer and chat template.

Writes one directory that serves both engines of the real-engine tests:

    config.json, tokenizer.json, tokenizer_config.json   the model as Hugging Face
                                                          lays it out (vLLM with
                                                          --load-format dummy; kvgate)
    tiny-qwen3.gguf                                       the same model for llama.cpp

2 layers, hidden 128, 4 query heads and 2 KV heads of 32 dims, FFN 256, the vocabulary
of the real Qwen3 (151,936 rows, the tokenizer's 151,669 tokens padded as the real
models are). Weights come from numpy with a fixed seed, so the file is the same on
every run; no torch, no transformers. The GGUF metadata is what llama.cpp's
convert_hf_to_gguf.py writes for Qwen3ForCausalLM: tokenizer model gpt2 with the qwen2
pre-tokenizer, the merges, token types (special added tokens CONTROL, the rest of the
added tokens USER_DEFINED, padding UNUSED), the chat template, bos/eos/pad ids, rope
base, RMS epsilon, head dims.

The embedding (tied with the output head) has zero rows for every added token and the
padding: their logits are 0 while the argmax of the others is > 0, so greedy decoding
never ends on an end-of-generation token and always runs to max_tokens.

The GGUF writer is the gguf package of the llama.cpp sources that
scripts/engines/llama_server.sh builds from (its gguf-py directory, passed as
--gguf-py), or an installed `gguf` package.

Prints the output directory. Idempotent: an existing complete directory with the same
recipe is kept.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np

RECIPE_VERSION = 1
SEED = 20240611

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TOKENIZER = ROOT / "models" / "qwen3-14b"
DEFAULT_CACHE = Path(os.environ.get("KVGATE_ENGINES_CACHE") or (
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvgate-engines"))

HIDDEN = 128
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 32
FFN = 256
VOCAB = 151936  # Qwen3's embedding rows (the tokenizer has 151,669 tokens)
MAX_POSITIONS = 40960
ROPE_THETA = 1_000_000.0
RMS_EPS = 1e-6
GGUF_NAME = "tiny-qwen3.gguf"


def hf_config(bos: int, eos: int) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": FFN,
        "max_position_embeddings": MAX_POSITIONS,
        "max_window_layers": LAYERS,
        "model_type": "qwen3",
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": RMS_EPS,
        "rope_scaling": None,
        "rope_theta": ROPE_THETA,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB,
    }


def recipe_digest(tokenizer_dir: Path) -> str:
    h = hashlib.sha256(f"v{RECIPE_VERSION} seed{SEED}".encode())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        h.update((tokenizer_dir / name).read_bytes())
    h.update(Path(__file__).read_bytes())
    return h.hexdigest()[:16]


def import_gguf(gguf_py: Path | None) -> Any:
    if gguf_py is not None:
        if not (gguf_py / "gguf" / "__init__.py").is_file():
            sys.exit(f"tiny_qwen3_gguf: no gguf package under {gguf_py}")
        sys.path.insert(0, str(gguf_py))
    import gguf  # type: ignore[import-not-found]

    return gguf


def vocab(tokenizer_dir: Path, gguf: Any) -> tuple[list[str], list[int], list[int]]:
    """Tokens, their GGUF types, and the ids whose rows are zeroed (see the docstring)."""
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    cfg = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    if tok["model"]["type"] != "BPE":
        sys.exit("tiny_qwen3_gguf: the tokenizer is not BPE")
    by_id: dict[int, str] = {i: t for t, i in tok["model"]["vocab"].items()}
    added: dict[int, dict[str, Any]] = {a["id"]: a for a in tok["added_tokens"]}
    decoder = cfg.get("added_tokens_decoder", {})
    for i, a in added.items():
        by_id[i] = a["content"]
    if max(by_id) >= VOCAB:
        sys.exit(f"tiny_qwen3_gguf: token id {max(by_id)} does not fit in {VOCAB} rows")
    tokens: list[str] = []
    types: list[int] = []
    silent: list[int] = []
    for i in range(VOCAB):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            silent.append(i)
            continue
        text = by_id[i]
        tokens.append(text)
        if i in added:
            # convert_hf_to_gguf.get_vocab_base: special (as transformers reads it, from
            # tokenizer_config's added_tokens_decoder) or <|...|> -> CONTROL, else
            # USER_DEFINED. Qwen's added tokens all round-trip unchanged.
            special = decoder.get(str(i), added[i]).get("special", added[i]["special"])
            looks = text.startswith("<|") and text.endswith("|>")
            types.append(gguf.TokenType.CONTROL if special or looks
                         else gguf.TokenType.USER_DEFINED)
            silent.append(i)
        else:
            types.append(gguf.TokenType.NORMAL)
    return tokens, types, silent


def weights(silent: list[int]) -> dict[str, np.ndarray]:
    """HF-shaped arrays ([out, in]), named as llama.cpp names Qwen3's tensors."""
    rng = np.random.default_rng(SEED)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    embd = mat(VOCAB, HIDDEN)
    embd[silent] = 0
    out: dict[str, np.ndarray] = {"token_embd.weight": embd, "output_norm.weight": ones(HIDDEN)}
    for b in range(LAYERS):
        out |= {
            f"blk.{b}.attn_norm.weight": ones(HIDDEN),
            f"blk.{b}.attn_q.weight": mat(HEADS * HEAD_DIM, HIDDEN),
            f"blk.{b}.attn_k.weight": mat(KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{b}.attn_v.weight": mat(KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{b}.attn_output.weight": mat(HIDDEN, HEADS * HEAD_DIM),
            f"blk.{b}.attn_q_norm.weight": ones(HEAD_DIM),
            f"blk.{b}.attn_k_norm.weight": ones(HEAD_DIM),
            f"blk.{b}.ffn_norm.weight": ones(HIDDEN),
            f"blk.{b}.ffn_gate.weight": mat(FFN, HIDDEN),
            f"blk.{b}.ffn_up.weight": mat(FFN, HIDDEN),
            f"blk.{b}.ffn_down.weight": mat(HIDDEN, FFN),
        }
    return out


def write_gguf(out_dir: Path, gguf: Any) -> Path:
    tokens, types, silent = vocab(out_dir, gguf)
    arch = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN3]
    path = out_dir / GGUF_NAME
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name("tiny-qwen3")
    # TextModel.set_gguf_parameters for Qwen3ForCausalLM
    w.add_block_count(LAYERS)
    w.add_context_length(MAX_POSITIONS)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(ROPE_THETA)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    # _set_vocab_gpt2: Qwen2/2.5/3's BPE pre-tokenizer is llama.cpp's "qwen2"
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    # merges, bos/eos/pad ids (tokenizer_config, then config.json), add_bos_token false,
    # the chat template: read by the same class the converter uses
    special = gguf.SpecialVocab(out_dir, load_merges=True, n_vocab=len(tokens))
    if not special.merges or special.chat_template is None:
        sys.exit("tiny_qwen3_gguf: the tokenizer gave no merges or no chat template")
    special.add_to_gguf(w, quiet=True)
    for name, data in weights(silent).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer-dir", type=Path, default=DEFAULT_TOKENIZER,
                    help="a Qwen3 directory with tokenizer.json and tokenizer_config.json")
    ap.add_argument("--out-dir", type=Path, default=None,
                    help="default: <cache>/models/tiny-qwen3-<recipe digest>")
    ap.add_argument("--gguf-py", type=Path, default=None,
                    help="llama.cpp's gguf-py directory (default: an installed gguf)")
    args = ap.parse_args()
    digest = recipe_digest(args.tokenizer_dir)
    out_dir: Path = args.out_dir or DEFAULT_CACHE / "models" / f"tiny-qwen3-{digest}"
    stamp = out_dir / ".complete"
    if stamp.is_file() and stamp.read_text().strip() == digest:
        print(out_dir)
        return
    gguf = import_gguf(args.gguf_py)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(args.tokenizer_dir / name, tmp / name)
    tok = json.loads((tmp / "tokenizer.json").read_text(encoding="utf-8"))
    ids = {a["content"]: a["id"] for a in tok["added_tokens"]}
    bos, eos = ids["<|endoftext|>"], ids["<|im_end|>"]  # as Qwen3's own config.json
    (tmp / "config.json").write_text(json.dumps(hf_config(bos, eos), indent=2) + "\n")
    write_gguf(tmp, gguf)
    (tmp / ".complete").write_text(digest + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    if args.out_dir is None:  # models of an older recipe are not used any more
        for old in out_dir.parent.glob("tiny-qwen3-*"):
            if old != out_dir:
                shutil.rmtree(old, ignore_errors=True)
    print(out_dir)


if __name__ == "__main__":
    main()
