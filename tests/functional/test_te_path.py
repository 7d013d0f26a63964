"""The Transformer Engine path under sequence parallelism (TP=2), against a dense float64 reference.

The base layer is ``tests.support.fake_te.FakeTELayerNormColumnParallelLinear``, which follows
TE's ``LayerNormLinear`` source at both of its contracts for the returned LayerNorm output:
``te<=2.3`` (backward adds the gradient of a gathered returned norm output) and ``te>=2.4``
(it drops it). Bridge's real adapter code wraps it, made to see the fake as TE's class and the
contract's TE version as the installed one. Every run is compared with a dense single-process
float64 computation of the same function (LayerNorm, frozen base GEMM, LoRA), not with Bridge.

Expected: with the ``te>=2.4`` contract Bridge's LoRA as shipped loses the LoRA branch's input
gradient (the input and norm-weight grads differ from the reference; LoRA-B is non-zero so the
difference is real); with the ``bridge_lora_te_norm_grad`` patch, with our strategies, and with our
LoRA left off (which applies the patch), everything matches; with ``te<=2.3`` everything matches.
Saved bytes: under TE the LoRA-A strategies save s*b*h*bytes per adapter against Bridge (TE keeps
its own norm-output shard, which our LoRA-A shares), not s*b*h*bytes*(1-1/t) as on the local spec;
under FP8 TE keeps a quantised copy instead, which ours cannot share: s*b*h*bytes*(1-1/t) again.

Also: ``megatron_bridge_ext.init()`` fixes Bridge's own LoRA (Bridge imported before init(), and in a
fresh 2-rank run after it); the run-time check warns once without the fix and not with it; FP8 and
Userbuffers (``ub_overlap_rs_dgrad`` fixed, ``ub_bulk_wgrad`` with a frozen base refused by name).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

from megatron_bridge_ext.patches import bridge_lora_te_norm_grad
from megatron_bridge_ext.levers.lora_input import te_check
from tests.support.dist_checks import assert_no_problems, local_rel_err
from tests.support.fake_te import CONTRACTS, TE_GE_2_4, FakeTELayerNormColumnParallelLinear, see_fake_te
from tests.support.lora_blocks import B, H, KINDS, OUT, S, TP, _parallel_config, _rank_slice

pytestmark = [pytest.mark.functional, pytest.mark.filterwarnings("ignore:.*torch\\.distributed.*:FutureWarning")]

F64_REL_TOL = 1e-12
_VARIANT = {"bridge": "baseline", "bridge_patched": "baseline", "off": "off", "regather": "regather",
            "shard_local": "shard_local"}


def _see_fake_te(monkeypatch, contract: str) -> None:
    """Bridge sees the fake as TE's LayerNorm-linear, and the contract's TE version as installed."""
    see_fake_te(contract, monkeypatch.setattr)


@pytest.fixture(params=CONTRACTS)
def te_contract(request, monkeypatch):
    _see_fake_te(monkeypatch, request.param)
    bridge_lora_te_norm_grad.PATCH.revert()
    yield request.param
    bridge_lora_te_norm_grad.PATCH.revert()


@pytest.fixture
def te_2_4(monkeypatch):
    _see_fake_te(monkeypatch, TE_GE_2_4)
    bridge_lora_te_norm_grad.PATCH.revert()
    yield
    bridge_lora_te_norm_grad.PATCH.revert()


def _fake(tp_group, contract: str, **modes):
    """The fake's builder; ``modes``: ``fp8``, ``ub_overlap_rs_dgrad``, ``ub_bulk_wgrad``."""
    return lambda: FakeTELayerNormColumnParallelLinear(H, OUT, config=_parallel_config(torch.float64),
                                                       tp_group=tp_group, te_contract=contract, seed=9, **modes)


def _run(tp2, contract: str, run: str, *, as_is: bool = False, **modes) -> te_check.RunResult:
    return te_check.run_one(_fake(tp2, contract, **modes), run, tp2, seq=S, batch=B, hidden=H, out_features=OUT,
                            as_is=as_is)


