"""Real architectures with planted faults: the accuracy table of underflow_overflow and diagnose.

Code nobody here wrote: Hugging Face transformers models built from tiny configs with random
weights (no download), ``nn.TransformerEncoderLayer`` and ``nn.MultiheadAttention`` given the
masks they take, and torchvision classifiers (``weights=None``). Each is trained for one step in
a plain loop, with one fault planted at a known place:

* ``mlp_overflow``: one MLP projection's weight scaled to 3e38, so its output overflows float32;
* ``all_padding``: sample 22 is padding everywhere (a softmax row masked everywhere);
* ``log0``: the log of 0 for sample 22 (a per-sample weight in the loss; for images, a zero
  pixel under a log-compression input layer);
* ``nan_input``: a NaN in sample 22's input (``inputs_embeds`` for the language models).

:func:`run_underflow_overflow` and :func:`run_diagnose` give what each tool reports, as the
strings of one table cell; ``EXPECTED`` holds the right answers; ``python real_models.py``
writes ``docs/accuracy.md`` from it (a test checks that the file is up to date).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

B, T, FEATURES, CLASSES = 4, 8, 6, 3
INDICES = [20, 21, 22, 23]  # dataset indices of the microbatch
VICTIM = 2  # its row that holds the fault: dataset index 22
FAULTS = ("mlp_overflow", "all_padding", "log0", "nan_input")


# --------------------------------------------------------------------------------------
# Step functions: what a plain loop computes the loss with
# --------------------------------------------------------------------------------------


def _weighted(loss: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    # log0: a per-sample confidence weight enters the loss through its log.
    return loss - 0.1 * torch.log(batch["weight"]).mean() if "weight" in batch else loss


def lm_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Causal LM or sequence classifier: token ids (or embeddings), attention mask, labels."""
    inputs = {"inputs_embeds": batch["embeds"]} if "embeds" in batch else {"input_ids": batch["input_ids"]}
    out = model(**inputs, attention_mask=batch["attention_mask"], labels=batch["labels"])
    return _weighted(out.loss, batch)


def encoder_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return _weighted(F.cross_entropy(model(batch["x"], batch["pad_mask"]), batch["labels"]), batch)


def vision_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["image"]), batch["labels"])


# --------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------


def _hf(kind: str, attn: str) -> nn.Module:
    import transformers as tf

    tf.logging.set_verbosity_error()
    ids = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    if kind == "gpt2":
        cfg = tf.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, n_inner=64,
                            attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0, **ids)
        cls = tf.GPT2LMHeadModel
    elif kind == "llama":
        cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16, **ids)
        cls = tf.LlamaForCausalLM
    else:
        cfg = tf.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64, max_position_embeddings=16, num_labels=CLASSES,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)
        cls = tf.BertForSequenceClassification
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return cls(cfg)


class TorchEncoder(nn.Module):
    """``nn.TransformerEncoderLayer`` given a float ``src_mask`` (a band of width 2, a -inf
    buffer registered here and never traced) and the data's additive ``src_key_padding_mask``
    (0 or -inf), then attention pooling by ``nn.MultiheadAttention`` given the same padding as
    a boolean ``key_padding_mask`` (with ``need_weights``, its default: an explicit softmax)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(FEATURES, 32)
        self.encoder = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        self.query = nn.Parameter(torch.randn(1, 1, 32))
        self.pool = nn.MultiheadAttention(32, 2, batch_first=True)
        self.head = nn.Linear(32, CLASSES)
        i = torch.arange(T)
        self.register_buffer("band", torch.zeros(T, T).masked_fill((i[:, None] - i[None, :]).abs() > 2, float("-inf")))

    def forward(self, x: torch.Tensor, pad_mask: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.proj(x), src_mask=self.band, src_key_padding_mask=pad_mask)
        pooled, _ = self.pool(self.query.expand(len(x), -1, -1), h, h, key_padding_mask=pad_mask.isneginf())
        return self.head(pooled[:, 0])


class LogInput(nn.Module):
    """Log-compression of the input (as for spectrograms or intensities)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


class WithLogInput(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.log_input = LogInput()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.log_input(x))


def _vision(name: str, fault: str) -> nn.Module:
    import torchvision

    torch.manual_seed(0)
    net = getattr(torchvision.models, name)(weights=None, num_classes=CLASSES)
    return WithLogInput(net) if fault == "log0" else net


