"""Which compute dtype vLLM can serve a checkpoint in: one rule, for ``reap verify --vllm`` and
``reap eval --backend vllm``.

vLLM 0.32's CPU platform (``CpuPlatform.get_attn_backend_cls`` and ``check_and_update_config``
in ``vllm/platforms/cpu.py``) runs MLA attention with its AMX backend ``AMX_MLA`` whenever the
CPU is x86 with AMX tiles (``torch.cpu._is_amx_tile_supported()``) and ``--attention-backend
CPU_MLA`` was not asked for. ``AMX_MLA`` runs bfloat16 only (``supported_dtypes = [bfloat16]``):
float32 weights stop the server at start-up ("expect weight to be bfloat16, float16, int8,
fp8_e4m3 or uint8"). The reference backend ``CPU_MLA``, chosen on every other CPU or when
asked, runs any dtype. A model uses MLA in vLLM when its text config states ``kv_lora_rank``
(DeepSeek-V2/V3, Kimi K2/K3, GLM-4.7-Flash, ...), it is causal, and ``VLLM_MLA_DISABLE`` is off
(``ModelConfig.use_mla``).

Whether the vLLM Python is that CPU platform on such a CPU is asked of it once, with its
version (:attr:`~reap_modifier.serving.vllm_check.VllmInfo.cpu_amx`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..models.moe_fields import config_sections

__all__ = ["DtypeRefused", "ServedDtype", "amx_mla_serves", "served_dtype", "uses_mla"]

#: what vLLM's AMX MLA attention computes in
AMX_MLA_DTYPE = "bfloat16"


class DtypeRefused(ValueError):
    """The dtype asked for cannot be served (a usage error: exit code 2); the message names the
    dtype to pass and why."""


@dataclass(frozen=True)
class ServedDtype:
    """The dtype to serve (and compare) in; ``reason`` is one line when it is not the one asked."""

    dtype: str
    reason: str | None = None


def uses_mla(config: Mapping) -> bool:
    """Whether vLLM runs this model (a ``config.json`` as a dict) with MLA attention: its text
    config states ``kv_lora_rank`` and the model is causal."""
    for _, holder in config_sections(config):
        if holder.get("kv_lora_rank") is not None:
            return holder.get("is_causal", True) is not False
    return False


def _asks_cpu_mla(server_args: Sequence[str]) -> bool:
    """``--attention-backend CPU_MLA`` (or ``=CPU_MLA``, any case) among the server arguments."""
    args = list(server_args)
    for i, arg in enumerate(args):
        name, sep, value = arg.partition("=")
        if name != "--attention-backend":
            continue
        if not sep:
            value = args[i + 1] if i + 1 < len(args) else ""
        if value.upper() == "CPU_MLA":
            return True
    return False


def amx_mla_serves(
    config: Mapping,
    *,
    cpu_amx: bool,
    server_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> bool:
    """Whether vLLM will run this model's attention with ``AMX_MLA`` (bfloat16 only).

    :param cpu_amx: the vLLM Python runs vLLM's CPU platform on an x86 CPU with AMX tiles
    :param env: the server's environment (default: this process's), for ``VLLM_MLA_DISABLE``
    """
    env = os.environ if env is None else env
    mla_disabled = env.get("VLLM_MLA_DISABLE", "0").strip() not in ("", "0")
    return cpu_amx and uses_mla(config) and not mla_disabled and not _asks_cpu_mla(server_args)


def served_dtype(
    requested: str,
    config: Mapping,
    *,
    cpu_amx: bool,
    server_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    dtype_flag: str = "--vllm-dtype",
    arg_flag: str = "--vllm-arg",
) -> ServedDtype:
    """The dtype vLLM can serve ``config``'s model in, given the dtype the user asked for.

    ``auto`` becomes bfloat16 where :func:`amx_mla_serves` (``reason`` says why); any other dtype
    than bfloat16 there raises :class:`DtypeRefused` naming ``dtype_flag bfloat16``; everywhere
    else the request stands.
    """
    if not amx_mla_serves(config, cpu_amx=cpu_amx, server_args=server_args, env=env):
        return ServedDtype(requested)
    why = (
        "vLLM's CPU backend runs this MLA model (kv_lora_rank) on this AMX CPU with its AMX_MLA "
        "attention, which computes in bfloat16 only"
    )
    if requested == AMX_MLA_DTYPE:
        return ServedDtype(requested)
    if requested == "auto":
        return ServedDtype(AMX_MLA_DTYPE, f"dtype bfloat16 for {dtype_flag} auto: {why}")
    raise DtypeRefused(
        f"{dtype_flag} {requested} cannot be served: {why}; pass {dtype_flag} bfloat16 "
        f"(or {arg_flag}=--attention-backend=CPU_MLA for vLLM's slower reference MLA attention, "
        f"which computes in {requested})"
    )