@pytest.mark.parametrize("run", te_check.RUNS)
def test_lora_on_a_te_layernorm_linear_against_a_dense_reference(tp2, te_contract, run):
    result = _run(tp2, te_contract, run)
    errors = result.errors
    problems = [f"{name} is all zeros in the reference" for name, nonzero in result.reference_nonzero.items()
                if not nonzero]
    if te_contract == TE_GE_2_4 and run == "bridge":
        # The LoRA branch's input grad is lost: the input grad is off by O(1); the LoRA grads are not.
        if errors["input grad"] < te_check.DROPPED:
            problems.append(f"input grad: rel err {errors['input grad']:.2g}, expected the dropped LoRA gradient")
        correct = ("output", "LoRA-A grad", "LoRA-B grad")
    else:
        correct = tuple(errors)
    problems += [f"{name}: rel err {errors[name]:.3g} > {F64_REL_TOL:g}" for name in correct
                 if errors[name] > F64_REL_TOL]
    assert_no_problems([f"{te_contract} {run}: {p}" for p in problems], tp2)


def test_the_check_gives_the_verdict_of_the_contract(tp2, te_contract):
    """What scripts/te_lora_grad_check.py prints on a cluster: affected under TE >= 2.4, not affected before."""
    results = {run: _run(tp2, te_contract, run) for run in ("bridge", "bridge_patched", "shard_local")}
    verdict, lines = te_check.verdict(results, tolerance=F64_REL_TOL)
    want = "affected" if te_contract == TE_GE_2_4 else "not affected"
    assert_no_problems([] if verdict == want else [f"verdict {verdict!r}, expected {want!r}: {lines}"], tp2)


@pytest.mark.parametrize("strategy", ("regather", "shard_local"))
def test_te_saving_is_the_whole_gathered_input_per_adapter(tp2, te_contract, strategy):
    """Bridge keeps TE's norm-output shard and LoRA-A's gathered copy; ours keeps the shard once: s*b*h*8 bytes less."""
    saved = {run: _run(tp2, te_contract, run).saved_bytes for run in ("bridge_patched", strategy)}
    expected = S * B * H * 8  # float64
    problems = [] if saved["bridge_patched"] - saved[strategy] == expected else [
        f"saved {saved}: difference {saved['bridge_patched'] - saved[strategy]} != s*b*h*8 = {expected}"]
    assert_no_problems(problems, tp2)


def test_the_patch_keeps_bridges_memory_and_reports_itself(tp2, te_contract):
    """The patched path retains what Bridge's own path retains; the patch is applied under both contracts."""
    bridge, patched = (_run(tp2, te_contract, run).saved_bytes for run in ("bridge", "bridge_patched"))
    status, why = bridge_lora_te_norm_grad.PATCH.status()
    problems = [] if bridge == patched else [f"saved bytes differ: Bridge {bridge}, patched {patched}"]
    if status != "applied":  # TE 1.5 to 2.3 need it for layers with Userbuffers rs_dgrad/bulk_wgrad overlap
        problems.append(f"patch status {status!r} ({why}), expected 'applied' under {te_contract}")
    assert_no_problems(problems, tp2)


