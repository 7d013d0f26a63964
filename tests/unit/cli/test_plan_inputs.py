"""``mbx plan``'s checks that need no Bridge (overrides, conflicts, idle flags, the plot's folder, the recipe's
module), the checks of the built config, and how a failure after the checks reaches the user."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from argparse import Namespace
from types import SimpleNamespace

import pytest

from megatron_bridge_ext import cli, plan_config
from megatron_bridge_ext.cli import plan as plan_cli
from megatron_bridge_ext.cli import plan_failures, plan_inputs
from megatron_bridge_ext.findings import ERROR, Finding, Refused
from tests.support.cli import ROOT

pytestmark = [pytest.mark.unit]

QWEN3_8B = str(ROOT / "tests" / "data" / "qwen3-8b" / "config.json")
NANO = "megatron.bridge.recipes.nemotronh.h100.nemotron_3_nano:nemotron_3_nano_pretrain_8gpu_h100_bf16_config"


def _refused_before_torch(*argv: str) -> str:
    """``mbx plan ... argv`` in a fresh interpreter: exit 2, nothing on stdout, one ``mbx plan: `` line on
    stderr (returned), and neither torch nor Bridge imported."""
    code = ("import sys; from megatron_bridge_ext import cli; rc = cli.main(['plan', *sys.argv[1:]]); "
            "print(sorted({'torch', 'megatron.bridge'} & set(sys.modules)), file=sys.stderr); sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code, "--gpu-memory", "80GiB", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 2 and done.stdout == "", done.stderr[-2000:]
    line, imported = done.stderr.splitlines()
    assert line.startswith("mbx plan: ") and imported == "[]", done.stderr
    return line.removeprefix("mbx plan: ")


HF = ["--hf-config", QWEN3_8B, "--seq", "4096"]
EARLY = [
    # item 1: an output path checked before the work
    ([*HF, "--plot", "/nonexistent/dir/x.png"],
     "--plot: folder /nonexistent/dir does not exist. Fix: create it, or give a file in an existing folder"),
    # item 2: a size override that is no number
    ([*HF, "model.tensor_model_parallel_size=abc"],
     "model.tensor_model_parallel_size: 'abc' is not a whole number of 1 or more. Fix: give e.g. "
     "model.tensor_model_parallel_size=2"),
    # item 5: a flag and an override on one field
    ([*HF, "--tp", "2", "model.tensor_model_parallel_size=4"],
     "model.tensor_model_parallel_size: --tp 2 and model.tensor_model_parallel_size=4 set the same field to "
     "different values. Fix: give one of them (drop --tp or the override)"),
    (["--hf-config", QWEN3_8B, "--seq", "8192", "model.seq_length=4096"],
     "model.seq_length: --seq 8192 and model.seq_length=4096 set the same field to different values"),
    ([*HF, "--tp", "2", "--no-sp", "model.sequence_parallel=true"],
     "model.sequence_parallel: --no-sp and model.sequence_parallel=true set the same field to different values"),
    # item 6: a flag that cannot act, by name
    ([*HF, "--lora-dim", "16"], "--lora-dim: sets the rank of the adapters --peft adds, and no --peft was given "
                                "(every parameter trained). Fix: add --peft lora (or dora, canonical_lora), or drop "
                                "--lora-dim"),
    ([*HF, "--peft", "none", "--lora-dim", "16"], "--lora-dim: sets the rank of the adapters --peft adds, and --peft "
                                                  "none adds no adapter"),
    ([*HF, "--etp", "2"], "--etp: acts on the experts of a mixture-of-experts model, and this one has no experts. "
                          "Fix: drop --etp"),
    ([*HF, "--moe-imbalance", "2"], "--moe-imbalance: acts on the experts of a mixture-of-experts model"),
    # item 11: an override without a key
    ([*HF, "=3"], "overrides: '=3' names no field before '='. Fix: write key=value, e.g. model.seq_length=8192"),
    # item 14: what needs no Bridge is checked before Bridge is imported
    ([*HF, "model.seq_length"], "overrides: Error parsing override 'model.seq_length'"),
    (["--recipe", "megatron.bridge.recipes.no_such_family:config"],
     "--recipe: cannot import 'megatron.bridge.recipes.no_such_family' (no module named "
     "'megatron.bridge.recipes.no_such_family'). Fix: give an importable recipe module"),
    (["--recipe", "no_such_package.recipes:config"], "--recipe: cannot import 'no_such_package.recipes' (no module "
                                                     "named 'no_such_package')"),
]


@pytest.mark.parametrize("argv, expected", EARLY, ids=[" ".join(a[len(HF):] or a) for a, _ in EARLY])
def test_what_needs_no_bridge_is_refused_before_it_is_imported(argv, expected):
    line = _refused_before_torch(*argv)
    assert line.startswith(expected), line


def _args(*argv: str) -> Namespace:
    return cli.build_parser().parse_args(["plan", "--gpu-memory", "80GiB", *argv])


@pytest.mark.parametrize("argv", [["--tp", "2", "model.tensor_model_parallel_size=2"],
                                  ["--sp", "--tp", "2", "model.sequence_parallel=true"],
                                  ["--seq", "4096", "model.seq_length=8192", "model.seq_length=4096"]],
                         ids=["same-tp", "same-sp", "the-last-override-agrees"])
def test_a_flag_and_an_override_that_agree_are_no_conflict(argv):
    assert plan_inputs.conflict_problem(_args("--hf-config", QWEN3_8B, *argv)) is None


def test_a_nullable_size_may_be_unset_by_an_override_and_others_may_not():
    assert plan_inputs.override_problem(["model.expert_tensor_parallel_size=null"]) is None
    problem = plan_inputs.override_problem(["model.pipeline_model_parallel_size=null"])
    assert problem.text() == ("model.pipeline_model_parallel_size: None is not a whole number of 1 or more. Fix: "
                              "give e.g. model.pipeline_model_parallel_size=2")
    assert plan_inputs.override_problem(["train.micro_batch_size=true"]).setting == "train.micro_batch_size"


def _built(*, vocab_size, experts=None, tokenizer_model="nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-Base-BF16"):
    """The fields of a built config that :func:`plan_config.built_problem` reads, as a recipe leaves them (a TP-1
    layout without sequence parallelism, no dataset)."""
    return SimpleNamespace(model=SimpleNamespace(vocab_size=vocab_size, num_moe_experts=experts, sequence_parallel=False,
                                                 tensor_model_parallel_size=1, seq_length=4096),
                           tokenizer=SimpleNamespace(tokenizer_type="HuggingFaceTokenizer",
                                                     tokenizer_model=tokenizer_model))


def test_a_recipe_that_leaves_the_vocabulary_to_its_tokenizer_is_named_in_one_line():
    """Item 3: Bridge's providers assert vocab_size in provide(); the plan names the field and the tokenizer."""
    problem = plan_config.built_problem(_built(vocab_size=None, experts=128), _args("--recipe", NANO))
    assert problem.text() == ("model.vocab_size: is unset: the recipe leaves it to the tokenizer "
                              "(cfg.tokenizer.tokenizer_model=nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-Base-BF16), which "
                              "Bridge reads only when training starts. Fix: give the tokenizer's vocabulary size, "
                              "e.g. model.vocab_size=131072")
    assert plan_config.built_problem(_built(vocab_size=1024, experts=128), _args("--recipe", NANO)) is None


