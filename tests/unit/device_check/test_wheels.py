"""The carried wheel list: the pinned lines of requirements/device.txt, the Megatron pair the tests run on."""

from __future__ import annotations

from pathlib import Path

from megatron_bridge_ext.device_check import wheels

ROOT = Path(__file__).resolve().parents[3]


def _pins(name: str) -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements" / name).read_text().splitlines():
        package, sep, version = line.split("#")[0].strip().partition("==")
        if sep:
            pins[package.lower().replace("_", "-")] = version
    return pins


def test_the_carried_megatron_pair_is_the_tested_one():
    device, bridge = _pins("device.txt"), _pins("bridge-0.6.2.txt")
    for package in ("megatron-core", "megatron-bridge", "transformers"):
        assert device[package] == bridge[package], package
    common = _pins("common.txt")
    for package in ("numpy", "einops", "pyyaml", "packaging", "omegaconf", "safetensors", "tqdm", "rich", "pytest",
                    "hypothesis"):
        assert device[package] == common[package], package


def test_the_wheel_list_is_the_pinned_lines_without_comments():
    pinned = wheels.pins(ROOT / "requirements" / "device.txt")
    assert {pin.split("==")[0].lower().replace("_", "-") for pin in pinned} == set(_pins("device.txt"))
    assert f"{wheels.SDIST_ONLY}=={_pins('device.txt')[wheels.SDIST_ONLY]}" in pinned