def test_the_patch_leaves_our_strategies_alone(tp2, te_2_4):
    """Installed (TE >= 2.4), the wrapper decides at the first forward to leave a shard_local adapter as it is."""
    lora_linear = te_check.wrap(_fake(tp2, TE_GE_2_4)(), "shard_local")
    problems = [] if bridge_lora_te_norm_grad.PATCH.applied else ["our LoRA did not apply the patch under TE >= 2.4"]
    x = torch.randn(S // TP, B, H, dtype=torch.float64, requires_grad=True)
    lora_linear(x)[0].sum().backward()
    taken = lora_linear.__dict__.get("_mbx_gather_norm_output")
    if taken is not False or lora_linear.to_wrap.return_layernorm_output_gathered:
        problems.append(f"the patch took over an adapter that uses shard_local (decision {taken})")
    assert_no_problems(problems, tp2)


# --------------------------------------------------------------------------------------------
# megatron_bridge_ext.init() fixes Bridge's own LoRA; the run-time check; FP8 and Userbuffers
# --------------------------------------------------------------------------------------------

@pytest.fixture
def no_init_hooks():
    """Neither the patch nor the run-time check in place, before and after (init() installs both)."""
    bridge_lora_te_norm_grad.PATCH.revert()
    bridge_lora_te_norm_grad.remove_check()
    yield
    bridge_lora_te_norm_grad.PATCH.revert()
    bridge_lora_te_norm_grad.remove_check()


def _init(monkeypatch) -> None:
    """megatron_bridge_ext.init(), its allocator step left out (this process's allocator is not the subject)."""
    import megatron_bridge_ext
    from megatron_bridge_ext.levers import allocator

    monkeypatch.setattr(allocator, "init", lambda **options: None)
    megatron_bridge_ext.init()


def _reference_problems(result: te_check.RunResult) -> list[str]:
    """Every run quantity off the float64 reference, and any reference that is all zeros."""
    return ([f"{name} is all zeros in the reference" for name, nonzero in result.reference_nonzero.items() if not nonzero]
            + [f"{name}: rel err {err:.3g} > {F64_REL_TOL:g}" for name, err in result.errors.items() if err > F64_REL_TOL])


def test_init_fixes_bridges_own_lora_when_bridge_is_already_imported(tp2, te_2_4, no_init_hooks, monkeypatch):
    """Bridge's PEFT modules are imported in this process; init() then wraps Bridge's AdapterWrapper at once, and
    Bridge's own LoRA (megatron.bridge.peft.lora.LoRA, not ours) on TE 2.4 gets the reference's input gradient."""
    _init(monkeypatch)
    result = _run(tp2, TE_GE_2_4, "bridge", as_is=True)
    assert_no_problems(_reference_problems(result), tp2)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_init_fixes_bridges_own_lora_imported_after_it(tp2, tmp_path_factory):
    """A fresh 2-rank run (tests/support/te_init_child.py) calls init() first, then imports Bridge: the import hook
    wraps Bridge's AdapterWrapper as it is imported, and Bridge's own LoRA on TE 2.4 matches the reference."""
    import subprocess
    import sys

    port = [_free_port() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(port, src=0)
    out = _shared_file(tmp_path_factory, "init_child.json", tp2)
    env = _single_process_env()
    env.update(RANK=str(dist.get_rank()), LOCAL_RANK=str(dist.get_rank()), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port[0]))
    done = subprocess.run([sys.executable, "-m", "tests.support.te_init_child", out], env=env, capture_output=True,
                          text=True, timeout=600)
    problems = [] if done.returncode == 0 else [f"the child exited {done.returncode}: {done.stderr[-3000:]}"]
    if dist.get_rank() == 0 and not problems:
        import json

        with open(out) as f:
            child = json.load(f)
        if child["bridge_before_init"]:
            problems.append(f"Bridge was imported before init(): {child['bridge_before_init'][:5]}")
        if child["lora"] != "megatron.bridge.peft.lora.LoRA":
            problems.append(f"the run used {child['lora']}, not Bridge's own LoRA")
        problems += [f"{name} is all zeros in the reference" for name, nonzero in child["nonzero"].items() if not nonzero]
        problems += [f"{name}: rel err {err:.3g} > {F64_REL_TOL:g}" for name, err in child["errors"].items()
                     if err > F64_REL_TOL]
    assert_no_problems(problems, tp2)


def test_the_run_time_check_warns_once_without_the_fix_and_not_with_it(tp2, te_2_4, no_init_hooks, caplog):
    """Bridge's own LoRA on TE 2.4, two adapted layers, check installed: one WARNING naming the fix when the patch is
    not applied, none when it is."""
    bridge_lora_te_norm_grad.install_check()
    warnings = {}
    for fixed in (False, True):
        if fixed:
            bridge_lora_te_norm_grad.PATCH.apply()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=bridge_lora_te_norm_grad.log.name):
            for _ in range(2):
                _run(tp2, TE_GE_2_4, "bridge", as_is=True)
        warnings[fixed] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    problems = []
    if len(warnings[False]) != 1 or "megatron_bridge_ext.init()" not in warnings[False][0] \
            or "megatron_bridge_ext.peft.LoRA" not in warnings[False][0]:
        problems.append(f"without the fix: {warnings[False]}")
    if warnings[True]:
        problems.append(f"with the fix: {warnings[True]}")
    assert_no_problems(problems, tp2)