def test_a_recipes_dense_model_refuses_an_expert_only_flag_once_built():
    args = _args("--recipe", NANO, "--moe-imbalance", "1.5")
    assert plan_config.built_problem(_built(vocab_size=1024), args).setting == "--moe-imbalance"
    assert plan_config.built_problem(_built(vocab_size=1024, experts=8), args) is None


def test_lora_dim_on_a_recipe_is_judged_by_the_peft_the_recipe_builds():
    """Item 9: --lora-dim without --peft on a recipe: not "no --peft was given (full fine-tuning)" before the recipe
    is built, but what the built config holds: its own LoRA object (which --lora-dim does not reach) or no PEFT."""
    from megatron_bridge_ext.peft import LoRA  # Bridge's LoRA with our strategy field (Bridge's imports TE first)

    args = _args("--recipe", NANO, "--lora-dim", "64")
    assert plan_inputs.lora_dim_problem(args) is None  # not known before the build
    with_lora = _built(vocab_size=1024)
    with_lora.peft = LoRA(dim=32)
    text = plan_config.built_problem(with_lora, args).text()
    assert "the recipe builds its own LoRA (dim 32) in Python" in text and "--peft lora --lora-dim N" in text
    without = _built(vocab_size=1024)
    without.peft = None
    assert "the recipe builds no PEFT (every parameter trained)" in plan_config.built_problem(without, args).text()
    assert plan_config.built_problem(with_lora, _args("--recipe", NANO)) is None


def test_a_sequence_beyond_max_position_embeddings_gets_a_note():
    with open(QWEN3_8B) as handle:
        longest = json.load(handle)["max_position_embeddings"]
    note = plan_inputs.seq_note(longest + 1, QWEN3_8B)
    assert note.startswith(f"seq {longest + 1} is longer than config.json's max_position_embeddings {longest}, ")
    assert plan_inputs.seq_note(longest, QWEN3_8B) is None
    assert plan_inputs.seq_note(longest + 1, None) is None  # a recipe alone: its provider keeps no such field


