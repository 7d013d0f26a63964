"""bridge_recipe_hf_config: a recipe's Hugging Face config read answered from a local config.json or failed at once."""

from __future__ import annotations

import json

import pytest

from tests.support.fresh import run

pytestmark = [pytest.mark.unit]


# --------------------------------------------------------------------------------------------
# bridge_recipe_hf_config: a Bridge model recipe reads its Hugging Face config from the hub
# --------------------------------------------------------------------------------------------

_HUB_RECIPE = """
    import json, socket

    from megatron_bridge_ext.patches import bridge_peft_without_te, bridge_recipe_hf_config
    from megatron_bridge_ext.estimate.configs import hf_config_object

    bridge_peft_without_te.import_bridge_peft()
    from transformers import AutoConfig

    calls = []
    def offline(cls, path, *args, **kwargs):  # the hub read, on a machine without the hub
        calls.append(kwargs.get("local_files_only", False))
        raise OSError("no connection")
    AutoConfig.from_pretrained = classmethod(offline)
    socket.create_connection = lambda *a, **k: (_ for _ in ()).throw(OSError("no network"))
    from megatron.bridge.recipes.qwen.qwen3 import qwen3_8b_peft_config

    def attempt():
        calls.clear()
        try:
            cfg = qwen3_8b_peft_config()
        except ValueError as error:
            return [len(calls), all(calls), str(error).splitlines()[0][:60]]
        return [len(calls), cfg.model.num_layers, cfg.model.hidden_size]

    data = json.load(open("tests/data/qwen3-8b/config.json"))
    data["num_hidden_layers"] = 5
"""


def test_upstream_recipe_retries_its_hub_read_four_times_and_the_patch_answers_or_fails_at_once():
    result = run(_HUB_RECIPE, """
        import time
        time.sleep = lambda seconds: None  # Bridge's backoff between attempts, not waited for here
        upstream = attempt()
        with bridge_recipe_hf_config.answering(hf_config_object(data)) as local_read:
            local = attempt()
        with bridge_recipe_hf_config.answering() as offline_read:
            failed = attempt()
        reverted = attempt()
        report(upstream=upstream, local=local, requested=local_read.requested, failed=failed,
               unreachable=offline_read.unreachable, reverted=reverted,
               applied=bridge_recipe_hf_config.PATCH.applied)
    """)
    assert result["upstream"][:2] == [4, False]  # 4 hub attempts, each of them with network retries inside
    assert result["local"] == [0, 5, 4096]  # the local file answered; the hub was never asked
    assert result["requested"] == "Qwen/Qwen3-8B"
    assert result["failed"][:2] == [1, True]  # one look in the local cache
    assert result["unreachable"].startswith("no connection to huggingface.co:443")
    assert result["reverted"][:2] == [4, False] and result["applied"] is False


def test_a_hub_tokenizer_read_is_answered_by_the_local_configs_length_or_fails_at_once():
    """Gemma's fine-tuning recipes read the tokenizer to grow the vocabulary to its length: with a local config the
    read returns that config's vocab_size as the length (no growth, the model as config.json states it); with no
    local config and no hub it fails at once, where upstream's hub client retries for minutes."""
    result = run(_HUB_RECIPE, """
        import time
        from transformers import AutoTokenizer
        hub_calls = []
        def hub(cls, path, *args, **kwargs):
            hub_calls.append(path)
            raise OSError("would retry the hub")
        AutoTokenizer.from_pretrained = classmethod(hub)
        with bridge_recipe_hf_config.answering(hf_config_object(data)) as local_read:
            answered = AutoTokenizer.from_pretrained("google/gemma-2-2b", trust_remote_code=True)
        with bridge_recipe_hf_config.answering():
            began = time.monotonic()
            try:
                AutoTokenizer.from_pretrained("google/gemma-2-2b")
                failed = None
            except OSError as error:
                failed = str(error)
        report(length=len(answered), tokenizer=local_read.tokenizer, failed=failed, hub_calls=hub_calls)
    """)
    assert result["length"] == json.load(open("tests/data/qwen3-8b/config.json"))["vocab_size"]
    assert result["tokenizer"] == "google/gemma-2-2b"
    assert result["failed"].startswith("the tokenizer of google/gemma-2-2b is on the Hugging Face hub, which is not "
                                       "reachable (no connection to huggingface.co:443")
    assert result["hub_calls"] == []  # neither read reached the hub client
