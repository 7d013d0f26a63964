"""The front is non-dominated and holds every point no other beats; the answer is the fastest fitting point."""

import random
from dataclasses import dataclass

from megatron_bridge_ext.search.front import pareto
from megatron_bridge_ext.search.walk import Search


@dataclass
class P:
    peak_bytes: int
    step_time_s: float
    fits: bool = True
    candidate: object = None


def beats(a, b):
    return a.peak_bytes <= b.peak_bytes and a.step_time_s <= b.step_time_s and (a.peak_bytes, a.step_time_s) != (
        b.peak_bytes, b.step_time_s)


def test_front_is_exactly_the_non_dominated_points():
    rng = random.Random(0)
    points = [P(rng.randrange(100), rng.randrange(100) / 10) for _ in range(300)]
    front = pareto(points)
    assert not any(beats(q, p) for p in front for q in points)
    assert {id(p) for p in points if not any(beats(q, p) for q in points)} <= {id(p) for p in front} | {
        id(p) for p in points if any((q.peak_bytes, q.step_time_s) == (p.peak_bytes, p.step_time_s) and q is not p
                                     for q in points)}


def test_answer_is_fastest_fitting():
    from megatron_bridge_ext.search.candidates import Candidate

    given = Candidate(1, 1, None, 1, 1, 1, 8, False, 1, (), True)
    s = Search(given=given, world=8, global_batch=8, seq=8, usable=50, usable_expandable=50)
    s.evaluated = [P(70, 1.0, False, given), P(40, 2.0, True, given), P(30, 3.0, True, given), P(60, 1.5, False, given)]
    assert s.answer is s.evaluated[1]
    assert not any(p.fits and p.step_time_s < s.answer.step_time_s for p in s.front)


def test_a_search_on_one_gpu_loses_no_candidate_to_an_error():
    """Every candidate the walk estimates on a tiny model yields its figures: none is recorded as failed, and the
    answer (nothing is too big for a terabyte) is one of them, with its FLOPs counted."""
    import math

    from megatron_bridge_ext.estimate import estimate
    from megatron_bridge_ext.levers import steptime
    from megatron_bridge_ext.search import walk
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, tiny_config

    shape = TinyGPTShape(layers=4, hidden=64, ffn=256, heads=4, kv_heads=2, seq=256, micro_batch=1, vocab=128, tp=1,
                         sequence_parallel=False, dtype="bfloat16", swiglu=True)
    cfg = tiny_config(shape, None)
    cfg.data_parallel_size, cfg.train.global_batch_size = 1, 2
    result = walk.search(cfg, estimate(cfg), world=1, usable=1 << 40, usable_expandable=1 << 40, expandable_on=True,
                         gpu=steptime.gpu(), estimate_options={}, budget_s=math.inf)
    assert result.refused == {}
    assert result.counts["estimated"] >= 2 and result.answer in result.evaluated and result.answer.flops > 0


def test_a_candidates_overrides_set_what_apply_sets():
    """The overrides the search prints, given to Bridge's parser on the config as given (full recompute here), set
    the model, train and optimizer fields that ``candidates.apply`` sets: the user's command is the candidate."""
    import copy

    from megatron_bridge_ext.estimate.configs import _with_overrides
    from megatron_bridge_ext.search import candidates as cands
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, tiny_config

    shape = TinyGPTShape(layers=4, hidden=64, ffn=256, heads=4, kv_heads=2, seq=256, micro_batch=1, vocab=128, tp=1,
                         sequence_parallel=False, dtype="bfloat16", swiglu=True)
    cfg = tiny_config(shape, None)
    cfg.model.recompute_granularity, cfg.model.recompute_method, cfg.model.recompute_num_layers = "full", "block", 2
    fields = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
              "context_parallel_size", "sequence_parallel", "recompute_granularity", "recompute_method",
              "recompute_num_layers", "recompute_modules", "num_layers_in_first_pipeline_stage",
              "num_layers_in_last_pipeline_stage")
    for recompute in ((), ("mlp",), cands.FULL):
        c = cands.Candidate(tp=2, pp=2, vpp=None, cp=1, ep=1, etp=1, dp=1, sp=True, micro_batch=2,
                            recompute=recompute, distributed_optimizer=True)
        applied = cands.apply(cfg, c)
        overridden = _with_overrides(copy.deepcopy(cfg), c.overrides(cfg.model.num_layers))  # Bridge's edits in place
        for name in fields:
            assert getattr(overridden.model, name) == getattr(applied.model, name), (recompute, name)
        assert overridden.train.micro_batch_size == applied.train.micro_batch_size
        assert overridden.optimizer.use_distributed_optimizer == applied.optimizer.use_distributed_optimizer


