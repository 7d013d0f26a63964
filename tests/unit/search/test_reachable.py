"""The candidates the plain plan's levers reach from the layout as given (no estimate: the layout rules only)."""

from dataclasses import replace

from megatron_bridge_ext.search.candidates import FULL, Candidate
from megatron_bridge_ext.search.reachable import reachable

DENSE = {"heads": 32, "query_groups": 8, "layers": 36, "seq": 2048, "experts": None, "bias": False}
GIVEN = Candidate(tp=2, pp=1, vpp=None, cp=1, ep=1, etp=2, dp=2, sp=True, micro_batch=4, recompute=(),
                  distributed_optimizer=True)


def test_dense_levers_on_the_same_gpus():
    out = reachable(GIVEN, DENSE, global_batch=8, modules=["core_attn", "mlp"])
    assert {(c.tp, c.pp, c.dp) for c in out} == {(2, 1, 2), (4, 1, 1), (2, 2, 1)}  # TP x 2 or PP x 2 halve DP
    assert {c.micro_batch for c in out} == {1, 2, 4}  # the micro-batch only shrinks: the global batch is kept
    assert {c.recompute for c in out} == {(), ("core_attn",), ("mlp",), ("core_attn", "mlp"), FULL}
    assert all(c.sp for c in out)
    assert len(out) == 3 * 3 * 5


def test_sequence_parallelism_is_a_lever_and_tp_one_has_none():
    given = replace(GIVEN, sp=False, micro_batch=1)
    out = reachable(given, DENSE, global_batch=2, modules=[])
    assert {(c.tp, c.sp) for c in out} == {(2, False), (2, True), (4, False), (4, True)}
    one = replace(given, tp=1, etp=1, dp=4)
    assert {(c.tp, c.sp) for c in reachable(one, DENSE, global_batch=4, modules=[])} == {(1, False), (2, False),
                                                                                      (2, True)}


def test_moe_tp_doubling_comes_with_sequence_parallelism():
    """Megatron Core refuses EP > 1 with TP > 1 without SP: TP x 2 from TP 1 is reached with SP on only."""
    moe = {**DENSE, "experts": 8}
    given = Candidate(tp=1, pp=1, vpp=None, cp=1, ep=2, etp=1, dp=4, sp=False, micro_batch=1, recompute=(),
                      distributed_optimizer=True)
    out = reachable(given, moe, global_batch=4, modules=[])
    assert {(c.tp, c.sp) for c in out} == {(1, False), (2, True)}
    assert {c.ep for c in out} == {2, 4}
    assert {c.etp for c in out} == {1, 2}


def test_the_configs_own_memory_settings_are_kept_in_every_candidate():
    """Megatron-FSDP, bf16 moments, activation offloading and the optimizer offload of the config as given are not
    levers of the plain plan: every reachable candidate keeps them (dropping them would answer with a config the
    user never had, and count their removal as a saving)."""
    given = replace(GIVEN, fsdp="optim_grads", bf16_moments=True, offload=("core_attn",), optimizer_offload=0.5,
                    optimizer_overlap=True)
    out = reachable(given, DENSE, global_batch=8, modules=["core_attn", "mlp"])
    assert out and {(c.fsdp, c.bf16_moments, c.offload, c.optimizer_offload, c.optimizer_overlap) for c in out} == {
        ("optim_grads", True, ("core_attn",), 0.5, True)}
