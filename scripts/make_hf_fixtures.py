"""Writes the transformers parity fixtures of tests/serve/test_hf_checkpoint.py.

Run it in a separate environment that has torch and transformers (neither is a dependency of this
project)::

    python3.11 -m venv /tmp/hfvenv
    /tmp/hfvenv/bin/pip install torch transformers safetensors tokenizers jinja2
    /tmp/hfvenv/bin/python scripts/make_hf_fixtures.py            # -> tests/serve/fixtures/hf/

For each architecture serve_jax loads it writes, with ``save_pretrained``, a tiny random
checkpoint (bfloat16 weights, so the fixtures stay small; the reference runs them in float32) and
a small BPE tokenizer with a chat template, then ``reference.json`` and ``logits.npy``:
transformers' prompt token ids, float32 logits at the last prompt positions
(``logits.npy``: [prompts + chat, LOGIT_ROWS, vocab]), greedy tokens and text (the text a
pipeline returns: the continuation of the prompt's text, special tokens and the EOS left out) for
a few prompts, and the same for one chat rendered by ``apply_chat_template``.

* ``llama2``: LlamaForCausalLM, grouped-query attention, untied, sharded (small
  ``max_shard_size``), a sentencepiece-style (Metaspace) tokenizer with ``add_bos_token`` and a
  Llama-2 ``[INST]`` template that calls ``raise_exception``;
* ``llama3``: LlamaForCausalLM with ``rope_scaling`` of type llama3 and tied embeddings, one
  ``model.safetensors``, config.json in the classic layout (``rope_theta``/``rope_scaling``), a
  byte-level tokenizer whose BOS comes from its post-processor, and a generation_config.json with
  two EOS ids (the second one is a token greedy decoding emits, so a prompt stops early);
* ``mistral``: MistralForCausalLM with ``head_dim`` != hidden_size / heads and a sliding window;
* ``qwen2``: Qwen2ForCausalLM (q/k/v biases), byte-level tokenizer without BOS, ChatML template.

Weights are drawn large enough (and biases and norms non-trivial) that greedy choices have clear
margins; the script checks that every greedy step's top-2 logit gap exceeds 1e-3.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "Serving language models on accelerators with paged attention and continuous batching.",
    "héllo wörld, ça va? naïve café, 中文 文本 测试, emoji 🙂 and ümlauts.",
    "The system says: be brief. The user asks a question and the assistant answers it.",
] * 20

PROMPTS = ["Hello world", "The quick brown fox", "héllo 中文 🙂"]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say héllo to 中文."},
]
MAX_NEW = 8
LOGIT_ROWS = 3
"""Logits are kept for the last prompt positions only (the fixtures stay small)."""

LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = false %}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if loop.index0 == 0 and system %}{% set content = '<<SYS>>\\n' + system + "
    "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_level_tokenizer(specials: list[str], bos: str | None) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tok.token_to_id(bos))],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def metaspace_tokenizer(specials: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(  # as Llama 2's tokenizer.json
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return tok


def save_tokenizer(tok: Tokenizer, out: Path, template: str, **specials) -> None:
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **specials)
    fast.chat_template = template
    fast.clean_up_tokenization_spaces = False
    fast.save_pretrained(out)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights with clear greedy margins: norms near 1, non-zero biases, fan-in-scaled matrices."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.5 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise * p.shape[1] ** -0.5 * 1.5)


def greedy(model, ids: list[int]) -> tuple[list[int], float]:
    """transformers' greedy generate: new tokens and the smallest top-2 gap of its steps."""
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=MAX_NEW,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
        pad_token_id=0,
    )
    new = out.sequences[0, len(ids) :].tolist()
    gaps = [torch.topk(s[0], 2).values for s in out.logits]
    return new, float(min(float(v[0] - v[1]) for v in gaps))