@pytest.mark.parametrize("run", ("bridge", "bridge_patched", "shard_local"))
def test_fp8_gradients_against_a_dense_reference(tp2, te_contract, run):
    """Under FP8 TE still returns the norm output unquantised and adds only the non-gathered return's gradient from
    2.4 on: Bridge as shipped loses the LoRA input gradient on te>=2.4, the patched path and ours match."""
    result = _run(tp2, te_contract, run, fp8=True)
    if te_contract == TE_GE_2_4 and run == "bridge":
        problems = [] if result.errors["input grad"] > te_check.DROPPED else [
            f"input grad rel err {result.errors['input grad']:.2g}: expected the dropped LoRA gradient"]
    else:
        problems = _reference_problems(result)
    assert_no_problems([f"{te_contract} {run}: {p}" for p in problems], tp2)


def test_fp8_saving_is_the_gathered_input_less_the_shard(tp2, te_contract):
    """Under FP8 TE keeps a quantised copy of the shard, which our LoRA-A cannot share: ours keeps the returned shard
    on top of it, so the saving is s*b*h*bytes*(1-1/t), not s*b*h*bytes."""
    saved = {run: _run(tp2, te_contract, run, fp8=True).saved_bytes for run in ("bridge_patched", "shard_local")}
    expected = S * B * H * 8 - S * B * H * 8 // TP
    problems = [] if saved["bridge_patched"] - saved["shard_local"] == expected else [
        f"saved {saved}: difference {saved['bridge_patched'] - saved['shard_local']} != s*b*h*8*(1-1/t) = {expected}"]
    assert_no_problems(problems, tp2)


@pytest.mark.parametrize("run", ("bridge", "bridge_patched", "off", "shard_local"))
def test_userbuffers_rs_dgrad_on_te_2_3_against_a_dense_reference(tp2, te_contract, run):
    """ub_overlap_rs_dgrad skips the gathered-output add on TE <= 2.3 too: Bridge as shipped loses the LoRA input
    gradient under both contracts; the patch (needed from TE 1.5 on, taking over such layers) and ours match."""
    result = _run(tp2, te_contract, run, ub_overlap_rs_dgrad=True)
    if run == "bridge":
        problems = [] if result.errors["input grad"] > te_check.DROPPED else [
            f"input grad rel err {result.errors['input grad']:.2g}: expected the dropped LoRA gradient"]
    else:
        problems = _reference_problems(result)
    assert_no_problems([f"{te_contract} {run}: {p}" for p in problems], tp2)


@pytest.mark.parametrize("installed", ("patch", "check"))
def test_userbuffers_bulk_wgrad_with_a_frozen_base_is_refused_by_name(tp2, te_contract, installed, no_init_hooks):
    """With ub_bulk_wgrad TE reduce-scatters the input gradient only inside the wgrad GEMM, which LoRA's frozen base
    skips: no fix can make it right, so the patch and the check refuse at the first forward, naming the setting."""
    from megatron_bridge_ext.findings import Refused

    run = "bridge_patched" if installed == "patch" else "bridge"
    if installed == "check":
        bridge_lora_te_norm_grad.install_check()
    try:
        _run(tp2, te_contract, run, as_is=installed == "check", ub_bulk_wgrad=True)
        refusal = None
    except Refused as error:
        refusal = error.one_line()
    problems = [] if refusal and "model.tp_comm_bulk_wgrad" in refusal and "Fix: set model.tp_comm_bulk_wgrad=False" in refusal \
        else [f"{installed}: refusal {refusal!r}"]
    assert_no_problems([f"{te_contract}: {p}" for p in problems], tp2)


