"""llama.cpp's HF -> GGUF converter, taught to repack compressed-tensors MXFP4 routed experts
of the families it stacks experts for (Qwen3-MoE, DeepSeek-V3).

Why: the converter (``convert_hf_to_gguf.py``) repacks ``mxfp4-pack-quantized`` experts into
GGML's ``block_mxfp4`` only in its Kimi K3 class; every other family fails in
``ModelBase.dequant_model`` (``Quant format 'mxfp4-pack-quantized' ... not yet supported``).
The repack is the converter's own (``ModelBase._mxfp4_expert_tensor`` ->
``repack_mxfp4_blocks``: a byte permutation, nothing re-quantized); only the grouping of the
per-expert tensors into the stacked ``ffn_{gate,up,down}_exps`` is ours, as K3 does it, named
through the family's own tensor map. Everything else is the stock converter, unchanged.

Run as a file in a fresh interpreter (the converter brings its own ``gguf`` package, which
must be imported before any other): ``python -P mxfp4_repack.py CONVERTER_DIR MODEL [converter
options]``. It imports nothing of reap's.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

#: HF architectures whose converter class stacks the per-expert ``[out, in]`` Linear weights
#: as they are (``torch.stack`` in expert order): a stacked MXFP4 tensor is then what the
#: float path would give, dequantized. Proven by ``tests/test_gguf_mxfp4_export.py``.
FAMILIES = ("Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM")
FORMAT = "mxfp4-pack-quantized"
#: ``<stem>.experts.<id>.<proj>.weight_packed``; the stacked name is ``<stem>.experts.<proj>.weight``
EXPERT_RE = re.compile(r"^(?P<stem>.+\.experts)\.(?P<eid>\d+)\.(?P<proj>\w+)\.weight_packed$")


def is_mxfp4_packed(hparams: dict) -> bool:
    """Whether a config's quantization is compressed-tensors ``mxfp4-pack-quantized``."""
    q = hparams.get("quantization_config") or {}
    return q.get("quant_method") == "compressed-tensors" and q.get("format") == FORMAT