def reference(out: Path) -> dict:
    """Reloads the saved checkpoint in float32 (as a user would) and records its outputs."""
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    rows, logits, min_gap = [], [], float("inf")

    def run(ids: list[int]) -> dict:
        nonlocal min_gap
        with torch.no_grad():
            logits.append(model(torch.tensor([ids])).logits[0, -LOGIT_ROWS:].float().numpy())
            new, gap = greedy(model, ids)
        min_gap = min(min_gap, gap)
        eos = model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        stopped = bool(new) and new[-1] in eos
        visible = new[:-1] if stopped else new  # the EOS ends the text, it is not part of it
        prompt_text = tok.decode(ids, skip_special_tokens=True)
        text = tok.decode(ids + visible, skip_special_tokens=True)[len(prompt_text) :]
        return {"prompt_ids": ids, "greedy_ids": new, "text": text, "stopped": stopped}

    for prompt in PROMPTS:
        rows.append({"prompt": prompt, **run(tok(prompt)["input_ids"])})
    chat_text = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    chat = {"messages": CHAT, "rendered": chat_text}
    chat.update(run(tok(chat_text, add_special_tokens=False)["input_ids"]))
    if min_gap < 1e-3:
        raise SystemExit(f"{out.name}: a greedy step has top-2 gap {min_gap:.2e}; change the seed")
    np.save(out / "logits.npy", np.stack(logits).astype(np.float32))
    return {"prompts": rows, "chat": chat, "logit_rows": LOGIT_ROWS, "min_greedy_gap": min_gap}


def build(name: str, out: Path, seed: int) -> None:
    torch.manual_seed(seed)
    small = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
    )
    shard = None
    if name in ("llama2", "mistral"):
        tok = metaspace_tokenizer(["<unk>", "<s>", "</s>"])
        template, specials = (
            LLAMA2_TEMPLATE,
            dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>"),
        )
        ids = dict(bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("</s>"))
        if name == "llama2":
            model = LlamaForCausalLM(LlamaConfig(vocab_size=300, **small, **ids))
        else:
            model = MistralForCausalLM(
                MistralConfig(vocab_size=300, head_dim=16, sliding_window=128, **small, **ids)
            )
        shard = "40KB"
    elif name == "llama3":
        names = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
        names += ["<|start_header_id|>", "<|end_header_id|>"]
        tok = byte_level_tokenizer(names, bos="<|begin_of_text|>")
        template, specials = (
            LLAMA3_TEMPLATE,
            dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"),
        )
        cfg = LlamaConfig(
            vocab_size=300,
            tie_word_embeddings=True,
            bos_token_id=tok.token_to_id("<|begin_of_text|>"),
            eos_token_id=[tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")],
            rope_theta=10000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            **small,
        )
        model = LlamaForCausalLM(cfg)
    else:
        tok = byte_level_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos=None)
        template, specials = (
            CHATML_TEMPLATE,
            dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
        )
        model = Qwen2ForCausalLM(
            Qwen2Config(vocab_size=300, eos_token_id=tok.token_to_id("<|im_end|>"), **small)
        )
        shard = "40KB"
    randomize(model, seed)
    model = model.to(torch.bfloat16)
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    save_tokenizer(tok, out, template, **specials)
    if name == "llama2":  # and add_bos_token in the config, as Llama 2's tokenizer_config.json
        cfg_path = out / "tokenizer_config.json"
        tc = json.loads(cfg_path.read_text())
        tc.update(add_bos_token=True, add_eos_token=False)
        cfg_path.write_text(json.dumps(tc, indent=2))
    if name == "llama3":
        classic_config(out)
    result = reference(out)
    if name == "llama3":  # a second EOS id that greedy decoding reaches: the prompt stops early
        first = result["prompts"][0]["greedy_ids"]
        gen_path = out / "generation_config.json"
        gen = json.loads(gen_path.read_text())
        gen["eos_token_id"] = [tok.token_to_id("<|eot_id|>"), first[3]]
        gen_path.write_text(json.dumps(gen, indent=2))
        result = reference(out)
    (out / "reference.json").write_text(json.dumps(result, indent=1, ensure_ascii=False))


def classic_config(out: Path) -> None:
    """config.json in the layout the Hub's Llama 3 checkpoints have (rope_theta, rope_scaling)."""
    path = out / "config.json"
    cfg = json.loads(path.read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = params
    path.write_text(json.dumps(cfg, indent=2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="tests/serve/fixtures/hf")
    args = p.parse_args()
    root = Path(args.out)
    for i, name in enumerate(["llama2", "llama3", "mistral", "qwen2"]):
        build(name, root / name, seed=i)
        files = sorted(f.name for f in (root / name).iterdir())
        print(name, files)
    total = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    print(f"fixtures: {total / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
