"""Run by test_autotp.py: ``deepspeed.init_inference`` after ``ds_fpquant.patch_deepspeed()`` (which
routes a config with the ``fp_quantization`` section through ``ds_fpquant.init_inference``) with AutoTP
(tp_size 2) on 2 gloo CPU processes. Each rank checks its quantized shards bit for bit and prints one JSON line of results."""

import json
import os
import sys

import torch
import torch.multiprocessing as mp


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=100, max_position_embeddings=64, bos_token_id=0,
                      eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval()


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(world))
    import deepspeed

    import ds_fpquant as fpq
    from ds_fpquant.nn.quantized_params import is_weight_quantized

    deepspeed.init_distributed(dist_backend="gloo")
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(1))
    base = {"tensor_parallel": {"tp_size": world}, "dtype": torch.float32, "replace_with_kernel_inject": False}
    reference = deepspeed.init_inference(_model(), config=dict(base))
    ref_logits = reference(ids).logits
    # the unquantized shards of this rank, for the bit-exact check below
    shards = {n: m.weight.detach().clone() for n, m in reference.module.named_modules()
              if type(m).__name__ in ("LinearLayer", "LinearAllreduce")}
    fpq.patch_deepspeed()  # DeepSpeed's own init_inference then takes the section (issue 16)
    engine = deepspeed.init_inference(_model(), config={"fp_quantization": {"fmt": "e4m3", "group_size": 16}, **base})
    fpq.unpatch_deepspeed()
    layers = {n: m for n, m in engine.module.named_modules() if n in shards}
    exact = all(
        torch.equal(m.weight_codes, fpq.quantize(shards[n], "e4m3", 16, backend="torch").codes)
        for n, m in layers.items())
    from ds_fpquant.tensor.quantized_tensor import QuantizedTensor
    dense, calls = QuantizedTensor.dequantize, []  # every dequantize runs this method: count them, wherever called from
    QuantizedTensor.dequantize = lambda *a, **k: calls.append(1) or dense(*a, **k)
    with torch.no_grad():
        logits = engine(ids).logits
    QuantizedTensor.dequantize = dense
    generated = engine.module.generate(ids, max_new_tokens=3, do_sample=False)
    cos = torch.nn.functional.cosine_similarity(logits.flatten(), ref_logits.flatten(), dim=0).item()
    result = dict(rank=rank, layers=len(layers), quantized=sum(is_weight_quantized(m) for m in layers.values()),
                  exact=exact, cos=cos, generated=list(generated.shape), dequantized_in_forward=len(calls),
                  weight_released=all(
                      m.weight is None for m in layers.values()))
    result.update(_pre_quantized(rank, world, out_dir, base, ids))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    # both ranks done before either tears down: a rank that exits with the gloo group's threads still running can
    # abort ("terminate called without an active exception", SIGABRT) while the other still talks to it
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _pre_quantized(rank, world, out_dir, base, ids):
    """Issue 16: a checkpoint from ``ds-fpquant quantize`` loaded with ``load_quantized`` (FPQuantizedLinear
    layers, no nn.Linear left) under AutoTP: each rank holds its slice of the stored codes (output rows or
    input columns), and the logits are as close to the fp64 value as the tp=1 model's (the shards and the
    all-reduce only reorder the fp32 sums)."""
    import deepspeed
    from unit.linear_bound import dequantized_model, rms_error

    import ds_fpquant as fpq
    from ds_fpquant.tensor.slicing import column_slice, row_slice

    src, ckpt = os.path.join(out_dir, "src"), os.path.join(out_dir, "ckpt")
    if rank == 0:  # transformers saves on the main process only
        _model().save_pretrained(src)
        fpq.quantize_checkpoint(src, ckpt, "e4m3", block=(16, 32), progress=False)
    torch.distributed.barrier()
    whole = fpq.load_quantized(ckpt)
    with torch.no_grad():
        whole_logits = whole(ids).logits
    full = {n: m.quantized_weight for n, m in whole.named_modules() if isinstance(m, fpq.FPQuantizedLinear)}
    fpq.patch_deepspeed()  # DeepSpeed's own call, no fp_quantization section: the model is quantized already
    engine = deepspeed.init_inference(fpq.load_quantized(ckpt), config=dict(base))
    fpq.unpatch_deepspeed()
    sliced = exact = 0
    for name, m in engine.module.named_modules():
        if name not in full or not hasattr(m, "weight_codes"):
            continue
        size, start = m._partition_sizes[m.tp_index], sum(m._partition_sizes[:m.tp_index])
        part = (column_slice if type(m).__name__ == "LinearAllreduce" else row_slice)(full[name], start, start + size)
        exact += torch.equal(m.weight_codes, part.codes) and torch.equal(m.weight_scales.view(torch.float32), part.scales)
        sliced += 1
    with torch.no_grad():
        logits = engine(ids).logits
        exact_logits = dequantized_model(_model(), whole).double()(ids).logits  # the function both compute, in fp64
    # groups of 48 columns: the row-parallel layers' 64-column shards would cut a group
    odd = os.path.join(out_dir, "odd")
    if rank == 0:
        fpq.quantize_checkpoint(src, odd, "e4m3", group_size=48, allow_partial_blocks=True, progress=False)
    torch.distributed.barrier()
    try:
        fpq.init_inference(fpq.load_quantized(odd), {"fp_quantization": {"enabled": False}, **base})
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    return dict(pre_sliced=sliced, pre_exact=exact, pre_error=rms_error(logits, exact_logits),
                whole_error=rms_error(whole_logits, exact_logits), exact_rms=rms_error(exact_logits, 0 * exact_logits),
                refused=refused)


if __name__ == "__main__":
    port, out_dir = int(sys.argv[1]), sys.argv[2]
    mp.spawn(worker, args=(2, port, out_dir), nprocs=2)