def with_mxfp4_experts(model_class: type, architecture: str) -> type:
    """``model_class`` (a converter class) with the MXFP4 expert repack; unchanged for a class
    with a repack of its own (K3, MiMo); other families refused when the config is MXFP4."""
    if hasattr(model_class, "_MXFP4_EXPERT_RE"):
        return model_class
    import gguf  # the converter's, put first on sys.path by main()
    from conversion.base import logger

    exps = (
        gguf.MODEL_TENSOR.FFN_GATE_EXP,
        gguf.MODEL_TENSOR.FFN_UP_EXP,
        gguf.MODEL_TENSOR.FFN_DOWN_EXP,
    )

    class MXFP4Experts(model_class):
        model_arch = model_class.model_arch  # the converter requires each class to name it

        def dequant_model(self):
            if not is_mxfp4_packed(self.hparams):
                return super().dequant_model()
            if architecture not in FAMILIES:
                raise SystemExit(
                    f"MXFP4 experts of {architecture} have no repack here (only {', '.join(FAMILIES)}): "
                    "convert a dequantized copy of the checkpoint instead"
                )
            if self.fuse_gate_up_exps:
                raise SystemExit("--fuse-gate-up-exps cannot fuse MXFP4 experts: drop it")
            stray = [
                n
                for n in self.model_tensors
                if n.endswith(".weight_packed") and not EXPERT_RE.match(n)
            ]
            if stray:
                raise SystemExit(
                    f"{len(stray)} MXFP4 tensor(s) outside the routed experts, e.g. {stray[0]!r}: "
                    "only routed experts can be repacked"
                )
            # nothing else is quantized: every other tensor is read as the stock converter reads it

        def generate_extra_tensors(self):
            # not a generator: base.py chains this with get_tensors(), so the expert tensors
            # must leave model_tensors before that starts (as in K3's class)
            if is_mxfp4_packed(self.hparams):
                self._write_mxfp4_experts()
            return super().generate_extra_tensors()

        def _write_mxfp4_experts(self) -> None:
            n = self.find_hparam(["num_local_experts", "num_experts", "n_routed_experts"])
            groups: dict[tuple[str, str], dict[int, str]] = {}
            for name in self.model_tensors:
                if m := EXPERT_RE.match(name):
                    groups.setdefault((m["stem"], m["proj"]), {})[int(m["eid"])] = name
            for (stem, proj), experts in groups.items():
                if sorted(experts) != list(range(n)):
                    raise SystemExit(
                        f"{stem}.*.{proj}: {len(experts)} of {n} experts are MXFP4 (the others are "
                        "in quantization_config.ignore?); a GGUF expert tensor holds one type"
                    )
            for (stem, proj), experts in sorted(groups.items()):
                names = [experts[e] for e in range(n)]
                scales = [p.removesuffix("_packed") + "_scale" for p in names]
                kept = self.filter_tensors((f"{stem}.{proj}.weight", lambda: None))
                bid = next(int(p) for p in stem.split(".") if p.isdecimal())
                if kept is None or (
                    getattr(self, "skip_mtp", False) and bid >= self.hparams["num_hidden_layers"]
                ):
                    # tensors the family's float path drops (DeepSeek's MTP layers): drop them too
                    logger.info(f"{stem}.*.{proj}: skipped, as the converter skips this layer")
                    for name in names + scales:
                        self.model_tensors.pop(name, None)
                    continue
                stacked = kept[0]
                new_name = self.map_tensor_name(stacked)
                if not any(self.match_model_tensor_name(new_name, key, bid) for key in exps):
                    raise SystemExit(f"{stacked} maps to {new_name}, not a routed-expert tensor")
                if missing := [s for s in scales if s not in self.model_tensors]:
                    raise SystemExit(f"missing {missing[0]} (a packed weight without its scales)")
                loaders = [
                    (self.model_tensors[p], self.model_tensors[s]) for p, s in zip(names, scales)
                ]
                data = self._mxfp4_expert_tensor(loaders)
                qtype = gguf.GGMLQuantizationType.MXFP4
                shape = gguf.quant_shape_from_byte_shape(data.shape, qtype)
                logger.info(
                    f"{new_name}: repacked {n} MXFP4 experts, shape = {{{', '.join(map(str, reversed(shape)))}}}"
                )
                self.gguf_writer.add_tensor(new_name, data, raw_dtype=qtype)
                for name in names + scales:
                    del self.model_tensors[name]

        def prepare_tensors(self):
            super().prepare_tensors()
            if is_mxfp4_packed(self.hparams):
                # label the file as K3's path does; prepare_metadata runs after this
                self._is_mxfp4 = True
                self.ftype = gguf.LlamaFileType.MOSTLY_MXFP4_MOE

    MXFP4Experts.__name__ = MXFP4Experts.__qualname__ = f"MXFP4{model_class.__name__}"
    return MXFP4Experts


def main(argv: list[str]) -> None:
    """``argv``: the converter's directory, then ``convert_hf_to_gguf.py``'s arguments."""
    converter, args = Path(argv[0]).resolve(), argv[1:]
    sys.path[:0] = [str(converter), str(converter / "gguf-py")]
    import convert_hf_to_gguf as cli

    stock = cli.get_model_class

    def get_model_class(name: str, mmproj: bool = False):
        cls = stock(name, mmproj=mmproj)
        return cls if mmproj else with_mxfp4_experts(cls, name)

    # the one place patched: the class the converter's main() instantiates
    cli.get_model_class = get_model_class
    sys.argv = [str(converter / "convert_hf_to_gguf.py"), *args]
    cli.main()


if __name__ == "__main__":
    main(sys.argv[1:])