# --------------------------------------------------------------------------------------
# Batches: 4 samples, dataset indices 20-23, the fault in sample 22 (row 2)
# --------------------------------------------------------------------------------------


def _tokens(fault: str, labels: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    for row, length in enumerate((7, 5, T, 6)):  # ordinary padding at the end of samples 20, 21, 23
        mask[row, length:] = 0
    if fault == "all_padding":
        mask[VICTIM] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    if labels == "tokens":
        batch["labels"] = ids.masked_fill(mask == 0, -100)
    else:
        batch["labels"] = torch.randint(0, CLASSES, (B,), generator=g)
    if fault == "nan_input":
        embeds = torch.randn(B, T, 32, generator=g)
        embeds[VICTIM, 3, 7] = float("nan")
        batch["embeds"] = embeds
        del batch["input_ids"]
    return _with_weight(batch, fault, g)


def _with_weight(batch: dict[str, torch.Tensor], fault: str, g: torch.Generator) -> dict[str, torch.Tensor]:
    if fault == "log0" and "image" not in batch:
        weight = 0.5 + torch.rand(B, generator=g)
        weight[VICTIM] = 0.0
        batch["weight"] = weight
    return batch


def _features(fault: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, T, FEATURES, generator=g)
    pad = torch.zeros(B, T)
    for row, length in enumerate((7, 5, T, 6)):
        pad[row, length:] = float("-inf")
    if fault == "all_padding":
        pad[VICTIM] = float("-inf")
    if fault == "nan_input":
        x[VICTIM, 3, 1] = float("nan")
    batch = {"x": x, "pad_mask": pad, "labels": torch.randint(0, CLASSES, (B,), generator=g)}
    return _with_weight(batch, fault, g)


def _images(fault: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    image = 0.05 + 0.95 * torch.rand(B, 3, 64, 64, generator=g)  # intensities, positive
    if fault == "log0":
        image[VICTIM, 1, 10, 20] = 0.0
    if fault == "nan_input":
        image[VICTIM, 0, 5, 9] = float("nan")
    return {"image": image, "labels": torch.randint(0, CLASSES, (B,), generator=g)}


@dataclass(frozen=True)
class Arch:
    """One architecture of the table.

    Attributes:
        name: Row label.
        build: ``build(fault)``: the model, seeded (the same weights every time).
        batch: ``batch(fault)``: the microbatch of 4 samples.
        step: ``step(model, batch) -> loss``.
        mlp: The MLP projection whose weight ``mlp_overflow`` scales.
        faults: The faults that apply (``all_padding`` needs a sequence).
    """

    name: str
    build: Callable[[str], nn.Module]
    batch: Callable[[str], dict[str, torch.Tensor]]
    step: Callable[[nn.Module, Any], torch.Tensor]
    mlp: str
    faults: tuple[str, ...] = FAULTS


ARCHS = {
    "gpt2-sdpa": Arch("GPT-2 (transformers, sdpa)", lambda f: _hf("gpt2", "sdpa"), lambda f: _tokens(f, "tokens"),
                      lm_step, "transformer.h.1.mlp.c_fc"),
    "llama-eager": Arch("Llama (transformers, eager)", lambda f: _hf("llama", "eager"), lambda f: _tokens(f, "tokens"),
                        lm_step, "model.layers.1.mlp.up_proj"),
    "llama-sdpa": Arch("Llama (transformers, sdpa)", lambda f: _hf("llama", "sdpa"), lambda f: _tokens(f, "tokens"),
                       lm_step, "model.layers.1.mlp.up_proj"),
    "bert-sdpa": Arch("BERT classifier (transformers, sdpa)", lambda f: _hf("bert", "sdpa"),
                      lambda f: _tokens(f, "classes"), lm_step, "bert.encoder.layer.1.intermediate.dense"),
    "torch-encoder": Arch("nn.TransformerEncoderLayer + nn.MultiheadAttention pooling", lambda f: TorchEncoder(),
                          _features, encoder_step, "encoder.linear1"),
    "resnet18": Arch("resnet18 (torchvision)", lambda f: _vision("resnet18", f), _images, vision_step, "fc",
                     faults=("mlp_overflow", "log0", "nan_input")),
    "mobilenet": Arch("mobilenet_v3_small (torchvision)", lambda f: _vision("mobilenet_v3_small", f), _images,
                      vision_step, "classifier.0", faults=("mlp_overflow", "log0", "nan_input")),
}

CASES = [(arch, fault) for arch, a in ARCHS.items() for fault in a.faults]


def planted(arch: str, fault: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The model and batch of a case, with the fault planted."""
    a = ARCHS[arch]
    model, batch = a.build(fault), a.batch(fault)
    if fault == "mlp_overflow":
        with torch.no_grad():
            w = model.get_submodule(a.mlp).weight
            w.div_(w.abs().max()).mul_(3e38)  # finite, but any sum of a few such products overflows
    return model, batch


# --------------------------------------------------------------------------------------
# What each tool reports, as one table cell
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    """What a tool reported: ``what`` is the op (diagnose) or tensor (underflow_overflow);
    ``samples`` the dataset indices named ("any" when the failure does not depend on data,
    "-" when the tool names none); ``detail`` the cause class or the explanation's gist."""

    what: str
    module: str
    phase: str
    samples: str
    detail: str = ""


FINITE = Cell("-", "-", "-", "-", "finite: nothing reported")


def _samples(rows: Optional[list[int]]) -> str:
    return ", ".join(str(INDICES[r]) for r in rows) if rows else "-"


def run_underflow_overflow(arch: str, fault: str, out_dir: Path) -> Cell:
    from stabletrain import UnderflowOverflowError, UnderflowOverflowMonitor

    model, batch = planted(arch, fault)
    try:
        with UnderflowOverflowMonitor(model, out_dir=out_dir) as monitor:
            loss = ARCHS[arch].step(model, batch)
            monitor.record_loss(loss)
            loss.backward()
            monitor.check()
    except UnderflowOverflowError as err:
        rows = err.rows if err.rows and len(err.rows) < B else None
        samples = "any" if err.rows and len(err.rows) == B else _samples(rows)
        return Cell(err.tensor or "", err.module or "<model>", err.phase or "", samples, err.value or "")
    return FINITE


def run_diagnose(arch: str, fault: str, out_dir: Path) -> tuple[Cell, Any]:
    """The diagnose cell and the Diagnosis (None when the step is finite: then the op tracer
    itself, forward and backward, must find nothing either)."""
    from stabletrain import NaNCaptureMonitor, NaNDetectedError, diagnose
    from stabletrain.debug.op_trace import trace_first_nonfinite

    a = ARCHS[arch]
    model, batch = planted(arch, fault)
    monitor = NaNCaptureMonitor(model, out_dir=out_dir, step_fn=a.step)
    try:
        monitor.begin_step(0)
        monitor.collect_batch(batch, indices=INDICES)
        loss = a.step(model, batch)
        monitor.collect_loss(loss)
        loss.backward()
        monitor.check_and_capture()
    except NaNDetectedError as err:
        path = err.capture_path
    else:
        fresh, _ = planted(arch, fault)
        finding, _ = trace_first_nonfinite(fresh, lambda: a.step(fresh, batch))
        return (FINITE if finding is None else Cell(finding.op_name, finding.module, finding.phase, "?")), None
    finally:
        monitor.close()
    d = diagnose(path, model=a.build(fault), step_fn=a.step, write=False)
    f = d.finding
    if d.data.status == "isolated":
        samples = ", ".join(map(str, d.data.dataset_indices or []))
    else:
        samples = "any" if d.data.status == "not_data_specific" else "-"
    detail = d.cause_title
    if d.weights.status != "healthy":
        detail += f", weights {d.weights.status} at step start"
    if f is None:
        return Cell("-", "-", "-", samples, detail), d
    if f.origin == "inf" and f.cause is not None:
        c = f.cause
        detail += f", NaN from {c.kind} {'written by' if c.written else 'of'} {c.op_name} in {c.module or '<model>'}"
    if d.origin:
        detail += f", from the {d.origin}"
    return Cell(f.op_name, f.module or "<model>", f.phase, samples, detail), d


# --------------------------------------------------------------------------------------
# The right answers, and the table written from them
# --------------------------------------------------------------------------------------

_DN = "deterministic numerical"
_HUGE = f"{_DN}, weights huge at step start"
_DATA = f"{_DN}, from the data"


def _mlp(arch: str, op: str, value: str = "inf") -> tuple[Cell, Cell]:
    module = ARCHS[arch].mlp
    return Cell("output[0]", module, "forward", "any", value), Cell(op, module, "forward", "any", _HUGE)


def _log0_in_loss() -> tuple[Cell, Cell]:
    # The loss is a scalar: underflow_overflow cannot tell samples apart in it; diagnose can.
    return Cell("loss", "<model>", "forward", "-", "inf"), Cell("log", "<model>", "forward", "22", _DN)


def _nan_embeds(op: str, module: str) -> tuple[Cell, Cell]:
    return (Cell("input['inputs_embeds']", "<model>", "forward", "22", "nan"),
            Cell(op, module, "forward", "22", _DATA))


def _vision_cases(arch: str, first_conv: str) -> dict[tuple[str, str], tuple[Cell, Cell]]:
    return {
        (arch, "mlp_overflow"): _mlp(arch, "addmm", "nan"),
        (arch, "log0"): (Cell("output[0]", "log_input", "forward", "22", "inf"),
                         Cell("log", "log_input", "forward", "22", _DN)),
        (arch, "nan_input"): (Cell("input[0]", "<model>", "forward", "22", "nan"),
                              Cell("convolution", first_conv, "forward", "22", _DATA)),
    }


#: (arch, fault) -> (what underflow_overflow reports, what diagnose reports): the right answers.
#: The all-padding sample of the Hugging Face models is handled by the models themselves (eager
#: attention masks with finfo.min, SDPA gives fully masked rows zero weight): the step is finite
#: and neither tool may report anything, whatever -inf the masks hold.
EXPECTED: dict[tuple[str, str], tuple[Cell, Cell]] = {
    **{(arch, "mlp_overflow"): _mlp(arch, op) for arch, op in (
        ("gpt2-sdpa", "addmm"), ("llama-eager", "mm"), ("llama-sdpa", "mm"), ("bert-sdpa", "addmm"),
        ("torch-encoder", "addmm"))},
    **{(arch, "all_padding"): (FINITE, FINITE) for arch in ("gpt2-sdpa", "llama-eager", "llama-sdpa", "bert-sdpa")},
    ("torch-encoder", "all_padding"): (
        Cell("output[0]", "pool", "forward", "22", "nan"),
        Cell("_softmax", "pool", "forward", "22", f"{_DN}, NaN from -Inf written by masked_fill_ in pool")),
    **{(arch, "log0"): _log0_in_loss()
       for arch in ("gpt2-sdpa", "llama-eager", "llama-sdpa", "bert-sdpa", "torch-encoder")},
    ("gpt2-sdpa", "nan_input"): _nan_embeds("add", "transformer"),
    ("llama-eager", "nan_input"): _nan_embeds("pow", "model.layers.0.input_layernorm"),
    ("llama-sdpa", "nan_input"): _nan_embeds("pow", "model.layers.0.input_layernorm"),
    ("bert-sdpa", "nan_input"): _nan_embeds("add", "bert.embeddings"),
    ("torch-encoder", "nan_input"): (Cell("input[0]", "<model>", "forward", "22", "nan"),
                                     Cell("view", "proj", "forward", "22", _DATA)),
    **_vision_cases("resnet18", "conv1"),
    **_vision_cases("mobilenet", "features.0.0"),
}

_FAULT_TEXT = {
    "mlp_overflow": "overflow in an MLP projection",
    "all_padding": "all-padding sample 22",
    "log0": "log(0) for sample 22",
    "nan_input": "NaN in sample 22's input",
}


def render_markdown() -> str:
    """``docs/accuracy.md``: the table of ``EXPECTED``, which the tests assert case by case."""
    lines = [
        "# Accuracy on real architectures",
        "",
        "Each row is a real model with one fault planted at a known place, trained for one step in a plain loop; "
        "each cell is what the tool reports. `tests/debug/test_real_architectures.py` asserts every cell "
        "(`tests/debug/real_models.py` builds the cases; `python tests/debug/real_models.py` rewrites this page "
        "from them). The models are built from tiny configs with random weights (no download); a microbatch "
        "holds samples 20-23, and the faults of a sample are planted in sample 22.",
        "",
        "Faults: *overflow in an MLP projection*: that layer's weight scaled to 3e38, so its output overflows "
        "float32; *all-padding*: every position of sample 22 is padding (a softmax row masked everywhere); "
        "*log(0)*: the log of a per-sample weight that is 0 for sample 22, in the loss (for the image models, "
        "a zero pixel under a log-compression input layer `log_input`); *NaN input*: one NaN in sample 22's "
        "input (`inputs_embeds` for the Hugging Face models).",
        "",
        "Columns: *underflow_overflow* gives the module, the tensor, the phase and the samples (rows of the batch) "
        "whose values are non-finite there; *diagnose* gives the op where the bad value was born (or, for bad "
        "data, the first op that used it), its module, the phase, the samples its search isolates (*any*: the "
        "failure does not depend on the data) and the cause. `-`: nothing (for underflow_overflow's samples: a "
        "scalar loss has no samples).",
        "",
        "Every model here hands attention masks with -inf (or `torch.finfo(dtype).min`) around: Hugging Face's "
        "SDPA masks built with `scalar_tensor(-inf)` and `where`, a -inf band registered as a buffer in "
        "`__init__`, the data's additive key-padding mask, the boolean mask `nn.MultiheadAttention` turns into "
        "-inf with `masked_fill_`. None of them is reported unless it does harm.",
        "",
        "## How the tools decide what to report",
        "",
        "A NaN or an Inf is a failure only if it does harm: it reaches the loss or a gradient. An attention mask "
        "puts -inf into the scores on purpose and the softmax turns it back into 0; such a value is never "
        "reported, however it was built.",
        "",
        "- **diagnose** (`stabletrain.debug.op_trace`) follows every NaN/Inf back to where it was born, per tensor "
        "storage and per kind (NaN, +Inf, -Inf): an op that makes it from finite inputs (log(0), an overflow, "
        "`masked_fill(-inf)`), an op that makes a NaN from an Inf (a softmax over a row masked everywhere), or a "
        "tensor that no traced op made (the data, a weight, a buffer registered in `__init__`). Ops that pass "
        "values on keep their origin, element by element for elementwise ops; an op whose output is finite "
        "neutralised what it received, and nothing is kept. What reaches the loss, or appears in the backward "
        "pass, is reported at its origin. A NaN made from a deliberate -Inf (written from an infinite constant, "
        "or an additive mask of 0 and -inf in the data or a buffer) is reported where the NaN was made, naming "
        "the op that wrote the -Inf; a NaN made from any other Inf (an overflow, log(0)) is reported at that Inf. "
        "The rows (samples) that hold the bad values are given where the tensor has a batch dimension.",
        "- **underflow_overflow** sees module boundaries only. It decides on what the model returns, the loss, "
        "the gradients, the weights, and data given to the model that holds NaN/Inf other than an additive "
        "mask; when one of them is non-finite it blames, in execution order, the first module output that "
        "was not neutralised (a later module that took it returned finite values), or where a NaN/Inf it "
        "passed on entered: the model's input (the data) or the own ops of the calling module. A NaN a module "
        "made from an Inf it was given is that module's when the Inf can be an attention mask it takes (a -inf "
        "from the data, or reaching a softmax or attention module: a masked softmax); an Inf that the calling "
        "module's own ops made and handed to any other module (a Linear) is the caller's.",
        "",
        "## The table",
        "",
        "| model | fault | underflow_overflow: module, tensor, phase, samples | "
        "diagnose: op, module, phase, samples, cause |",
        "|---|---|---|---|",
    ]
    for arch, fault in CASES:
        uo, dg = EXPECTED[(arch, fault)]
        left = uo.detail if uo == FINITE else f"`{uo.module}` {uo.what} ({uo.detail}), {uo.phase}, samples {uo.samples}"
        right = dg.detail if dg == FINITE else (
            f"`{dg.what}` in `{dg.module}`, {dg.phase}, samples {dg.samples}; {dg.detail}")
        lines.append(f"| {ARCHS[arch].name} | {_FAULT_TEXT[fault]} | {left} | {right} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    target = Path(__file__).resolve().parents[2] / "docs" / "accuracy.md"
    target.write_text(render_markdown())
    print(f"written: {target}", file=sys.stderr)