def _shared_file(tmp_path_factory, name: str, group) -> str:
    """A path both ranks agree on (rank 0's temporary directory)."""
    directory = [str(tmp_path_factory.mktemp("te_gpt")) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(directory, src=0)
    return f"{directory[0]}/{name}"


def _te_shape(kind: str):
    """The float64 tiny GPT for PEFT ``kind``. DoRA adapts the TE layers only: Bridge's DoRA normalises a
    row-parallel layer's weight over the rank's own input columns, another function at TP=2 than at TP=1."""
    from tests.support.lora_blocks import _shape

    return _shape(kind, dtype="float64", **({"lora_targets": ["linear_qkv", "linear_fc1"]} if kind == "dora" else {}))


def _te_gpt(shape, contract: str, run: str):
    """The tiny GPT on the TE fake with ``run``'s PEFT of kind ``shape.peft`` (Bridge's as shipped runs unpatched)."""
    from megatron_bridge_ext.testing import tiny_model as tm
    from tests.support.lora_blocks import _peft
    from tests.support.te_gpt import fake_te_spec

    if run == "bridge_patched":
        bridge_lora_te_norm_grad.PATCH.apply()
    model = tm.apply_peft(tm.build_gpt(shape, layer_spec=fake_te_spec(contract)), _peft(_VARIANT[run], shape))
    if run == "bridge":
        bridge_lora_te_norm_grad.PATCH.revert()
    return model


def _loss_weights(shape) -> torch.Tensor:
    return torch.randn(shape.micro_batch, shape.seq, shape.vocab, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(77))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("run", ("bridge", "bridge_patched", "shard_local"))
def test_whole_gpt_embedding_grad_against_a_dense_reference(tp2, te_contract, run, kind, tmp_path_factory):
    """A tiny GPT with the TE LayerNorm-linears and LoRA on all four targets (DoRA on the TE layers,
    CanonicalLoRA with SwiGLU): the gradient reaching the embedding output (through every layer) against
    the same model computed with TP=1 in one process. The patch makes Bridge's DoRA and CanonicalLoRA
    right too, their wrappers take the norm output from the same method as LoRA's."""
    from megatron_bridge_ext.testing import tiny_model as tm
    from tests.support.te_gpt import float64_loss, full_state, track_embedding_output

    shape = _te_shape(kind)
    model = _te_gpt(shape, te_contract, run)
    leaf = track_embedding_output(model)
    batch = tm.synthetic_batch(shape, 0)
    weights = _loss_weights(shape)
    loss = float64_loss(model, batch, weights, tp2)
    loss.backward()
    state = full_state(model, tp2)

    reference = _dense_reference({"shape": dataclasses_asdict(shape), "state": state, "loss_weights": weights,
                                  "batch": {k: v.cpu() for k, v in batch.items()}}, tp2, tmp_path_factory)
    errors = {"loss": local_rel_err(loss.detach().reshape(1), reference["loss"].reshape(1)),
              "embedding output grad": local_rel_err(leaf[0].grad, _rank_slice(reference["embedding_grad"], 0, tp2))}
    problems = [] if reference["embedding_grad"].any() else ["the reference gradient is all zeros"]
    if te_contract == TE_GE_2_4 and run == "bridge":
        if errors["embedding output grad"] < 1e-2:
            problems.append(f"embedding output grad: rel err {errors['embedding output grad']:.2g}; expected the "
                            "dropped LoRA input gradients to show")
        errors.pop("embedding output grad")
    problems += [f"{name}: rel err {err:.3g} > 1e-10" for name, err in errors.items() if err > 1e-10]
    assert_no_problems([f"{te_contract} {kind} {run}: {p}" for p in problems], tp2)


@pytest.mark.parametrize("kind", KINDS)
def test_te_saving_in_the_whole_gpt_is_one_gathered_input_per_adapted_layer(tp2, te_contract, kind):
    """Bridge's path keeps TE's norm-output shard and one gathered copy per adapted TE layer, which all of
    the layer's adapters share (CanonicalLoRA's q, k and v, its up and gate); ours keeps the shard once:
    s*b*h*8 bytes less per adapted layer, whatever the kind. Except the first layer's linear_qkv: its
    input comes from the frozen embedding, so nothing in TE's function needs a grad and TE keeps no
    shard there; ours keeps one, s*b*h*8/t, against Bridge's gathered s*b*h*8."""
    from megatron_bridge_ext.measure import SavedActivationMeter
    from megatron_bridge_ext.testing import tiny_model as tm
    from tests.support.te_gpt import float64_loss

    shape = _te_shape(kind)
    saved = {}
    for run in ("bridge_patched", "shard_local"):
        model = _te_gpt(shape, te_contract, run)
        with SavedActivationMeter(model) as meter:
            float64_loss(model, tm.synthetic_batch(shape, 0), _loss_weights(shape), tp2)
        saved[run] = meter.result().total_bytes
    layers = shape.layers * len({"linear_qkv", "linear_fc1"} & set(shape.lora_targets))
    sbh8 = shape.seq * shape.micro_batch * shape.hidden * 8
    expected = layers * sbh8 - sbh8 // TP  # the first layer's linear_qkv saves sbh8 - sbh8/t
    problems = [] if saved["bridge_patched"] - saved["shard_local"] == expected else [
        f"saved {saved}: difference {saved['bridge_patched'] - saved['shard_local']} != {layers} x s*b*h*8 - "
        f"s*b*h*8/t = {expected}"]
    assert_no_problems([f"{te_contract} {kind}: {p}" for p in problems], tp2)


def test_dora_with_dropout_keeps_bridges_path_on_a_te_layernorm_linear(tp2, te_2_4):
    """Bridge's DoRA dropout correction runs the TE layer again on its gathered norm output, which fails under
    sequence parallelism. Ours leaves such an adapter on Bridge's path (it would otherwise get a shard and
    pass a wrong correction silently), says why in its report, and fails the same way; without dropout the
    adapter is eligible."""
    from megatron.bridge.peft.dora import DoRA as BridgeDoRA
    from torch import nn

    from megatron_bridge_ext.peft import DoRA
    from megatron_bridge_ext.peft.dora import TE_DROPOUT_REASON

    def forward_error(peft):
        root = nn.Module()
        root.add_module("linear_qkv", _fake(tp2, TE_GE_2_4)())
        root = peft(root, training=True)
        x = torch.randn(S // TP, B, H, dtype=torch.float64, requires_grad=True)
        try:
            root.linear_qkv(x)
        except RuntimeError as error:
            return root, str(error)
        return root, None

    fields = dict(target_modules=["linear_qkv"], dim=8, alpha=16)
    _, bridge_error = forward_error(BridgeDoRA(**fields, dropout=0.1))
    ours = DoRA(**fields, dropout=0.1, sequence_parallel_input_strategy="shard_local")
    root, ours_error = forward_error(ours)
    problems = []
    if bridge_error is None or ours_error != bridge_error:
        problems.append(f"Bridge's DoRA with dropout raised {bridge_error!r}, ours {ours_error!r}")
    if [(d.strategy, d.reason) for d in ours.report()] != [("off", TE_DROPOUT_REASON)]:
        problems.append(f"report {ours.report()}")
    if type(root.linear_qkv.adapter.linear_in).__name__ == "SequenceParallelLoRAIn":
        problems.append("LoRA-A was switched to the shard")
    without = DoRA(**fields, sequence_parallel_input_strategy="shard_local")
    _, error = forward_error(without)
    if error is not None or [d.strategy for d in without.report()] != ["shard_local"]:
        problems.append(f"DoRA without dropout: {error!r}, {without.report()}")
    assert_no_problems(problems, tp2)


_REFERENCES: dict[str, dict] = {}


def _fingerprint(inputs: dict) -> str:
    import hashlib

    digest = hashlib.sha256(repr(inputs["shape"]).encode())
    for group in (inputs["state"], inputs["batch"], {"loss_weights": inputs["loss_weights"]}):
        for name in sorted(group):
            digest.update(name.encode())
            digest.update(group[name].detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _dense_reference(inputs: dict, group, tmp_path_factory) -> dict:
    """The TP=1 single-process result for ``inputs`` (rank 0 computes it in a child process, once per inputs)."""
    import subprocess
    import sys

    key = _fingerprint(inputs)
    if key in _REFERENCES:
        return _REFERENCES[key]
    source = _shared_file(tmp_path_factory, "inputs.pt", group)
    target = source.replace("inputs.pt", "reference.pt")
    failure = [None]
    if dist.get_rank() == 0:
        torch.save(inputs, source)
        done = subprocess.run([sys.executable, "-m", "tests.support.te_gpt", source, target],
                              env=_single_process_env(), capture_output=True, text=True, timeout=600)
        failure = [None if done.returncode == 0 else done.stderr[-3000:]]
    dist.broadcast_object_list(failure, src=0)  # both ranks fail together, or neither
    assert failure[0] is None, failure[0]
    _REFERENCES[key] = torch.load(target, weights_only=False)
    return _REFERENCES[key]


def _single_process_env() -> dict[str, str]:
    """This environment without torchrun's variables (its agent store would capture the child's rendezvous)."""
    import os

    launcher = ("TORCHELASTIC", "GROUP_", "ROLE_", "LOCAL_", "MASTER_", "RANK", "WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher)}
    env["MBX_REFERENCE_PORT"] = str(29600 + os.getpid() % 300)
    return env


def dataclasses_asdict(shape) -> dict:
    import dataclasses

    return dataclasses.asdict(shape)


def _real_te_available() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # missing, or installed without its CUDA libraries
        return False
    return torch.cuda.is_available()


@pytest.mark.te
@pytest.mark.skipif(not _real_te_available(), reason="needs Transformer Engine with CUDA: run on a GPU cluster with TE")
def test_real_transformer_engine_verdict_and_saving(tp2):
    """Megatron Core's TELayerNormColumnParallelLinear: the patched path and ours are correct, Bridge's as shipped
    is affected exactly when TE >= 2.4, and keeping LoRA-A on the shard saves s*b*h*bytes."""
    from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    config = _parallel_config(torch.float32)

    def make_base():
        torch.manual_seed(7)
        model_parallel_cuda_manual_seed(1234)
        return TELayerNormColumnParallelLinear(H, OUT, config=config, init_method=torch.nn.init.xavier_normal_,
                                               gather_output=False, bias=False, skip_bias_add=True, is_expert=False,
                                               tp_group=tp2).cuda()

    results = {run: te_check.run_one(make_base, run, tp2, seq=S, batch=B, hidden=H, out_features=OUT)
               for run in ("bridge", "bridge_patched", "shard_local")}
    verdict, lines = te_check.verdict(results, tolerance=5e-3)
    affected = bridge_lora_te_norm_grad.te_affected()[0]
    problems = [] if verdict == ("affected" if affected else "not affected") else [f"verdict {verdict}: {lines}"]
    saving = results["bridge_patched"].saved_bytes - results["shard_local"].saved_bytes
    if saving != S * B * H * 4:
        problems.append(f"saving {saving} B != s*b*h*4 = {S * B * H * 4} B")
    bridge_lora_te_norm_grad.PATCH.revert()
    assert_no_problems(problems, tp2)