def test_fsdp_and_bf16_moment_overrides_set_what_apply_sets():
    """Each Megatron-FSDP strategy and the precision-aware optimizer's bf16 moments the search proposes, and their
    absence, through Bridge's parser: the same ddp, dist, checkpoint and optimizer fields as ``candidates.apply``."""
    import copy

    from megatron_bridge_ext.estimate.configs import _with_overrides
    from megatron_bridge_ext.levers import fsdp
    from megatron_bridge_ext.search import candidates as cands
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, tiny_config

    shape = TinyGPTShape(layers=4, hidden=64, ffn=256, heads=4, kv_heads=2, seq=256, micro_batch=1, vocab=128, tp=1,
                         sequence_parallel=False, dtype="bfloat16", swiglu=True)
    cfg = tiny_config(shape, None)
    fields = (("ddp", "use_megatron_fsdp"), ("dist", "use_megatron_fsdp"), ("ddp", "data_parallel_sharding_strategy"),
              ("checkpoint", "ckpt_format"), ("optimizer", "use_precision_aware_optimizer"),
              ("optimizer", "exp_avg_dtype"), ("optimizer", "exp_avg_sq_dtype"))
    for name, moments in fsdp.search_options(cands.shape_of(cfg.model), True, 4):
        c = cands.Candidate(tp=1, pp=1, vpp=None, cp=1, ep=1, etp=1, dp=4, sp=False, micro_batch=1, recompute=(),
                            distributed_optimizer=True, fsdp=name, bf16_moments=moments)
        applied = cands.apply(cfg, c)
        overridden = _with_overrides(copy.deepcopy(cfg), c.overrides(cfg.model.num_layers))
        for section, field in fields:
            assert getattr(getattr(overridden, section), field) == getattr(getattr(applied, section), field), \
                (name, moments, section, field)
        assert cands.given(applied, 4) == c


def test_optimizer_offload_overrides_set_what_apply_sets():
    """The optimizer offloaded at each searched fraction, and not, from a config that offloads a quarter of it without
    the overlap: Bridge's parser and ``candidates.apply`` set the same optimizer fields."""
    import copy

    from megatron_bridge_ext.estimate.configs import _with_overrides
    from megatron_bridge_ext.levers import optimizer_offload
    from megatron_bridge_ext.search import candidates as cands
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, tiny_config

    shape = TinyGPTShape(layers=4, hidden=64, ffn=256, heads=4, kv_heads=2, seq=256, micro_batch=1, vocab=128, tp=1,
                         sequence_parallel=False, dtype="bfloat16", swiglu=True)
    cfg = tiny_config(shape, None)
    optimizer_offload.apply(cfg.optimizer, 0.25, False)
    fields = ("optimizer_cpu_offload", "optimizer_offload_fraction", "overlap_cpu_optimizer_d2h_h2d")
    for share in (None, *optimizer_offload.SEARCHED):
        c = cands.Candidate(tp=1, pp=1, vpp=None, cp=1, ep=1, etp=1, dp=4, sp=False, micro_batch=1, recompute=(),
                            distributed_optimizer=True, optimizer_offload=share, optimizer_overlap=share is not None)
        applied = cands.apply(cfg, c)
        overridden = _with_overrides(copy.deepcopy(cfg), c.overrides(cfg.model.num_layers))
        for field in fields:
            assert getattr(overridden.optimizer, field) == getattr(applied.optimizer, field), (share, field)
        assert overridden.optimizer.optimizer_cpu_offload is (share is not None)
        assert cands.given(applied, 4) == c


def test_a_candidate_without_fsdp_from_an_fsdp_config_undoes_its_checkpoint_format():
    """From a config on Megatron-FSDP (so on fsdp_dtensor checkpoints, which Bridge requires with it), a candidate
    without it goes back to Megatron's default format, which Bridge takes without FSDP (training/config.py
    L1389-1394), through both its overrides and ``candidates.apply``; a config that never had FSDP keeps its own."""
    import copy

    from megatron_bridge_ext.estimate.configs import _with_overrides
    from megatron_bridge_ext.levers import fsdp
    from megatron_bridge_ext.search import candidates as cands
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, tiny_config

    shape = TinyGPTShape(layers=4, hidden=64, ffn=256, heads=4, kv_heads=2, seq=256, micro_batch=1, vocab=128, tp=1,
                         sequence_parallel=False, dtype="bfloat16", swiglu=True)
    plain = tiny_config(shape, None)
    plain.checkpoint.ckpt_format = "torch_dcp"
    on_fsdp = copy.deepcopy(plain)
    fsdp.apply(on_fsdp, "optim_grads", False)
    ddp = cands.Candidate(tp=1, pp=1, vpp=None, cp=1, ep=1, etp=1, dp=4, sp=False, micro_batch=1, recompute=(),
                          distributed_optimizer=True)
    for cfg, expected in ((on_fsdp, "torch_dist"), (plain, "torch_dcp")):
        given = cands.given(cfg, 4)
        overridden = _with_overrides(copy.deepcopy(cfg), ddp.overrides(cfg.model.num_layers, given))
        assert overridden.checkpoint.ckpt_format == cands.apply(cfg, ddp).checkpoint.ckpt_format == expected
        assert overridden.ddp.use_megatron_fsdp is False
