"""FSDP2 through Lightning Fabric on 2 CPU processes (gloo): the global gradient norm, per-layer
norms, clipping and one optimizer step equal a single-process run of the same model and data;
each rank's parameter shard reassembles into the full model in one process."""

from __future__ import annotations

import json
import math

import pytest
import torch
from fsdp_common import ACCUM, Step, build_lm, global_batch, microbatches, torchrun
from fsdp_worker import CLIP, ODD_SHAPES

from stabletrain.debug.grad_norm import clip_grad_norm_with_total, compute_grad_norm, layer_grad_norms
from stabletrain.distributed import ShardError, fsdp_units, local_shards, reassemble
from stabletrain.distributed.shards import replicated_mismatches

WORLD = 2


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One torchrun of the worker's ``norms`` mode; every test below reads its files."""
    out = tmp_path_factory.mktemp("fsdp_norms")
    proc = torchrun(["norms", str(out)], nproc=WORLD)
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    full = torch.load(out / "full.pt", weights_only=True)
    return out, seen, full


def _reference(init_state, dtype):
    """The same step in one process: every rank's microbatches, each loss / (accumulation x world),
    which is what FSDP's averaging reduce-scatter computes."""
    model = build_lm(0, dtype=dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in init_state.items()})
    for rank in range(WORLD):
        for mb in microbatches(global_batch(0), rank, WORLD, ACCUM):
            (model.training_step(mb) / (ACCUM * WORLD)).backward()
    return model


pytestmark = pytest.mark.slow


def test_fsdp_really_sharded_and_kept_names(run):
    _, seen, full = run
    for s in seen:
        assert s["world_size"] == WORLD
        assert s["param_types"] == ["DTensor"] and s["grad_types"] == ["DTensor"]
        assert s["units"] == ["model.blocks.0", "model.blocks.1"]
        assert s["classes"] == {"": "TransformerLM", "blocks.0": "FSDPBlock", "head": "Linear"}
        # No wrapper prefix: the names of an unsharded model.
        assert s["param_names"] == [n for n, _ in build_lm(0).named_parameters()]
    # Every rank built the same weights from the seed; gathered, they are the unsharded model's.
    plain = build_lm(0).state_dict()
    assert list(full["init"]) == list(plain)
    assert all(torch.equal(full["init"][k], plain[k]) for k in plain)


def test_global_norm_equals_single_process(run):
    _, seen, full = run
    ref32 = compute_grad_norm(_reference(full["init"], torch.float32).named_parameters())
    ref64 = compute_grad_norm(_reference(full["init"], torch.float64).named_parameters())
    for s in seen:
        assert s["total"] == pytest.approx(float(ref32.total), rel=1e-6)
        assert s["total"] == pytest.approx(float(ref64.total), rel=1e-5)
        assert s["torch_get_total_norm"] == pytest.approx(s["total"], rel=1e-6)
        # The bug this fixes: each rank's own shards give a smaller, rank-dependent number.
        assert s["local_only_total"] < 0.9 * s["total"]
    assert seen[0]["total"] == seen[1]["total"], "bitwise the same on every rank"
    assert seen[0]["local_only_total"] != seen[1]["local_only_total"]


def test_plain_tensors_among_sharded_ones_are_not_summed_over_ranks(run):
    _, seen, _ = run
    for s in seen:
        assert s["mixed_extra"] == 5.0
        assert s["mixed_total"] == pytest.approx(math.sqrt(s["total"] ** 2 + 25.0), rel=1e-6)
        assert s["mixed_layer"] == s["layer"]["head.weight"]


def test_one_all_reduce_and_no_host_sync(run):
    _, seen, _ = run
    for s in seen:
        assert s["all_reduces"] == 1, "per-parameter squares reduced in one collective"
        assert s["syncs"] == 0, "nothing read back to the host"


def test_per_layer_norms_equal_single_process(run):
    _, seen, full = run
    model = _reference(full["init"], torch.float64)
    names, norms = layer_grad_norms(compute_grad_norm(model.named_parameters()))
    ref = dict(zip(names, norms.tolist()))
    assert len(ref) > 40  # 29 parameters and the modules above them
    for s in seen:
        assert sorted(s["layer"]) == sorted(ref)
        for name, value in ref.items():
            assert math.isclose(s["layer"][name], value, rel_tol=1e-5, abs_tol=1e-9), name
    assert seen[0]["layer"] == seen[1]["layer"]


def test_clipping_and_the_step_equal_single_process(run):
    _, _, full = run
    model = _reference(full["init"], torch.float32)
    gn = compute_grad_norm(model.named_parameters())
    assert float(gn.total) > 10 * CLIP, "the test needs the clipping to act"
    clip_grad_norm_with_total(gn.params, CLIP, gn.total)
    for name, p in model.named_parameters():
        torch.testing.assert_close(full["clipped"][name], p.grad, rtol=1e-5, atol=1e-8, msg=name)
    clipped_total = torch.linalg.vector_norm(torch.stack([g.norm() for g in full["clipped"].values()]))
    assert float(clipped_total) == pytest.approx(CLIP, rel=1e-4)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(full["stepped"][name], value, rtol=1e-6, atol=1e-8, msg=name)


