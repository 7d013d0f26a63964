"""Step 4 of the plan on a mixture-of-experts config (``megatron_bridge_ext/levers/parallelism/advice.py``): the
EP and ETP options, in their place in the order, refused by Core's expert rules, and priced by the traffic
formulas whether or not the estimate can predict their peak.

The estimate is a stand-in here (a canned peak, or the estimate's refusal), so these tests are about option
construction; the planner test on a real MoE estimate is in ``tests/unit/test_planner.py``.
"""

from __future__ import annotations

import pytest

from megatron_bridge_ext.estimate.memory import NotModelled
from megatron_bridge_ext.estimate.report import STATIC, Component, MemoryEstimate
from megatron_bridge_ext.estimate.settings import Settings
from megatron_bridge_ext.findings import ERROR, Finding
from megatron_bridge_ext.levers.parallelism import advice, cost
from megatron_bridge_ext.levers.step import State
from megatron_bridge_ext.planner import Planner
from tests.support.settings import gpt_stage

pytestmark = [pytest.mark.unit]

PEAK = 10 * 2**30


def _cfg(*, experts=4, ep=1, etp=None, tp=2, dp=2, moe_ffn=64, dispatcher="alltoall", **fields):
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, tiny_config

    shape = TinyGPTShape(layers=4, hidden=64, ffn=256, heads=8, kv_heads=4, seq=256, micro_batch=2, vocab=128, tp=tp,
                         dtype="bfloat16", swiglu=True, experts=experts, topk=2, moe_ffn=moe_ffn,
                         dispatcher=dispatcher, ep=ep, etp=etp or 1)
    cfg = tiny_config(shape, None, **fields)
    cfg.model.expert_tensor_parallel_size = etp  # None: left to Bridge's default, as a recipe may leave it
    cfg.data_parallel_size = dp
    return cfg


def _settings(cfg, dp: int) -> Settings:
    m = cfg.model
    return gpt_stage(tp=m.tensor_model_parallel_size, pp=m.pipeline_model_parallel_size, vpp=None, cp=1, dp=dp,
                     sequence_parallel=bool(m.sequence_parallel), seq_length=m.seq_length,
                     micro_batch=cfg.train.micro_batch_size, num_microbatches=2, dtype="bfloat16", stage=0,
                     layers_on_stage=m.num_layers, hidden=m.hidden_size, ffn=m.ffn_hidden_size,
                     heads=m.num_attention_heads, query_groups=m.num_query_groups, kv_channels=m.kv_channels,
                     num_layers=m.num_layers, gated_linear_unit=True, vocab_size=128, recompute_granularity=None,
                     recompute_modules=(), attention="local", transformer_impl="local", peft=None)


def _estimate(cfg, dp: int, peak: int = PEAK) -> MemoryEstimate:
    return MemoryEstimate(stage=0, components=[Component(STATIC, "weights", peak, "stand-in")],
                          settings=_settings(cfg, dp), assumptions=[], activations_per_microbatch={},
                          in_flight_microbatches=1.0)


class _Planner(Planner):
    """The planner with the estimate replaced: ``peaks(cfg)`` gives the peak of a config, or raises."""

    def __init__(self, cfg, peaks, gpu_memory=PEAK):
        super().__init__(gpu_memory=gpu_memory, margin=0.0, expandable_margin=0.0, expandable_segments=True,
                         estimate_options={}, cfg=cfg, peft_overrides=None)
        self.peaks, self.estimated = peaks, []

    def estimate(self, cfg, **overrides):
        self.estimated.append(cfg)
        return _estimate(cfg, overrides.get("data_parallel_size", cfg.data_parallel_size), self.peaks(cfg))


def _refuse(cfg):
    raise NotModelled("memory estimate", [Finding("unsupported_model", ERROR, "model.num_moe_experts",
                                                  "mixture-of-experts models are not modelled by the estimate",
                                                  "use Bridge's estimate_training_memory")])