def test_a_refusals_one_line_carries_every_error():
    findings = [Finding("bad_input", ERROR, f"model.field_{i}", f"problem {i}", f"fix {i}") for i in range(3)]
    line = Refused("mbx plan input", findings).one_line()
    assert line == "; also: ".join(f.text() for f in findings) and "more)" not in line


@pytest.mark.parametrize("tty, expected", [(True, f"mbx plan: {plan_failures.IMPORTING}\n"), (False, "")])
def test_the_importing_line_is_printed_on_a_terminal_only(tty, expected):
    import io

    class Stream(io.StringIO):
        def isatty(self) -> bool:
            return tty

    stream = Stream()
    plan_failures.say_importing(stream)
    assert stream.getvalue() == expected


def _fail_inside(monkeypatch, error: Exception) -> None:
    def failing(args):
        raise error

    monkeypatch.setattr(plan_cli, "_plan", failing)


def test_an_unexpected_error_is_one_line_and_debug_shows_its_traceback(capsys, monkeypatch):
    _fail_inside(monkeypatch, TypeError("not all arguments converted during string formatting"))
    argv = ["plan", *HF, "--gpu-memory", "80GiB"]
    assert cli.main(argv) == plan_failures.UNEXPECTED_STATUS
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        "mbx plan: the plan failed: TypeError: not all arguments converted during string formatting. Fix: rerun "
        "with --debug for the traceback (no input check caught this: please report it with the command)"]
    with pytest.raises(TypeError, match="not all arguments converted"):
        cli.main([*argv, "--debug"])


def test_an_unexpected_message_that_ends_a_sentence_gets_no_second_full_stop(capsys, monkeypatch):
    _fail_inside(monkeypatch, RuntimeError("Trying to use a TE block when it's not present."))
    assert cli.main(["plan", *HF, "--gpu-memory", "80GiB"]) == plan_failures.UNEXPECTED_STATUS
    assert "when it's not present. Fix: rerun with --debug" in capsys.readouterr().err


def test_a_refusal_inside_is_still_a_refusal(capsys, monkeypatch):
    _fail_inside(monkeypatch, Refused("mbx plan input", [Finding("bad_input", ERROR, "model.x", "bad", "fix it")]))
    assert cli.main(["plan", *HF, "--gpu-memory", "80GiB"]) == 2
    assert capsys.readouterr().err == "mbx plan: model.x: bad. Fix: fix it\n"


def test_a_plot_that_cannot_be_written_keeps_the_printed_plan(capsys, monkeypatch, tmp_path):
    """The plan is printed first; a failure writing the plot is one line after it, and the plan stands."""
    pytest.importorskip("matplotlib")
    from megatron_bridge_ext.render import plan_plot
    from tests.unit.cli.test_plan import small_plan

    result = small_plan(gpu_memory=1)
    monkeypatch.setattr(plan_cli, "_plan", lambda args: result)

    def disk_full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(plan_plot, "plot", disk_full)
    path = tmp_path / "x.png"
    assert cli.main(["plan", *HF, "--gpu-memory", "1GiB", "--plot", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == plan_cli.format_plan(result, peft_defaulted=True) + "\n"
    assert err.splitlines() == [f"mbx plan: --plot: {path} was not written ([Errno 28] No space left on device). "
                                "Fix: give a writable .png, .pdf or .svg path (the plan above stands)"]


def test_the_fake_world_leaves_sys_excepthook_as_it_found_it():
    """torch's init_process_group wraps sys.excepthook with a [rankN]: prefix; two worlds must not nest two."""
    from megatron_bridge_ext.estimate.fake import fake_parallel_world

    before = sys.excepthook
    for _ in range(2):
        with fake_parallel_world(tp=2, pp=1, cp=1, rank=0, device="meta"):
            assert sys.excepthook is not before  # torch did wrap it inside
    assert sys.excepthook is before


@pytest.mark.skipif(os.environ.get("MBX_SLOW") != "1", reason="builds Bridge's Nemotron 3 Nano recipe (MBX_SLOW=1)")
def test_the_nemotron_nano_recipe_names_its_vocabulary_in_one_line():
    done = subprocess.run([sys.executable, "-m", "megatron_bridge_ext.cli", "plan", "--recipe", NANO, "--seq", "8192",
                           "--dp", "16", "--gpu-memory", "80GB", "model.moe_token_dispatcher_type=alltoall"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1].startswith("mbx plan: model.vocab_size: is unset: the recipe leaves it to "
                                                   "the tokenizer (cfg.tokenizer.")