def test_nan_in_one_ranks_shard_is_seen_and_named_on_every_rank(run):
    _, seen, _ = run
    for s in seen:
        assert s["nan_total_finite"] is False
        assert s["nan_names"] == ["blocks.1.mlp.fc1.weight"]


def test_shards_reassemble_into_the_full_model_in_one_process(run):
    out, _, full = run
    for files, key in (("shard_rank{}.pt", "init"), ("shard_after_rank{}.pt", "stepped")):
        shards = [torch.load(out / files.format(r), weights_only=True) for r in range(WORLD)]
        # Reassembly needs no process group, and its order of ranks does not matter.
        assert not torch.distributed.is_initialized()
        model = reassemble(shards[::-1])
        assert list(model) == [n for n, _ in build_lm(0).named_parameters()]
        for name, value in model.items():
            assert torch.equal(value, full[key][name]), (key, name)
        # Uneven: 65 embedding rows are 33 + 32; each rank's file holds its part only.
        assert [s["tensors"]["tok_emb.weight"].shape[0] for s in shards] == [33, 32]
        assert [s["layout"]["tok_emb.weight"]["offset"] for s in shards] == [[0, 0], [33, 0]]
    plain = build_lm(0)
    plain.load_state_dict(model)
    assert torch.equal(plain.head.weight, full["stepped"]["head.weight"])


def test_odd_shapes_and_empty_shards_reassemble(run):
    out, _, _ = run
    shards = [torch.load(out / f"odd_rank{r}.pt", weights_only=True) for r in range(WORLD)]
    assert shards[1]["tensors"]["one_row"].shape == (0, 3), "one row on 2 ranks: rank 1's shard is empty"
    full = reassemble(shards)
    for name, shape, _ in ODD_SHAPES:
        expected = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
        assert torch.equal(full[name], expected), name


def test_reassemble_refuses_incomplete_or_mismatched_shards(run):
    out, _, _ = run
    shards = [torch.load(out / f"shard_rank{r}.pt", weights_only=True) for r in range(WORLD)]
    with pytest.raises(ShardError, match=r"missing ranks \[1\]"):
        reassemble(shards[:1])
    with pytest.raises(ShardError, match=r"ranks given twice \[0\]"):
        reassemble([shards[0], shards[0]])
    bad = {**shards[1], "layout": dict(shards[1]["layout"])}
    bad["layout"]["head.weight"] = {**bad["layout"]["head.weight"], "offset": [1, 0]}
    with pytest.raises(ShardError, match=r"head.weight: 1024 of 2080 elements are in no rank's shard"):
        reassemble([shards[0], bad])
    bad["layout"]["head.weight"] = {**bad["layout"]["head.weight"], "offset": [40, 0]}
    with pytest.raises(ShardError, match=r"head.weight: rank 1's shard \(32, 32\) at offset \[40, 0\] lies outside"):
        reassemble([shards[0], bad])
    other = {**shards[1], "tensors": {**shards[1]["tensors"], "ln_f.bias": shards[1]["tensors"]["ln_f.bias"].double()}}
    with pytest.raises(ShardError, match="ln_f.bias: rank 1 has shape"):
        reassemble([shards[0], other])


def test_unsharded_tensors_are_stored_whole_and_compared_across_ranks():
    bn = torch.nn.BatchNorm1d(3)
    r0 = local_shards(bn.named_buffers(), rank=0, world_size=2)
    bn.running_mean += 1  # each FSDP rank updates its own running statistics
    r1 = local_shards(bn.named_buffers(), rank=1, world_size=2)
    assert r0["layout"]["running_mean"] == {"shape": [3], "offset": [0], "sharded": False}
    assert replicated_mismatches([r0, r1]) == ["running_mean"]
    assert torch.equal(reassemble([r0, r1])["running_mean"], torch.zeros(3))
    assert torch.equal(reassemble([r0, r1], replicated_from=1)["running_mean"], torch.ones(3))


def test_units_of_the_builtin_and_torchvision_models():
    import torchvision

    from stabletrain.tasks.image_classification import SmallCNN, TorchvisionClassifier

    assert fsdp_units(Step(build_lm(0))) == ["model.blocks.0", "model.blocks.1"]
    assert fsdp_units(SmallCNN(num_classes=4, width=8)) == ["features.0", "features.1", "features.2"]
    resnet = TorchvisionClassifier(torchvision.models.resnet18(weights=None, num_classes=4))
    assert fsdp_units(resnet) == [f"net.layer{i}.{j}" for i in range(1, 5) for j in range(2)]
    vit = torchvision.models.vit_b_16(weights=None, num_classes=4)
    assert fsdp_units(vit) == [f"encoder.layers.encoder_layer_{i}" for i in range(12)]


def test_units_leave_tied_weights_to_the_root():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 10, bias=False), torch.nn.Linear(4, 4)])
            self.blocks[0].weight = self.emb.weight  # tied: blocks.0 cannot be a unit of its own

    assert fsdp_units(Tied()) == ["blocks.1"]
