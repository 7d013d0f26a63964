"""Context parallelism in the estimate: what the attention stand-in saves for each of Transformer Engine's CP kernels
(counted from the shapes), a rank traced on its s / CP tokens, the optimizer over DP x CP, the exchange buffers, the
rotary chunks of a rank, and the layouts and variants refused by name.

The tiny model: h 64, 4 heads, 2 query groups (head width 16), ffn 128, sequence 32, micro-batch 2, fp32."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_bridge_ext.estimate.features import context_parallel as cp_feature

pytestmark = [pytest.mark.unit]

SEQ, BATCH, HEADS, GROUPS, WIDTH, E = 32, 2, 4, 2, 16, 4
COMMS = ("p2p", "all_gather", "a2a", "a2a+p2p")


def _saved_by_attention(comm: str, *, cp: int = 2, v_width: int = WIDTH):
    """The storages the stand-in saves for ``comm`` on fake q, k, v of a rank's [SEQ, BATCH, heads, width], and
    whether the output it returns is one of them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    kernel = cp_feature.Kernel(comm, cp, {"a2a": cp, "a2a+p2p": 2}.get(comm, 1))
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        saved[storage._cdata] = storage.nbytes()
        return tensor

    with FakeTensorMode():
        q = torch.empty(SEQ, BATCH, HEADS, WIDTH, requires_grad=True)
        k = torch.empty(SEQ, BATCH, GROUPS, WIDTH, requires_grad=True)
        v = torch.empty(SEQ, BATCH, GROUPS, v_width, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = cp_feature.attention(q, k, v, kernel)
    assert out.shape == (SEQ, BATCH, HEADS * v_width)
    return saved, out.untyped_storage()._cdata in saved


@pytest.mark.parametrize("comm", COMMS)
def test_the_stand_in_saves_what_each_cp_kernel_saves(comm):
    """Every kernel keeps q, k and v's worth (p2p and a2a+p2p as one ring buffer of k and v), the output and the fp32
    log-sum-exp of the rank's queries; the all-to-all kernels save the output before its exchange back, a tensor
    apart from the one they return."""
    saved, returns_a_saved_output = _saved_by_attention(comm)
    q, kv = SEQ * BATCH * HEADS * WIDTH * E, SEQ * BATCH * GROUPS * 2 * WIDTH * E
    out, lse = SEQ * BATCH * HEADS * WIDTH * E, BATCH * HEADS * SEQ * 4
    assert sum(saved.values()) == q + kv + out + lse
    assert len(saved) == {"p2p": 4, "all_gather": 6, "a2a": 5, "a2a+p2p": 4}[comm]
    assert returns_a_saved_output == (comm in ("p2p", "all_gather"))


def test_the_output_has_the_values_width_per_head():
    """Multi-latent attention's values are narrower than its keys: the saved output has their width."""
    saved, _ = _saved_by_attention("p2p", v_width=12)
    q, kv = SEQ * BATCH * HEADS * WIDTH * E, SEQ * BATCH * GROUPS * (WIDTH + 12) * E
    assert sum(saved.values()) == q + kv + SEQ * BATCH * HEADS * 12 * E + BATCH * HEADS * SEQ * 4


def _shape(**fields):
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape

    return TinyGPTShape(**{**dict(tp=1, sequence_parallel=False, heads=HEADS, kv_heads=GROUPS, seq=SEQ,
                                  micro_batch=BATCH, dtype="float32"), **fields})


def _estimate(shape, **overrides):
    from megatron_bridge_ext.estimate import estimate
    from megatron_bridge_ext.testing.tiny_model import tiny_config

    return estimate(tiny_config(shape, None, **overrides), attention="fused", transformer_impl="local", device="cpu",
                    data_parallel_size=1)


@pytest.fixture(scope="module")
def half_sequence():
    """The tiny model without CP on half the sequence: what a CP=2 rank's layers run on."""
    return _estimate(_shape(seq=SEQ // 2))


@pytest.mark.parametrize("comm", COMMS)
def test_a_rank_traces_its_share_of_the_sequence(comm, half_sequence):
    """A CP=2 rank's layers save what the model saves on s / 2 tokens, plus, for the all-to-all kernels, the output
    they keep apart from the one the output projection keeps ([s/2, b, heads x width] per layer)."""
    sizes = dict(hierarchical_context_parallel_sizes=[2, 1]) if comm == "a2a+p2p" else {}
    est = _estimate(_shape(), context_parallel_size=2, cp_comm_type=comm, **sizes)
    apart = SEQ // 2 * BATCH * HEADS * WIDTH * E if comm in ("a2a", "a2a+p2p") else 0
    assert est.settings.cp == 2
    assert est.activations_per_layer == {layer: nbytes + apart
                                         for layer, nbytes in half_sequence.activations_per_layer.items()}
    assert any(line.startswith("context parallelism: CP=2") for line in est.assumptions)


def test_the_optimizer_is_sharded_over_dp_times_cp_and_the_gradients_are_not():
    """The distributed optimizer's states over DP x CP ranks; the gradient buffer whole on every rank (fp32: two fp32
    moments per parameter, no main copy; every parameter trains)."""
    est = _estimate(_shape(), context_parallel_size=2)
    assert est.settings.distributed_optimizer
    line = {c.name: c.bytes for c in est.components}
    trainable = sum(nbytes for name, nbytes in line.items() if name.startswith("weights: ")) // E
    assert line["optimizer states"] == -(-trainable * 8 // 2)
    assert line["gradients (main_grad buffer)"] == trainable * E


def test_the_exchange_buffers_follow_the_kernels_sources():
    """p2p with CP 4: the larger of the forward's three more k + v buffers and four steps' outputs and fp32
    log-sum-exp, and the backward's dq buffer and two [2, k + v] buffers; all-gather: three full-sequence k + v
    copies in backward; a2a: its send copies of q, k, v and the output."""
    size = cp_feature.Shapes(seq=1024, micro_batch=1, heads=8, groups=2, qk_width=128, v_width=128, element=2)
    q, kv, out, lse = 1024 * 8 * 128 * 2, 1024 * 2 * 256 * 2, 1024 * 8 * 128 * 2, 1024 * 8 * 4
    assert cp_feature.exchange_bytes(cp_feature.Kernel("p2p", 4), size)[0] == max(3 * kv + 4 * (out + lse),
                                                                                  q + 4 * kv)
    assert cp_feature.exchange_bytes(cp_feature.Kernel("all_gather", 4), size)[0] == 3 * 4 * kv
    assert cp_feature.exchange_bytes(cp_feature.Kernel("a2a", 4, 4), size)[0] == q + kv + out
    ring_of_two = max(kv + 2 * (out + lse), q + 4 * kv)
    assert cp_feature.exchange_bytes(cp_feature.Kernel("a2a+p2p", 4, 2), size)[0] == ring_of_two + q + kv + out


def test_the_estimate_lists_the_exchange_among_the_transients():
    """With a sequence long enough that the exchange outweighs a layer's MLP gradients, it is the transient."""
    est = _estimate(_shape(seq=512, ffn=16), context_parallel_size=2, cp_comm_type="all_gather")
    transient = [c for c in est.components if c.kind == "transient" and c.name == "layer backward"]
    kv = 512 // 2 * BATCH * GROUPS * 2 * WIDTH * E
    assert [c.bytes for c in transient] == [3 * 2 * kv]
    assert "context-parallel attention" in transient[0].basis


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_a_rank_takes_its_two_rotary_chunks(rank):
    """Chunks r and 2 CP - 1 - r of the frequencies, as Core's data split gives rank r its tokens."""
    from megatron.core.models.common.embeddings import rope_utils

    emb = torch.arange(12.0).view(12, 1, 1, 1)
    group = SimpleNamespace(size=lambda: 3, rank=lambda: rank)
    original = rope_utils.get_pos_emb_on_this_cp_rank
    with cp_feature.rope_chunks_on_the_traced_device():
        picked = rope_utils.get_pos_emb_on_this_cp_rank(emb, 0, group)
    assert rope_utils.get_pos_emb_on_this_cp_rank is original
    other = 5 - rank
    assert picked.flatten().tolist() == [2 * rank, 2 * rank + 1, 2 * other, 2 * other + 1]


def _model(**fields):
    base = dict(context_parallel_size=2, cp_comm_type=None, num_layers=2, seq_length=32, tensor_model_parallel_size=1,
                num_attention_heads=4, num_query_groups=2, hierarchical_context_parallel_sizes=None)
    return SimpleNamespace(**{**base, **fields})


def test_without_cp_nothing_is_refused():
    model = _model(context_parallel_size=1, seq_length=31, cp_comm_type="ring")
    assert cp_feature.findings(model) == cp_feature.layout_findings(model) == []
    assert cp_feature.trace_findings(model, attention="local", fused="fused") == []


@pytest.mark.parametrize("fields, setting", [
    (dict(seq_length=34), "model.seq_length"),
    (dict(cp_comm_type="a2a", num_query_groups=1), "model.cp_comm_type"),
    (dict(context_parallel_size=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[4, 1]),
     "model.cp_comm_type"),
])
def test_layouts_the_split_or_the_all_to_all_cannot_take_are_refused(fields, setting):
    """A sequence of 2 x CP chunks; heads and query groups of a TP rank that each all-to-all divides."""
    assert [f.setting for f in cp_feature.layout_findings(_model(**fields))] == [setting]


def test_variants_not_modelled_are_named():
    assert [f.setting for f in cp_feature.findings(_model(cp_comm_type="ring"))] == ["model.cp_comm_type"]
    assert cp_feature.findings(_model(hybrid_layer_pattern="M*")) == []  # Mamba layers under CP are traced
    assert [f.setting for f in cp_feature.trace_findings(_model(), attention="local", fused="fused")] == ["attention"]
    assert cp_feature.findings(_model(cp_comm_type=["p2p", "allgather"])) == []