def _step4(cfg, peaks, dp=2):
    planner = _Planner(cfg, peaks)
    end = advice.resize(planner, State(cfg, _estimate(cfg, dp)))
    return planner, end, {o.label.split(" ")[0]: o for o in planner.options}


def test_the_order_is_ep_pp_etp_tp_and_a_dense_model_gets_no_expert_option():
    _, _, moe_options = _step4(_cfg(ep=2, etp=1, dp=4), lambda cfg: PEAK + 1)
    assert list(moe_options) == ["EP", "PP", "ETP", "TP"]
    _, _, dense = _step4(_cfg(experts=0), lambda cfg: PEAK + 1)
    assert list(dense) == ["PP", "TP"]


def test_ep_option_keeps_dp_and_is_priced_without_a_peak_when_the_estimate_refuses():
    cfg = _cfg(ep=2, etp=1, dp=4)  # 8 GPUs per stage: EP 4 x ETP 1 fits
    planner, end, by_name = _step4(cfg, _refuse, dp=4)
    ep = by_name["EP"]
    assert ep.label == "EP 2 -> 4, expert DP 4 -> 2"
    assert not ep.applicable and ep.peak_bytes is None
    assert ep.reason.startswith("no predicted peak: model.num_moe_experts: mixture-of-experts models are not modelled")
    s = _settings(cfg, 4)
    moe = cost.moe_shape(cfg.model)
    element, layers, nmb = 2, 4, s.num_microbatches
    tokens = 256 // 2 * 2  # sequence shard x micro-batch
    # dispatch and combine, forward and backward: 1/2 of the token copies leave the rank at EP 2, 3/4 at EP 4
    dispatch = 4 * tokens * 2 * 64 * element * (3 * layers * nmb) // 4 - 4 * tokens * 2 * 64 * element * layers * nmb // 2
    params_at_ep2 = layers * (4 // 2) * (64 * 64 * 2 + 64 * 64)  # 2 experts per rank, SwiGLU fc1 + fc2
    assert ep.cost.collective_bytes == dispatch - params_at_ep2 * element  # expert-DP traffic: P*e less
    assert moe["ep"] == 2 and cfg.model.expert_model_parallel_size == 2  # the config itself is left alone
    assert end.cfg is cfg


def test_ep_option_fits_with_its_overrides_and_keeps_an_unset_etp():
    """ETP unset: TP's 2 at EP 1, but Bridge's default drops it to 1 at EP 2, which would leave each rank E/2
    whole experts, as many weights as E experts at half width: EP 1 -> 2 pins ETP at 2 to halve them."""
    cfg = _cfg(ep=1, etp=None, dp=2)
    planner, end, by_name = _step4(cfg, lambda c: PEAK // 2 if c.model.expert_model_parallel_size == 2 else PEAK + 1)
    ep = by_name["EP"]
    assert ep.label == "EP 1 -> 2, expert DP 2 -> 1 (ETP kept at 2)"
    assert ep.fits and list(by_name) == ["EP"]  # the first that fits ends the step
    assert ep.overrides == ["model.expert_model_parallel_size=2", "model.expert_tensor_parallel_size=2"]
    assert (end.cfg.model.expert_model_parallel_size, end.cfg.model.expert_tensor_parallel_size) == (2, 2)
    assert end.cfg.data_parallel_size == 2 and cfg.model.expert_tensor_parallel_size is None


@pytest.mark.parametrize("cfg_kwargs, dp, setting, words", [
    (dict(experts=6, ep=2, etp=1), 4, "model.expert_model_parallel_size", "EP=4 does not divide the 6 experts"),
    (dict(experts=8, ep=2, etp=1), 1, "data parallel size", "is not a multiple of ETP x EP = 1 x 4"),
], ids=["ep-not-dividing-experts", "expert-grid-beyond-the-gpus"])
def test_ep_refused_by_cores_rules(cfg_kwargs, dp, setting, words):
    planner, _, by_name = _step4(_cfg(dp=dp, **cfg_kwargs), lambda cfg: PEAK + 1, dp=dp)
    ep = by_name["EP"]
    assert not ep.applicable and ep.peak_bytes is None
    assert ep.constraints[0].setting == setting and words in ep.constraints[0].message
    assert all(c.model.expert_model_parallel_size != 2 * cfg_kwargs["ep"] for c in planner.estimated)  # not estimated


@pytest.mark.parametrize("cfg_kwargs, words", [
    (dict(ep=1, etp=4, tp=4, dp=2, moe_ffn=36), "ETP=8 does not divide the experts' FFN width 36"),
    (dict(ep=1, etp=8, tp=8, dp=2, moe_ffn=64), "ETP=16 spans more than one 8-GPU NVLink node"),
    (dict(ep=2, etp=1, dp=2, add_bias_linear=True), "Megatron Core supports MoE bias only with ETP=1"),
], ids=["ffn", "beyond-node", "bias"])
def test_etp_refusals(cfg_kwargs, words):
    if cfg_kwargs.get("tp", 2) > 2:  # heads and groups must divide by TP: widen them for the wide layouts
        cfg_kwargs = dict(cfg_kwargs, num_attention_heads=16, num_query_groups=8)
    _, _, by_name = _step4(_cfg(**cfg_kwargs), lambda cfg: PEAK + 1, dp=cfg_kwargs["dp"])
    etp = by_name["ETP"]
    assert not etp.applicable and any(words in c.message for c in etp.constraints), etp.constraints


def test_pp_halving_dp_must_keep_a_whole_expert_grid():
    """EP 4 on TP 2 x DP 2: PP x 2 leaves DP 1, 2 GPUs per stage for a grid of 4; TP x 2 keeps 4 GPUs."""
    _, _, by_name = _step4(_cfg(ep=4, etp=1, dp=2), lambda cfg: PEAK + 1)
    assert by_name["PP"].constraints[0].setting == "data parallel size"
    assert "ETP x EP = 1 x 4" in by_name["PP"].constraints[0].message
    assert by_name["TP"].applicable


def test_offloading_moves_every_activation_saved_inside_the_layers_of_an_moe_model():
    """What offloading moves is what the layers save: the categories it lowers cover the bytes the estimate measured
    inside the transformer layers (``activations_per_layer``), the experts' and the dispatcher's included (their
    norms and attention lines also hold the final norm's and the rotary table's saves, made outside the layers)."""
    from megatron_bridge_ext.estimate import estimate
    from megatron_bridge_ext.levers.step import breakdown

    cfg = _cfg(ep=1)
    est = estimate(cfg, data_parallel_size=2, num_microbatches=1)
    assert est.in_flight_microbatches == 1 and est.settings.transformer_impl == "local"  # no contract lines
    planner = Planner(gpu_memory=PEAK, margin=0.0, expandable_margin=0.0, expandable_segments=True,
                      estimate_options={}, cfg=cfg, peft_overrides=None)
    advice.offload(planner, State(cfg, est))
    [option] = [o for o in planner.options if "layers" in o.label]  # beside it: the optimizer offloaded
    before = breakdown(est)
    moved = [k for k, v in option.breakdown.items() if v < before[k]]
    assert {"activations: experts", "activations: moe dispatch"} <= set(moved)
    assert sum(before[k] for k in moved) >= sum(est.activations_per_layer.values())


@pytest.mark.parametrize("dp, expected", [(1, "PP 1 -> 2, needs 2x the GPUs (DP 1 cannot be halved)"),
                                          (3, "PP 1 -> 2, needs 2x the GPUs (DP 3 cannot be halved)"),
                                          (4, "PP 1 -> 2, DP 4 -> 2")])
def test_a_doubling_on_an_odd_dp_says_it_needs_twice_the_gpus(dp, expected):
    """TP and PP double on the same GPUs by halving DP; an odd DP cannot be halved, and the label says what the
    option would take instead of a DP that does not change."""
    resize = advice.Resize("PP", "pipeline_model_parallel_size", 1, True, figure=None)
    assert advice._label(resize, gpt_stage(dp=dp), None, None) == expected
