"""Each rule of layout_findings refuses a layout Megatron Core (or Bridge) refuses, and a legal layout passes."""

import pytest

from megatron_bridge_ext.levers.parallelism.constraints import layout_findings

DENSE = {"heads": 64, "query_groups": 8, "layers": 80, "seq": 4096, "experts": None, "bias": False}
MOE = {"heads": 32, "query_groups": 4, "layers": 48, "seq": 4096, "experts": 128, "bias": False}
LEGAL = dict(world=32, global_batch=32, tp=4, pp=2, vpp=None, cp=1, ep=1, etp=4, dp=4, sp=True, micro_batch=1)


def settings(findings):
    return [f.setting for f in findings]


def test_legal_layout_passes():
    assert layout_findings(DENSE, **LEGAL) == []


@pytest.mark.parametrize("change, setting", [
    # parallel_state.py L822: world_size % (TP x PP x CP) != 0
    (dict(dp=2), "--gpus"),
    # transformer_config.py L1338-1345: 6 query groups, TP 4 neither divides them nor is a multiple of them
    (dict(query_groups=6), "model.tensor_model_parallel_size"),
    # transformer_block.py L150-152: 81 layers over PP 2 (no uneven split with two stages)
    (dict(layers=81), "model.pipeline_model_parallel_size"),
    # transformer_block.py L169-172: 40 layers a stage over VPP 3
    (dict(vpp=3), "model.virtual_pipeline_model_parallel_size"),
    # Bridge training/config.py L1436: seq % (2 x CP)
    (dict(cp=4, dp=1), None),
    # model_parallel_config.py L502-504: SP without TP
    (dict(tp=1, etp=1, dp=16, sp=True), "model.sequence_parallel"),
    # num_microbatches_calculator.py L381-387: global batch % (mb x DP)
    (dict(micro_batch=16), "train.micro_batch_size"),
    # schedules.py L1133-1152: interleaving with 2 microbatches, groups of PP=4
    (dict(pp=4, vpp=2, dp=2, micro_batch=8), "train.global_batch_size"),
])
def test_rule_refuses(change, setting):
    shape = dict(DENSE, seq=4100) if change.get("cp") else dict(DENSE)
    for field in ("layers", "query_groups"):
        shape[field] = change.pop(field, shape[field])
    found = settings(layout_findings(shape, **{**LEGAL, **change}))
    assert (setting or "model.context_parallel_size") in found


def test_expert_rules():
    legal = dict(LEGAL, world=16, tp=2, pp=1, dp=8, ep=8, etp=1)
    assert layout_findings(MOE, **legal) == []
    # moe_layer.py L185: num_moe_experts % EP
    assert "model.expert_model_parallel_size" in settings(layout_findings(dict(MOE, experts=12), **legal))
    # moe_layer.py L629-633: TP without SP, with or without expert parallelism
    for ep, etp, dp in ((8, 1, 8), (1, 2, 8)):
        found = settings(layout_findings(MOE, **dict(legal, sp=False, ep=ep, etp=etp, dp=dp)))
        assert "model.sequence_parallel" in found, (ep, etp)


def _core_accepts(heads: int, groups: int, tp: int) -> bool:
    """Whether Megatron Core's own TransformerConfig takes these heads, query groups and TP."""
    import warnings

    from megatron.core.transformer.transformer_config import TransformerConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            TransformerConfig(num_layers=2, hidden_size=heads * 8, num_attention_heads=heads, num_query_groups=groups,
                              tensor_model_parallel_size=tp, sequence_parallel=tp > 1)
        except ValueError:
            return False
    return True


@pytest.mark.parametrize("heads, groups, tp", [
    (64, 8, 4), (64, 8, 8), (64, 8, 16), (64, 8, 32), (32, 4, 8), (32, 2, 8), (64, 6, 4), (48, 12, 8), (8, 8, 3),
    (40, 8, 4), (40, 8, 16), (56, 8, 8)])
def test_the_search_and_the_estimate_take_the_heads_and_query_groups_core_takes(heads, groups, tp):
    """One rule for both: the search's layout filter and the estimate's layout check refuse exactly the TP sizes that
    Core's TransformerConfig refuses (TP a multiple of the query groups is legal: each rank holds one KV head)."""
    from megatron_bridge_ext.levers.parallelism.constraints import query_group_problem

    accepted = _core_accepts(heads, groups, tp)
    assert (query_group_problem(heads, groups, tp) is None) == accepted
    shape = dict(DENSE, heads=heads, query_groups=groups)
    found = settings(layout_findings(shape, **dict(LEGAL, world=tp * 2 * 4, tp=tp, etp=tp)))
    assert ("model.tensor_model_parallel_size" not in found) == accepted


def test_an_uneven_split_keeps_the_middle_stages_whole():
    """transformer_config.py L2043-2047: the middle layers divide over the middle stages."""
    from megatron_bridge_ext.levers.parallelism.constraints import uneven_split

    first, last = uneven_split(126, 8)
    assert (126 - first - last) % 6 == 0 and first + last + 6 * ((126 - first - last) // 6) == 126
    assert uneven_split(80, 8) is None and uneven_split(7, 2) is None
    legal = dict(LEGAL, world=1024, tp=8, pp=8, dp=16, global_batch=1024)
    assert layout_findings(dict(DENSE, layers=126), **legal) == []
    assert "model.pipeline_model_parallel_size" in settings(layout_findings(dict(DENSE, layers=126),
                                                                            **dict(legal, vpp=2)))
