"""Issue 25: every reader of a sharded checkpoint follows ``model.safetensors.index.json``: each tensor comes
from the shard the index names, copies elsewhere (a stale tensor left in a reused folder, a hand-edited
checkpoint) are ignored and reported once (``UnindexedTensorsWarning``), and the index cannot send a reader
outside the checkpoint directory. Before, every key of every listed shard was read, so a stale copy could
win (``quantize_checkpoint``, ``load_quantized`` of block FP8) or crash quantize-while-loading."""

import json
import os

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from unit.tiny_models import assert_same_tensors, tiny_llama

import ds_fpquant as fpq
from ds_fpquant.checkpoint import writer as checkpoint
from ds_fpquant.checkpoint.hf_files import UnindexedTensorsWarning

INDEX = "model.safetensors.index.json"
IDS = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(6))
SECTION = {"fmt": "e4m3", "block": [32, 32]}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A full-precision checkpoint in several shards with an index, and its model."""
    path = tmp_path_factory.mktemp("llama")
    model = tiny_llama()
    model.save_pretrained(path, max_shard_size="60KB")
    assert (path / INDEX).is_file() and len(set(json.loads((path / INDEX).read_text())["weight_map"].values())) > 2
    return path, model


def _copy_dir(src, dst):
    dst.mkdir()
    for entry in src.iterdir():
        (dst / entry.name).write_bytes(entry.read_bytes())
    return dst


def _weight_map(directory):
    return json.loads((directory / INDEX).read_text())["weight_map"]


def _read_indexed(directory):
    """Name -> tensor, each from the shard the index names (what every reader must do), or of the one file."""
    if not (directory / INDEX).is_file():
        with safe_open(directory / "model.safetensors", framework="pt") as fh:
            return {k: fh.get_tensor(k) for k in fh.keys()}
    out = {}
    for key, name in _weight_map(directory).items():
        with safe_open(directory / name, framework="pt") as fh:
            out[key] = fh.get_tensor(key)
    return out


def _add_stale_copies(directory, keys):
    """Write, for each key, a copy with other values into a shard the index does not name for it."""
    weight_map = _weight_map(directory)
    for key in keys:
        other = next(name for name in sorted(set(weight_map.values())) if name != weight_map[key])
        with safe_open(directory / weight_map[key], framework="pt") as fh:
            stale = fh.get_tensor(key)
        with safe_open(directory / other, framework="pt") as fh:
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        tensors[key] = torch.full(stale.shape, 3.0).to(stale.dtype)  # other values, the same dtype and shape
        save_file(tensors, str(directory / other), metadata={"format": "pt"})


STALE = ["model.layers.0.mlp.down_proj.weight", "model.norm.weight"]  # a weight to quantize, a tensor to keep


def test_quantize_checkpoint_takes_the_indexed_copy(sharded, tmp_path):
    src, _ = sharded
    stale = _copy_dir(src, tmp_path / "stale")
    _add_stale_copies(stale, STALE)
    with pytest.warns(UnindexedTensorsWarning, match=r"2 tensor\(s\).*model\.layers\.0\.mlp\.down_proj\.weight"):
        checkpoint.quantize_checkpoint(stale, tmp_path / "q_stale", "e4m3", block=(32, 32), progress=False)
    checkpoint.quantize_checkpoint(src, tmp_path / "q", "e4m3", block=(32, 32), progress=False)
    got, want = _read_indexed(tmp_path / "q_stale"), _read_indexed(tmp_path / "q")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k].reshape(-1).view(torch.uint8), want[k].reshape(-1).view(torch.uint8)) for k in got)


def test_load_quantized_of_block_fp8_takes_the_indexed_copy(sharded, tmp_path):
    src, _ = sharded
    checkpoint.quantize_checkpoint(src, tmp_path / "q", "e4m3", block=(32, 32), max_shard_bytes=40_000, progress=False)
    stale = _copy_dir(tmp_path / "q", tmp_path / "q_stale")
    _add_stale_copies(stale, ["model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight_scale_inv",
                              "model.embed_tokens.weight"])
    with pytest.warns(UnindexedTensorsWarning, match=r"3 tensor\(s\)"):
        loaded = fpq.load_quantized(stale)
    assert_same_tensors(loaded, fpq.load_quantized(tmp_path / "q"))


def test_quantize_while_loading_takes_the_indexed_copy(sharded, tmp_path):
    src, _ = sharded
    stale = _copy_dir(src, tmp_path / "stale")
    _add_stale_copies(stale, STALE)
    with pytest.warns(UnindexedTensorsWarning):
        loaded = fpq.load_quantized(stale, fp_quantization=SECTION)  # before: AttributeError on the second copy
    reference = fpq.apply(transformers.AutoModelForCausalLM.from_pretrained(src), {"fp_quantization": SECTION})
    assert_same_tensors(loaded, reference)
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, reference(IDS).logits)  # the same modules and calls


@pytest.mark.parametrize("name", ["../outside.safetensors", "sub/model.safetensors", "ABSOLUTE", "..", "",
                                  "sub\\model.safetensors", "C:model.safetensors"])
def test_the_index_stays_inside_its_directory(sharded, tmp_path, name):
    src, _ = sharded
    bad = _copy_dir(src, tmp_path / "bad")
    outside = tmp_path / "outside.safetensors"
    index = json.loads((bad / INDEX).read_text())
    first = next(iter(index["weight_map"]))
    (bad / "sub").mkdir()
    for path in (outside, bad / "sub" / "model.safetensors"):
        path.write_bytes((bad / index["weight_map"][first]).read_bytes())
    index["weight_map"][first] = str(outside) if name == "ABSOLUTE" else name
    (bad / INDEX).write_text(json.dumps(index))
    for read in (lambda: fpq.load_quantized(bad, fp_quantization=SECTION),
                 lambda: checkpoint.quantize_checkpoint(bad, tmp_path / "q", "e4m3", progress=False)):
        with pytest.raises(ValueError, match="a shard must be a plain file name in the checkpoint's directory"):
            read()
    assert not (tmp_path / "q").exists()


def test_an_index_entry_its_shard_lacks_is_an_error(sharded, tmp_path):
    src, _ = sharded
    bad = _copy_dir(src, tmp_path / "bad")
    index = json.loads((bad / INDEX).read_text())
    key = STALE[0]
    index["weight_map"][key] = next(n for n in sorted(set(index["weight_map"].values())) if n != index["weight_map"][key])
    (bad / INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"the index assigns \['model\.layers\.0\.mlp\.down_proj\.weight'\] to"):
        fpq.load_quantized(bad, fp_quantization=SECTION)


def test_symlinked_shards_in_the_hub_cache_layout(sharded, tmp_path):
    """snapshots/<revision>/<file> -> ../../blobs/<hash>, as huggingface_hub lays out its cache."""
    src, _ = sharded
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc123"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    for i, entry in enumerate(sorted(src.iterdir())):
        (blobs / f"blob{i}").write_bytes(entry.read_bytes())
        os.symlink(os.path.join("..", "..", "blobs", f"blob{i}"), snapshot / entry.name)
    loaded = fpq.load_quantized(snapshot, fp_quantization=SECTION)
    assert_same_tensors(loaded, fpq.load_quantized(src, fp_quantization=SECTION))


def test_an_empty_index_is_an_error_and_a_single_file_comes_first(sharded, tmp_path):
    src, _ = sharded
    bad = _copy_dir(src, tmp_path / "bad")
    (bad / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    with pytest.raises(ValueError, match="is not a safetensors index .*weight_map lists no tensors"):
        checkpoint.quantize_checkpoint(bad, tmp_path / "q", "e4m3", progress=False)
    # model.safetensors beside an index (a folder saved twice): read alone, as transformers reads it
    both = _copy_dir(src, tmp_path / "both")
    save_file(_read_indexed(src), str(both / "model.safetensors"), metadata={"format": "pt"})
    _add_stale_copies(both, STALE)  # the shards now disagree with the single file, which wins
    assert_same_tensors(fpq.load_quantized(both, fp_quantization=SECTION), fpq.load_quantized(src, fp_quantization=SECTION))


def test_moe_per_expert_keys_follow_the_index(tmp_path):
    """The MoE key mapping (per-expert matrices into fused stacks) reads the same indexed headers: a stale
    copy of an expert's matrix in another shard is ignored by the writer and by quantize-while-loading."""
    from unit.moe_models import tiny_moe

    model = tiny_moe("mixtral")
    model.save_pretrained(tmp_path / "src", max_shard_size="60KB")
    expert = next(k for k in _weight_map(tmp_path / "src") if ".experts.0." in k and k.endswith(".weight"))
    stale = _copy_dir(tmp_path / "src", tmp_path / "stale")
    _add_stale_copies(stale, [expert])
    section = {"fmt": "e2m1", "group_size": 16}
    with pytest.warns(UnindexedTensorsWarning, match=expert.replace(".", r"\.")):
        checkpoint.quantize_checkpoint(stale, tmp_path / "q_stale", progress=False, **section)
    checkpoint.quantize_checkpoint(tmp_path / "src", tmp_path / "q", progress=False, **section)
    got, want = _read_indexed(tmp_path / "q_stale"), _read_indexed(tmp_path / "q")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    with pytest.warns(UnindexedTensorsWarning):
        loaded = fpq.load_quantized(stale, fp_quantization=section)
    assert_same_tensors(loaded, fpq.load_quantized(tmp_path / "src", fp_quantization=section))
