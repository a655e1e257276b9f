"""llm-compressor's calibrate-all-experts flag: off for a calibration where REAP is the
only modifier that needs data, put back when it ends; left alone beside another
calibrating modifier."""

from __future__ import annotations

import pytest
from conftest import calibration_samples, make_dataset, save_and_reload
from llmcompressor.modeling.moe.context import get_calibrate_all_experts_flag
from llmcompressor.modifiers import Modifier
from tiny_models import build_tiny

from reap_modifier import REAPPruningModifier
from reap_modifier import modifier as modifier_module


class Probe(Modifier):
    """Records llm-compressor's flag when its own calibration ends (after REAP's: the
    default pipeline runs each modifier's calibration in recipe order)."""

    seen: list = []

    def on_initialize(self, state, **kwargs) -> bool:
        return True

    def on_calibration_end(self, state, event, **kwargs) -> None:
        self.seen.append(get_calibrate_all_experts_flag())


class CalibratingProbe(Probe):
    requires_calibration_data: bool = True


def _run(tmp_path, tokenizer, monkeypatch, probe, **kwargs):
    from llmcompressor import oneshot

    model, _ = build_tiny("qwen3_moe", seed=0)
    model = save_and_reload(model, "qwen3_moe", tmp_path / "m")
    during: list[bool] = []
    checking = []  # inside the wholeness check's forward of the pruned model (not calibration)
    check_whole = modifier_module.check_whole

    def check_whole_marked(*args, **kwargs):
        checking.append(True)
        try:
            return check_whole(*args, **kwargs)
        finally:
            checking.pop()

    monkeypatch.setattr(modifier_module, "check_whole", check_whole_marked)

    def record(*args):
        if not checking:
            during.append(get_calibrate_all_experts_flag())

    model.model.layers[0].mlp.register_forward_hook(record)
    reap = REAPPruningModifier(sparsity=0.5)
    oneshot(
        model=model,
        recipe=[reap, probe],
        processor=tokenizer,
        dataset=make_dataset(calibration_samples(128, n=4, seed=1)),
        num_calibration_samples=4,
        **kwargs,
    )
    return reap, set(during), probe.seen


def test_off_while_reap_calibrates_alone_and_restored(tmp_path, tokenizer, monkeypatch):
    assert get_calibrate_all_experts_flag() is False
    reap, during, after = _run(
        tmp_path, tokenizer, monkeypatch, Probe(seen=[])
    )  # oneshot's default: on
    assert during == {False}
    assert after == [True]  # restored inside oneshot's context
    assert reap.scores.metadata["calibration"]["moe_calibrate_all_experts"] is False
    assert get_calibrate_all_experts_flag() is False


@pytest.mark.parametrize("pipeline", ["independent", "sequential"])
def test_left_on_beside_another_calibrating_modifier(tmp_path, tokenizer, pipeline, monkeypatch):
    reap, during, after = _run(
        tmp_path, tokenizer, monkeypatch, CalibratingProbe(seen=[]), pipeline=pipeline
    )
    if pipeline == "sequential":  # one calibration for both: the user's flag stands
        assert during == {True}
        assert reap.scores.metadata["calibration"]["moe_calibrate_all_experts"] is True
    else:  # oneshot's default pipeline calibrates each modifier on its own
        assert during == {False, True}  # REAP's pass off, the probe's pass on
    assert after == [True]


def test_user_setting_off_is_kept(tmp_path, tokenizer, monkeypatch):
    reap, during, after = _run(
        tmp_path, tokenizer, monkeypatch, Probe(seen=[]), moe_calibrate_all_experts=False
    )
    assert during == {False} and after == [False]
